"""SIGINT / SIGTERM shut ``pagedllm serve`` down cleanly: an in-flight stream ends with an error
chunk and ``[DONE]``, and the process exits with 0."""

from __future__ import annotations

import json
import signal

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
