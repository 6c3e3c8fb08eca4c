"""The live KV-block dashboard: ``GET /dashboard`` (a page) and ``GET /dashboard/state`` (its data).

Owns nothing between requests: every poll of ``/dashboard/state`` reads the engine afresh, ON THE
ENGINE THREAD (``AsyncEngine.call``), between two steps, so the blocks, queues and counters it
returns all belong to one step, ``step`` (``Engine.num_steps``, the number ``/metrics`` exports as
``pagedllm:engine_steps_total``). The page (``static/dashboard.{html,js,css}``, shipped as package
data: no build step, no CDN) polls it, draws every block on a canvas and keeps a short history for
its usage / hit-rate chart and tokens/s; the page owns that history, the server keeps none.
A cluster's ingress (``cluster/ingress.py``) answers with every replica's state, as each last
reported it: ``{"replicas": [{"replica": id, ...one engine's state...}, ...]}``, and the page draws
one pool per replica.

Block states and tables: ``server/dashboard_state.py``. Relations to ``/metrics`` at the same
step: ``free + cached == num_free_blocks``, ``used + shared == num_blocks - num_free_blocks``,
``hashed == num_cached_blocks`` (blocks holding a prefix-cache entry, in use or not). The
contiguous layout has no prefix cache: its blocks are free or used.

Its cost on the engine thread is proportional to the blocks held in tables plus the cached ones,
not to the pool size; encoding the JSON happens on the event loop (figures: docs/design.md,
"Figures behind the code's choices").
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedllm.server.errors import OpenAIError
from pagedllm.server.serving import ServerContext

STATIC = Path(__file__).with_name("static")  # package data (pyproject.toml)
STATIC_FILES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def install_dashboard(app: FastAPI, ctx: ServerContext) -> None:
    """Add ``/dashboard``, its two assets and ``/dashboard/state`` to ``app``."""
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
        state = await ctx.dashboard_state()
        return JSONResponse(state, headers={"Cache-Control": "no-store"})  # json.dumps; no jsonable_encoder walk
