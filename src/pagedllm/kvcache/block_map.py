"""The pool at a glance: each block's state (free, cached, used, shared) and each request's blocks.

What the dashboard draws. Read from a manager's public view (``tables`` and
``cached_block_ids``), visiting the prefix cache's blocks and the blocks of every table, never
the whole pool: a block in no table has ref count 0 (the managers' invariant), so it is cached if
the prefix cache holds it and free otherwise. The counts of each state equal the manager's
``stats()`` (``num_free_blocks`` - ``num_idle_cached_blocks``, ``num_idle_cached_blocks``,
``num_used_blocks`` - ``num_shared_blocks``, ``num_shared_blocks``).
"""

from __future__ import annotations

from pagedllm.kvcache.interface import KVCacheManagerProtocol

FREE, CACHED, USED, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "used", "shared")


def block_map(kv: KVCacheManagerProtocol) -> tuple[bytearray, dict[str, list[int]]]:
    """(one state code per block, request id -> its block ids)."""
    codes = bytearray(kv.num_blocks)
    for block_id in kv.cached_block_ids():
        codes[block_id] = CACHED
    tables: dict[str, list[int]] = {}
    for request_id, table in kv.tables.items():
        ids = []
        for block in table.blocks:
            codes[block.block_id] = USED if block.ref_count == 1 else SHARED
            ids.append(block.block_id)
        tables[request_id] = ids
    return codes, tables


def state_counts(stats: dict) -> dict[str, int]:
    """Blocks in each state, from a manager's ``stats()``."""
    idle_cached, shared = stats["num_idle_cached_blocks"], stats["num_shared_blocks"]
    return {"free": stats["num_free_blocks"] - idle_cached, "cached": idle_cached,
            "used": stats["num_used_blocks"] - shared, "shared": shared}
