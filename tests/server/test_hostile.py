"""The server under hostile input and load (issue 21): one request can fail itself, never its
neighbours, the batch or the engine. Each case asserts its 4xx in the OpenAI error shape **and**
that a normal request sent alongside completes correctly and the engine stays healthy after.

The server is the in-process app over a tiny random Llama with SmolLM2's tokenizer, served by
uvicorn on a real loopback port (8 running sequences, 64 queued: a capacity of 72, as in the
issue's reproduction)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pagedllm.server.app import build_app
from tests.server.conftest import serve_on_thread, tiny_context
from tests.server.test_errors import assert_all_free, assert_openai_error

NORMAL = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hostile(tiny_folder):
    """(url, ServerContext, the normal request's expected token ids)."""
    ctx = tiny_context(tiny_folder, num_kv_blocks=256, block_size=8, max_num_seqs=8)
    ctx.max_queue = 64
    with serve_on_thread(build_app(ctx)) as url:
        expected = httpx.post(url + "/v1/completions", json=NORMAL, timeout=60)
        assert expected.status_code == 200, expected.text
        yield url, ctx, expected.json()["choices"][0]["text"]
    ctx.engine.shutdown()


def assert_still_serving(url: str, ctx, expected_text: str) -> None:
    """A normal request completes with the expected text, /health is ok, every block is free."""
    r = httpx.post(url + "/v1/completions", json=NORMAL, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text
    assert httpx.get(url + "/health").status_code == 200
    assert_all_free(ctx)
    assert ctx.admitted == 0


def test_admission_is_counted_atomically_under_concurrency(hostile):
    """100 simultaneous requests against a capacity of 72: exactly 72 are admitted, 28 get 429
    with Retry-After. The engine thread is held while they arrive, so none can finish early and
    make room: before the fix every one of them passed the check (it read a count the engine
    thread updates only after the add)."""
    url, ctx, expected = hostile
    capacity = ctx.capacity
    assert capacity == 72
    total = capacity + 28
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    done = ctx.engine.call(hold)
    assert held.wait(60)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=total + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=NORMAL)) for _ in range(total)]
            deadline = time.monotonic() + 15
            while sum(t.done() for t in tasks) < total - capacity and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            release.set()  # the refused ones have answered (or the wait timed out): let the engine run
            return await asyncio.gather(*tasks)

    try:
        responses = asyncio.run(run())
    finally:
        release.set()
        done.result(60)
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 429]
    assert (len(ok), len(busy)) == (capacity, total - capacity), [r.status_code for r in responses]
    for r in busy:
        assert assert_openai_error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert all(r.json()["choices"][0]["text"] == expected for r in ok)
    assert_still_serving(url, ctx, expected)
