"""The live KV-block dashboard: ``GET /dashboard`` (a page) and ``GET /dashboard/state`` (its data).

Owns nothing between requests: every poll of ``/dashboard/state`` reads the engine afresh, ON THE
ENGINE THREAD (``AsyncEngine.call``), between two steps, so the blocks, queues and counters it
returns all belong to one step, ``step`` (``Engine.num_steps``, the number ``/metrics`` exports as
``pagedllm:engine_steps_total``). The page (``static/dashboard.{html,js,css}``, shipped as package
data: no build step, no CDN) polls it, draws every block on a canvas and keeps a short history for
its usage / hit-rate chart and tokens/s; the page owns that history, the server keeps none.

Block states, one small int per block (``states`` is a string of digits, index = block id):
``0`` free (ref 0, no prefix-cache hash), ``1`` cached (ref 0, holds a hash: evictable, still
hittable), ``2`` used (ref 1: one request's), ``3`` shared (ref > 1: n > 1 siblings, beams,
prefix hits). ``tables`` maps each request holding blocks to its block ids (the owners).
Relations to ``/metrics`` at the same step: ``free + cached == num_free_blocks``,
``used + shared == num_blocks - num_free_blocks``, ``hashed == num_cached_blocks`` (blocks holding
a prefix-cache entry, in use or not). The contiguous layout has no prefix cache: its blocks are
free or used.

Its cost on the engine thread is proportional to the blocks held in tables plus the cached ones,
not to the pool size; encoding the JSON happens on the event loop (figures: docs/design.md,
"Figures behind the code's choices").
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.engine import Engine
from pagedllm.kvcache.block_map import state_counts
from pagedllm.server.errors import OpenAIError
from pagedllm.server.serving import ServerContext

_DIGITS = bytes.maketrans(bytes(range(4)), b"0123")  # state codes (kvcache/block_map.py) as text
STATIC = Path(__file__).with_name("static")  # package data (pyproject.toml)
STATIC_FILES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _request_row(req) -> dict:
    return {"id": req.request_id, "computed": req.num_computed_tokens, "tokens": req.num_tokens,
            "total": req.num_prompt_tokens + req.max_tokens, "status": req.status.value}


def dashboard_state(engine: Engine) -> dict:
    """Everything the page shows, read at one engine step (call it on the engine thread)."""
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
    }


def _counter_total(counter) -> float:
    """The ``_total`` sample of a prometheus ``Counter`` (public API, no registry walk)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return sample.value
    return 0.0


def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def install_dashboard(app: FastAPI, ctx: ServerContext) -> None:
    """Add ``/dashboard``, its two assets and ``/dashboard/state`` to ``app``."""
    engine = ctx.engine.engine

    def read_state() -> dict:  # the engine thread: on_output has counted every token of this step
        state = dashboard_state(engine)
        state["generation_tokens"] = _counter_total(ctx.metrics.generation_tokens)
        return state

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str):
        if name not in STATIC_FILES:
            raise OpenAIError(404, f"no dashboard asset named {name!r}", code="not_found")
        return Response(_static(name), media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state")
    async def dashboard_data():
        state = await asyncio.wrap_future(ctx.engine.call(read_state))
        return JSONResponse(state, headers={"Cache-Control": "no-store"})  # json.dumps; no jsonable_encoder walk
