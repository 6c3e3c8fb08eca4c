"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and extra keys (the request's
``cache_salt`` goes into the first block, so two salts never share anything downstream). The hash
is the prefix cache's only key (a hit compares no tokens), so it must not be predictable from
outside: a prompt crafted to collide with another tenant's block would be served that block's K/V.

Algorithms (``HASH_ALGOS``, vLLM's ``prefix_caching_hash_algo``):
- ``xxh3_128`` (default): 128-bit xxh3 seeded with ``PROCESS_HASH_SEED``, 64 random bits drawn once
  per process, so hashes differ between processes and cannot be precomputed. Fast.
- ``sha256``: hashlib's sha256, unkeyed: the same in every process and on every machine (token ids
  are packed as little-endian int64), for caches shared or compared across processes.

Hashes are non-negative ints of the algorithm's digest width (``digest_bits``); ``ROOT_HASH`` is the
first block's parent. Invariant: one ``BlockHasher`` maps equal (parent, tokens, extra) to equal
hashes, and the chain makes a block's hash depend on every token before it.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Sequence

import xxhash

from pagedllm.config import HASH_ALGOS

DEFAULT_HASH_ALGO = "xxh3_128"
ROOT_HASH = 0
PROCESS_HASH_SEED = secrets.randbits(64)  # the xxh3_128 key of this process; tests pass their own

_DIGEST_BYTES = {"xxh3_128": 16, "sha256": 32}


class BlockHasher:
    """Computes chained block hashes with one algorithm (and, for ``xxh3_128``, one seed)."""

    __slots__ = ("algo", "seed", "_digest_bytes")

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, seed: int | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        self.algo = algo
        self.seed = PROCESS_HASH_SEED if seed is None else seed
        self._digest_bytes = _DIGEST_BYTES[algo]

    @property
    def digest_bits(self) -> int:
        return 8 * self._digest_bytes

    def hash_block(self, parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
        h = xxhash.xxh3_128(seed=self.seed) if self.algo == "xxh3_128" else hashlib.sha256()
        h.update(parent.to_bytes(self._digest_bytes, "little"))
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        if extra:
            h.update(len(extra).to_bytes(4, "little"))
            h.update(extra)
        return int.from_bytes(h.digest(), "little")

    def extend(self, hashes: list[int], token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> None:
        """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``."""
        for i in range(len(hashes), len(token_ids) // block_size):
            parent = hashes[-1] if hashes else ROOT_HASH
            block = token_ids[i * block_size:(i + 1) * block_size]
            hashes.append(self.hash_block(parent, block, salt if i == 0 else b""))

