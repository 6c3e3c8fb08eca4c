"""Prefix-cache block hashes: width, per-process keying (xxh3_128), stability (sha256), salts.

A block hash is the prefix cache's key and no tokens are compared on a hit, so a hash an outsider
can predict (and collide) would let a crafted prompt poison a shared prefix.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.kvcache import KVCacheManager

B = 8
TOKENS = list(range(100, 100 + 4 * B))  # four full blocks
SRC = str(Path(__file__).resolve().parents[2] / "src")


def hashes_in_a_new_process(algo: str | None) -> list[int]:
    """The block hashes of TOKENS as a fresh Python process computes them."""
    kwargs = "" if algo is None else f", hash_algo={algo!r}"
    code = ("from pagedllm.kvcache import KVCacheManager\n"
            f"print(KVCacheManager(4, {B}{kwargs}).block_hashes('r', {TOKENS}))")
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [int(h) for h in out.stdout.strip()[1:-1].split(",")]


def test_default_block_hashes_are_128_bits_wide():
    hashes = KVCacheManager(4, B).block_hashes("r", TOKENS)
    assert len(hashes) == 4
    assert all(0 <= h < 2**128 for h in hashes)
    # four uniform 128-bit values all below 2^64: probability 2^-256
    assert max(hashes) >= 2**64


def test_default_hashes_are_keyed_per_process():
    first, second = hashes_in_a_new_process(None), hashes_in_a_new_process(None)
    assert len(first) == len(second) == 4
    assert not set(first) & set(second)  # every block's key differs between the two processes
    here = KVCacheManager(4, B).block_hashes("r", TOKENS)
    assert not set(here) & set(first)


def test_xxh3_128_seed_sets_the_key():
    from pagedllm.kvcache.hashing import BlockHasher

    a1, a2, b = BlockHasher("xxh3_128", seed=1), BlockHasher("xxh3_128", seed=1), BlockHasher("xxh3_128", seed=2)
    assert a1.hash_block(0, TOKENS[:B]) == a2.hash_block(0, TOKENS[:B]) != b.hash_block(0, TOKENS[:B])


def test_sha256_is_256_bits_and_the_same_in_every_process():
    here = KVCacheManager(4, B, hash_algo="sha256").block_hashes("r", TOKENS)
    assert hashes_in_a_new_process("sha256") == here
    assert max(here) >= 2**128 and all(0 <= h < 2**256 for h in here)
    # the first block is sha256 of (root hash, 32 bytes) + its token ids as little-endian int64
    root = (0).to_bytes(32, "little") + b"".join(t.to_bytes(8, "little", signed=True) for t in TOKENS[:B])
    assert here[0] == int.from_bytes(hashlib.sha256(root).digest(), "little")


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_hash_chain_depends_on_parent_tokens_and_salt(algo):
    from pagedllm.kvcache.hashing import ROOT_HASH, BlockHasher

    h = BlockHasher(algo)
    a = h.hash_block(ROOT_HASH, [1, 2, 3])
    assert a == h.hash_block(ROOT_HASH, [1, 2, 3])
    assert a != h.hash_block(ROOT_HASH, [1, 2, 4])
    assert a != h.hash_block(ROOT_HASH, [1, 2, 3], b"tenant-a")
    assert h.hash_block(a, [5]) != h.hash_block(h.hash_block(ROOT_HASH, [9, 9, 9]), [5])


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_salts_separate_every_block_and_equal_salts_share(algo):
    kv = KVCacheManager(4, B, hash_algo=algo)
    plain = kv.block_hashes("plain", TOKENS)
    tenant_a = kv.block_hashes("a", TOKENS, salt="tenant-a")
    tenant_b = kv.block_hashes("b", TOKENS, salt="tenant-b")
    assert kv.block_hashes("a2", TOKENS, salt="tenant-a") == tenant_a
    assert len(set(plain) | set(tenant_a) | set(tenant_b)) == 12  # the salt changes every block downstream


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_prefix_hits_work_with_each_algorithm(algo):
    kv = KVCacheManager(num_blocks=8, block_size=B, hash_algo=algo)
    assert kv.allocate_slots("a", len(TOKENS))
    kv.cache_full_blocks("a", TOKENS, len(TOKENS))
    first = kv.block_ids("a")
    kv.free("a")
    assert [b.block_id for b in kv.cached_prefix("b", TOKENS + [7])] == first
    assert [b.block_id for b in kv.cached_prefix("c", TOKENS[:2 * B] + [7])] == first[:2]
    assert kv.cached_prefix("d", TOKENS + [7], salt="other") == []
    kv.check_invariants()


def test_an_unknown_hash_algorithm_is_rejected_by_name():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(4, B, hash_algo="md5")
    from pagedllm.kvcache.hashing import HASH_ALGOS

    assert HASH_ALGOS == ("xxh3_128", "sha256")
