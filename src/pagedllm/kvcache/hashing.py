"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and extra keys (the request's
``cache_salt`` goes into the first block, so two salts never share anything downstream).
xxh3-64 over the packed bytes: fast, and collisions across 2^64 are not a practical concern.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return h.intdigest()


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt if i == 0 else b""))
