"""Server fixtures: a real ``pagedllm serve`` process on a free loopback port (the embedded SmolLM2
in float32, so its greedy outputs equal ``LLM.generate``'s), and an in-process app over a tiny
random Llama with SmolLM2's tokenizer for the error paths."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from tests.conftest import make_tiny_checkpoint
from tests.server.sent_fields import recording


@pytest.fixture(scope="session", autouse=True)
def record_sent_fields():
    """Every request body the server tests send (``sent_fields.py``), for test_zz_every_field_is_sent."""
    with recording():
        yield


# ``python -c`` preamble of ``dying_with_parent``: argv[1] the parent's pid, argv[2] the module to run
DIE_WITH_PARENT = """\
import ctypes, os, runpy, signal, sys
parent, module = int(sys.argv[1]), sys.argv[2]
del sys.argv[1:3]
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # the parent went before the line above
    sys.exit(1)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def dying_with_parent(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` that gets SIGTERM when the thread that starts it
    ends (Linux's parent-death signal): a test process killed or interrupted would otherwise leave
    its servers, and a server's Ray cluster or tensor-parallel workers, running. Start it from the
    thread that outlives it (fixtures and tests run on the main one)."""
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), module, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m pagedllm serve ...`` in a subprocess, ready once /health answers."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = tempfile.TemporaryFile("w+")  # noqa: SIM115 - a pipe could fill up and block the server
        self.proc = subprocess.Popen(dying_with_parent("pagedllm", "serve", "--port", str(self.port), *args),
                                     stdout=self.output, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.read_output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("the server did not become healthy in time")

    def read_output(self) -> str:
        self.output.seek(0)
        return self.output.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.read_output()


@contextlib.contextmanager
def serve_on_thread(app, config=None):
    """Serve ``app`` with uvicorn on a thread, on a free loopback port; yields its base URL.
    ``config``: a function (app, host, port) -> ``uvicorn.Config`` (default: uvicorn's, on asyncio's loop)."""
    import uvicorn

    port = free_port()
    default = lambda a, h, p: uvicorn.Config(a, host=h, port=p, log_level="warning", loop="asyncio")  # as serve's
    config = (config or default)(app, "127.0.0.1", port)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def engine_held(ctx):
    """Hold the engine thread between two steps until the block exits."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    done = ctx.engine.call(hold)
    try:
        assert held.wait(60), "the engine thread never ran the hold"
        yield
    finally:
        release.set()
        done.result(60)


@pytest.fixture(scope="session")
def server():
    """The embedded SmolLM2 in float32 behind ``pagedllm serve``."""
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", "256MiB", "--served-model-name", "smollm")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("served") / "tiny", "llama", seed=2, with_tokenizer=True)


def tiny_context(folder: str, **options):
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.builder import build_engine
    from pagedllm.server.metrics import ServerMetrics
    from pagedllm.server.serving import ServerContext

    opts = dict(model=folder, dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4)
    opts.update(options)
    engine = build_engine(**opts)
    metrics = ServerMetrics()
    return ServerContext(AsyncEngine(engine, on_output=metrics.on_output), "tiny", max_queue=4, metrics=metrics)


@pytest.fixture(scope="module")
def tiny_app(tiny_folder):
    """(TestClient, ServerContext) of an in-process app over a tiny random Llama."""
    from pagedllm.server.app import build_app

    ctx = tiny_context(tiny_folder)
    with TestClient(build_app(ctx, max_body_bytes=64 * 1024), raise_server_exceptions=False) as client:
        yield client, ctx
    ctx.engine.shutdown()
