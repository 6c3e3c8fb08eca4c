"""What the KV dashboard shows of one engine, read at one step (``dashboard_state``): the block
states, the request tables, the queues and the prefix-cache counters. Used by the server's
``/dashboard/state`` and by each cluster replica's reports (``cluster/replica.py``).

Block states, one small int per block (``states`` is a string of digits, index = block id):
``0`` free (ref 0, no prefix-cache hash), ``1`` cached (ref 0, holds a hash: evictable, still
hittable), ``2`` used (ref 1: one request's), ``3`` shared (ref > 1: n > 1 siblings, beams,
prefix hits). ``tables`` maps each request holding blocks to its block ids (the owners).
"""

from __future__ import annotations

import time

from pagedllm.engine.engine import Engine
from pagedllm.kvcache.block_map import state_counts
from pagedllm.server.metrics import ServerMetrics

_DIGITS = bytes.maketrans(bytes(range(4)), b"0123")  # state codes (kvcache/block_map.py) as text


def _request_row(req) -> dict:
    return {"id": req.request_id, "computed": req.num_computed_tokens, "tokens": req.num_tokens,
            "total": req.num_prompt_tokens + req.max_tokens, "status": req.status.value}


def dashboard_state(engine: Engine, metrics: ServerMetrics) -> dict:
    """Everything the page shows, read at one engine step (call it on the engine thread, where
    ``metrics.on_output`` has counted every token of this step)."""
    stats = engine.stats()
    codes, tables = engine.kv_block_map()
    counts = state_counts(stats)
    counts["hashed"] = stats["num_cached_blocks"]
    running, waiting = engine.request_queues()
    return {
        "step": stats["num_steps"],
        "time": time.monotonic(),
        "layout": stats["kv_layout"],
        "num_blocks": stats["num_blocks"],
        "block_size": stats["block_size"],
        "states": codes.translate(_DIGITS).decode("ascii"),
        "tables": tables,
        "counts": counts,
        "usage": stats["usage"],
        "running": [_request_row(r) for r in running],
        "waiting": [_request_row(r) for r in waiting],
        "prefix_cache_queries": stats["prefix_cache_queries"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
        "generation_tokens": _counter_total(metrics.generation_tokens),
    }


def _counter_total(counter) -> float:
    """The ``_total`` sample of a prometheus ``Counter`` (public API, no registry walk)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return sample.value
    return 0.0
