"""Where the engine runs: ``AsyncEngine`` given a factory builds the engine on its own thread and
steps it there, and ``pagedllm serve`` uses that, so the main (uvicorn) thread never runs a torch
parallel region (one that did made every later step on the engine thread ~40% slower, see
``engine/async_engine.py``)."""

from __future__ import annotations

import threading

import pytest

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.builder import build_engine
from pagedllm.engine.engine import Engine
from pagedllm.engine.sampling_params import SamplingParams


def _tiny_options(folder) -> dict:
    return dict(model=folder, dtype="float32", num_kv_blocks=32, block_size=8, max_num_seqs=2)


def test_a_factory_builds_and_steps_the_engine_on_the_engine_thread(tiny_folder):
    seen: dict[str, set[str]] = {"build": set(), "step": set()}

    def build() -> Engine:
        seen["build"].add(threading.current_thread().name)
        engine = build_engine(**_tiny_options(tiny_folder))
        step = engine.step

        def recorded_step():
            seen["step"].add(threading.current_thread().name)
            return step()

        engine.step = recorded_step
        return engine

    async_engine = AsyncEngine(build)
    try:
        add = lambda: async_engine.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3))  # noqa: E731
        async_engine.call(add).result(30)
        while async_engine.call(async_engine.engine.has_unfinished).result(30):
            pass
        assert seen == {"build": {"pagedllm-engine"}, "step": {"pagedllm-engine"}}
        assert async_engine.engine.kv_cache_stats()["num_free_blocks"] == 32
    finally:
        async_engine.shutdown()


def test_a_factory_that_fails_raises_in_the_constructor():
    def build() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)


def test_serve_builds_the_engine_off_the_main_thread(tiny_folder, monkeypatch):
    """``serve`` hands ``AsyncEngine`` a factory: ``build_engine`` runs on the engine thread."""
    from pagedllm.server import serve as serve_module

    threads = []

    def build(**options):
        threads.append(threading.current_thread().name)
        return build_engine(**options)

    monkeypatch.setattr(serve_module, "build_engine", build)
    monkeypatch.setattr(serve_module._Server, "run", lambda self: None)  # no sockets: just the setup
    assert serve_module.serve(_tiny_options(tiny_folder), port=0) == 0
    assert threads == ["pagedllm-engine"]
