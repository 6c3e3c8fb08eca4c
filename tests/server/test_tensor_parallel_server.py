"""``pagedllm serve --tensor-parallel-size 2``: the official client gets one rank's tokens; a worker
killed under the server turns it unhealthy (503) with the rank named in its log; Ctrl-C (SIGINT to
the whole process group, as a terminal sends it) and kill -9 of the server leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.server.conftest import ServerProcess


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def tp_workers(pid: int) -> list[int]:
    """The tensor-parallel workers under ``pid``: the children of its fork server (``parallel/ranks.py``)."""
    servers = [c for c in children(pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [w for server in servers for w in children(server)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(") ")[-1][0] != "Z"


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def expected(tiny_folder):
    llm = LLM(model=tiny_folder, dtype="float32", num_kv_blocks=64)
    return llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0].text


def test_a_served_tensor_parallel_engine_answers_then_a_dead_worker_makes_it_unhealthy(tiny_folder, expected):
    server = ServerProcess("--model", tiny_folder, "--dtype", "float32", "--served-model-name", "tiny",
                           "--num-kv-blocks", "64", "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
        assert out.choices[0].text == expected
        workers = tp_workers(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, 30)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4)
        assert e.value.status_code == 503
    finally:
        code, output = server.stop(signal.SIGTERM)
    assert "tensor-parallel worker rank 1" in output
    assert code == 0, output


@pytest.mark.parametrize("ending", ["ctrl-c", "kill -9"])
def test_ending_the_server_leaves_no_process(tiny_folder, ending):
    """Ctrl-C: the server exits 0 and stops its workers. kill -9 of the server alone: nothing runs
    its shutdown, and the workers (and the fork server they came from) still leave, by themselves."""
    from tests.server.conftest import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--model", tiny_folder, "--dtype",
         "float32", "--num-kv-blocks", "64", "--tensor-parallel-size", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def healthy():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, 180)
        workers = tp_workers(proc.pid)
        assert len(workers) == 1
        workers += children(proc.pid)  # the fork server, multiprocessing's resource tracker
        if ending == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
            assert proc.wait(30) == 0
        else:
            proc.kill()
            assert proc.wait(30) == -signal.SIGKILL
        assert wait_until(lambda: not any(alive(w) for w in workers), 15)
        left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        running = [line for line in left.strip().splitlines()[1:] if line.split()[1][0] != "Z"]
        assert running == [], left  # an exited child waiting to be reaped by init (a zombie) runs nothing
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
