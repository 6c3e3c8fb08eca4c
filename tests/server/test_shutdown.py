"""SIGINT / SIGTERM shut ``pagedllm serve`` down cleanly: an in-flight stream ends with an error
chunk and ``[DONE]``, and the process exits with 0; a test server goes with the test process that
started it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_aborts_in_flight_streams_and_exits_0(sig, tiny_folder):
    server = ServerProcess("--model", tiny_folder, "--dtype", "float32", "--served-model-name", "tiny")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        code, output = server.stop(sig)
        events = [line for line in lines if line]
    assert code == 0, output
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    assert "Traceback" not in output


def test_a_server_goes_when_the_test_process_that_started_it_is_killed(tiny_folder):
    """A pytest killed with SIGKILL runs no fixture teardown: ``ServerProcess``'s server gets SIGTERM
    from the kernel when its parent goes (``dying_with_parent``), and leaves instead of running on."""
    root = Path(__file__).resolve().parents[2]
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         f"sys.path.insert(0, {str(root)!r})\n"
         "from tests.server.conftest import ServerProcess\n"
         f"server = ServerProcess('--model', {tiny_folder!r}, '--dtype', 'float32')\n"
         "print(server.proc.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        server_pid = int(starter.stdout.readline())
        assert alive(server_pid)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 60
    while alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(server_pid), "the server outlived the process that started it"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
