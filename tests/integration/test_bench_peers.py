"""``pagedllm bench peers`` on a tiny model: without the peer venv (the vLLM part is skipped, saying
how to get it) and against a stand-in worker that speaks the vLLM worker's protocol (jobs are the
same prompts pagedllm ran, in alternating order, and the ratios are the medians' ratios). The real
vLLM comparison needs `make peers` and is not part of `make test`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm.bench.peers import parse_workloads
from pagedllm.cli import main as cli_main
from tests.conftest import make_tiny_checkpoint

STAND_IN = textwrap.dedent('''
    import json, sys, time
    log = open(sys.argv[1] + "/jobs.jsonl", "w")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        log.write(line); log.flush()
        n = sum(job["max_tokens"])
        time.sleep(0.01 * len(job["prompts"]))
        print(json.dumps({"seconds": 0.01 * len(job["prompts"]), "output_tokens": n,
                          "prompt_tokens": sum(len(p) for p in job["prompts"])}), flush=True)
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("peers") / "tiny", "llama", seed=4)


COMMON = ["--concurrency", "1,3", "--prefill", "2x12", "--input-len", "8", "--output-len", "3", "--rounds", "2",
          "--dtype", "float32", "--no-progress", "--seed", "5"]


def test_without_the_peer_venv_the_vllm_part_is_skipped(tiny, tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, *COMMON, "--peer-python", str(tmp_path / "missing"),
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "make peers" in report["vllm_skipped"] and "make peers" in capsys.readouterr().err
    assert [w["name"] for w in report["workloads"]] == ["decode x1", "decode x3", "prefill 2x12"]
    for w, (n, prompt_len, max_tokens) in zip(report["workloads"], [(1, 8, 3), (3, 8, 3), (2, 12, 1)], strict=True):
        assert w["vllm"] is None and w["ratio"] is None and len(w["pagedllm_runs"]) == 2
        for run in w["runs"]["pagedllm"]:
            assert run["output_tokens"] == n * max_tokens and run["prompt_tokens"] == n * prompt_len
        tokens = n * (prompt_len if max_tokens == 1 else max_tokens)
        assert w["pagedllm_runs"] == [pytest.approx(tokens / r["seconds"]) for r in w["runs"]["pagedllm"]]


def test_a_peer_gets_the_same_prompts_and_ratios_are_of_medians(tiny, tmp_path):
    worker = tmp_path / "stand_in.py"
    worker.write_text(STAND_IN)
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, *COMMON, "--peer-python", sys.executable,
                     "--peer-model", str(tmp_path), "--peer-worker", str(worker), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    jobs = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    assert len(jobs) == 1 + 2 * 3  # a warm-up, then every workload in every round
    sizes = [(len(j["prompts"]), len(j["prompts"][0]), j["max_tokens"][0]) for j in jobs[1:]]
    assert sizes == [(1, 8, 3), (3, 8, 3), (2, 12, 1)] * 2
    assert jobs[1]["prompts"] != jobs[4]["prompts"]  # fresh prompts each round: no prefix-cache hits
    for w in report["workloads"]:
        assert len(w["vllm_runs"]) == 2
        assert w["ratio"] == pytest.approx(w["pagedllm"] / w["vllm"])
        assert w["vllm"] == pytest.approx(sorted(w["vllm_runs"])[0] / 2 + sorted(w["vllm_runs"])[1] / 2)


def test_a_trace_runs_as_one_workload_with_its_output_lengths_and_sharing(tiny, tmp_path):
    from pagedllm.bench.traces import TraceRequest, write_trace

    trace = [TraceRequest(arrival=0.0, prompt_len=12, output_len=2, prefix_id="p", prefix_len=8),
             TraceRequest(arrival=1.0, prompt_len=10, output_len=5, prefix_id="p", prefix_len=8),
             TraceRequest(arrival=2.0, prompt_len=6, output_len=3)]
    write_trace(tmp_path / "t.jsonl", trace)
    worker = tmp_path / "stand_in.py"
    worker.write_text(STAND_IN)
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, "--trace", str(tmp_path / "t.jsonl"), "--rounds", "2",
                     "--dtype", "float32", "--no-progress", "--peer-python", sys.executable, "--peer-model",
                     str(tmp_path), "--peer-worker", str(worker), "--json", str(out)]) == 0
    (w,) = json.loads(out.read_text())["workloads"]
    assert w["name"] == "trace t.jsonl" and w["unit"] == "output tok/s"
    for run in w["runs"]["pagedllm"]:
        assert run["output_tokens"] == 10 and run["prompt_tokens"] == 12 + 10 + 6 + 3  # + each round's first token
    jobs = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()][1:]
    assert [j["max_tokens"] for j in jobs] == [[2, 5, 3]] * 2
    first, second = (j["prompts"] for j in jobs)
    assert first[0][:9] == first[1][:9] and first[0][9:] != first[1][9:]  # the shared prefix, after the round's token
    assert first[0][0] != second[0][0] and first[0][1:] == second[0][1:]  # rounds differ only in that token


HANGING = textwrap.dedent('''
    import json, os, subprocess, sys, time
    # an engine process of its own, as vLLM's worker has: same process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1] + "/pids", "w").write(f"{os.getpid()} {child.pid}")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        open(sys.argv[1] + "/busy", "w").close()
        time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits only for its reaper
        return f.read().split(") ")[-1][0] != "Z"


def test_terminating_the_benchmark_kills_the_peer_and_its_engine_processes(tiny, tmp_path):
    """`kill` on a running `bench peers` used to leave the worker's process group (its own
    session) running, competing with the next benchmark."""
    worker = tmp_path / "hanging.py"
    worker.write_text(HANGING)
    bench = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "bench", "peers", "--model", tiny, *COMMON,
                              "--peer-python", sys.executable, "--peer-model", str(tmp_path),
                              "--peer-worker", str(worker)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (tmp_path / "busy").exists():  # the peer is running its first job
        assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "the peer's processes outlived the benchmark"


@pytest.mark.parametrize("concurrency, prefill, message", [("0", "", "--concurrency"), ("", "32", "--prefill"),
                                                           ("", "", "no workloads")])
def test_bad_workloads_are_named(concurrency, prefill, message):
    with pytest.raises(ValueError, match=message):
        parse_workloads(concurrency, prefill, 8, 8)


def test_a_workload_given_twice_runs_once():
    assert [w.name for w in parse_workloads("1,8,1", "2x4,2x4", 8, 8)] == ["decode x1", "decode x8", "prefill 2x4"]
