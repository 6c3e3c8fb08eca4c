"""``pagedllm bench peers`` on a tiny model: without the peer venvs (each peer's part is skipped,
saying how to get it) and against stand-in workers that speak the peer workers' protocol (jobs are
the same prompts pagedllm ran, in alternating order; the ratios are the medians' ratios, to each
peer's fastest setting; a setting far slower than its peer's fastest is dropped after round 1;
agreement is computed from the token ids returned). The real comparisons need `make peers` and are
not part of `make test`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm.bench.peer_workers import parse_peers
from pagedllm.bench.peers import context_per_sequence, greedy_agreement, parse_workloads
from pagedllm.cli import main as cli_main
from tests.conftest import make_tiny_checkpoint

# argv: the vLLM worker's (HF folder, dtype, max_num_seqs) or llama.cpp's (GGUF file, n_seq_max,
# ctx per sequence, threads); jobs go to jobs-<argv[2]>.jsonl beside argv[1]; "bfloat16" is 10x slower
STAND_IN = textwrap.dedent('''
    import json, os, sys, time
    where = sys.argv[1] if os.path.isdir(sys.argv[1]) else os.path.dirname(sys.argv[1])
    log = open(f"{where}/jobs-{sys.argv[2]}.jsonl", "w")
    open(f"{where}/argv-{sys.argv[2]}.json", "w").write(json.dumps(sys.argv[1:]))
    slow = 10 if sys.argv[2] == "bfloat16" else 1
    print(json.dumps({"ready": True, "system_info": "stand-in"}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        log.write(line); log.flush()
        n = sum(job["max_tokens"])
        time.sleep(0.01 * slow * len(job["prompts"]))
        ids = [[(p[-1] + i) % 7 for i in range(m)] for p, m in zip(job["prompts"], job["max_tokens"])]
        print(json.dumps({"seconds": 0.01 * slow * len(job["prompts"]), "output_tokens": n, "token_ids": ids,
                          "prompt_tokens": sum(len(p) for p in job["prompts"])}), flush=True)
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("peers") / "tiny", "llama", seed=4)


COMMON = ["--concurrency", "1,3", "--prefill", "2x12", "--input-len", "8", "--output-len", "3", "--rounds", "2",
          "--dtype", "float32", "--no-progress", "--seed", "5", "--peer-dtype", "float32"]


def test_without_the_peer_venvs_each_peer_is_skipped(tiny, tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, *COMMON, "--peer", "vllm,llama.cpp",
                     "--peer-python", str(tmp_path / "missing"), "--llamacpp-python", str(tmp_path / "missing"),
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    vllm, llamacpp = report["skipped"]
    err = capsys.readouterr().err
    assert vllm.startswith("vLLM part skipped") and "make peers" in vllm and vllm in err
    assert llamacpp.startswith("llama.cpp part skipped") and "make peers" in llamacpp and llamacpp in err
    assert [w["name"] for w in report["workloads"]] == ["decode x1", "decode x3", "prefill 2x12"]
    for w, (n, prompt_len, max_tokens) in zip(report["workloads"], [(1, 8, 3), (3, 8, 3), (2, 12, 1)], strict=True):
        assert w["peers"] == {} and w["settings"] == {} and len(w["pagedllm_runs"]) == 2
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
    jobs = [json.loads(line) for line in (tmp_path / "jobs-float32.jsonl").read_text().splitlines()]
    assert len(jobs) == 1 + 2 * 3  # a warm-up, then every workload in every round
    sizes = [(len(j["prompts"]), len(j["prompts"][0]), j["max_tokens"][0]) for j in jobs[1:]]
    assert sizes == [(1, 8, 3), (3, 8, 3), (2, 12, 1)] * 2
    assert jobs[1]["prompts"] != jobs[4]["prompts"]  # fresh prompts each round: no prefix-cache hits
    for w in report["workloads"]:
        entry = w["settings"]["vllm float32"]
        assert len(entry["runs"]) == 2 and not entry["dropped"]
        assert entry["median"] == pytest.approx(sorted(entry["runs"])[0] / 2 + sorted(entry["runs"])[1] / 2)
        assert w["peers"]["vllm"] == {"best": "float32", "median": entry["median"],
                                      "ratio": pytest.approx(w["pagedllm"] / entry["median"])}


def test_every_peer_setting_runs_the_same_jobs_and_the_fastest_counts(tiny, tmp_path):
    """vLLM at two dtypes and llama.cpp: every setting gets pagedllm's prompts; bf16 (10x slower
    here) is dropped after round 1 and float32 counts; agreement comes from the returned ids."""
    worker = tmp_path / "stand_in.py"
    worker.write_text(STAND_IN)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, *COMMON, "--peer", "vllm,llama.cpp",
                     "--peer-dtype", "bfloat16,float32", "--peer-python", sys.executable, "--peer-model",
                     str(tmp_path), "--llamacpp-python", sys.executable, "--llamacpp-model", str(gguf),
                     "--peer-worker", str(worker), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["peers"] == ["vllm bfloat16", "vllm float32", "llama.cpp gguf"]
    assert report["peer_info"]["llama.cpp gguf"] == {"system_info": "stand-in"}
    assert json.loads((tmp_path / "argv-64.json").read_text()) == [str(gguf), "64", "256", str(os.cpu_count())]
    jobs = {name: [json.loads(line) for line in (tmp_path / f"jobs-{name}.jsonl").read_text().splitlines()]
            for name in ("bfloat16", "float32", "64")}
    assert [len(j) for j in jobs.values()] == [1 + 3, 1 + 2 * 3, 1 + 2 * 3]  # bf16: warm-up and round 1 only
    assert jobs["bfloat16"] == jobs["float32"][:4] and jobs["float32"] == jobs["64"]
    for w in report["workloads"]:
        bf16, fp32, llamacpp = (w["settings"][k] for k in report["settings"]["peers"])
        assert len(bf16["runs"]) == 1 and bf16["dropped"] == "10.0x slower than vllm's fastest setting in round 1"
        assert len(fp32["runs"]) == 2 and fp32["dropped"] is None and llamacpp["dropped"] is None
        assert w["peers"]["vllm"]["best"] == "float32" and w["peers"]["llama.cpp"]["best"] == "gguf"
        assert w["peers"]["llama.cpp"]["ratio"] == pytest.approx(w["pagedllm"] / llamacpp["median"])
        if w["name"].startswith("prefill"):
            assert "agreement" not in fp32
            continue
        ours, theirs = w["runs"]["pagedllm"], w["runs"]["llama.cpp gguf"]
        scores = [greedy_agreement(a["token_ids"], b["token_ids"]) for a, b in zip(ours, theirs, strict=True)]
        mean = {k: pytest.approx(sum(s[k] for s in scores) / 2) for k in ("prefix", "identical")}
        assert llamacpp["agreement"] == mean
        assert bf16["agreement"] == greedy_agreement(ours[0]["token_ids"], w["runs"]["vllm bfloat16"][0]["token_ids"])


def test_greedy_agreement_counts_tokens_before_the_first_difference():
    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == {"prefix": (2 / 4 + 1) / 2,
                                                                                "identical": 0.5}
    assert greedy_agreement([[1, 2]], [[1, 2, 3]]) == {"prefix": 2 / 3, "identical": 0.0}
    with pytest.raises(ValueError, match="1 outputs against 2"):
        greedy_agreement([[1]], [[1], [2]])


def test_llamacpp_context_holds_the_longest_request():
    assert context_per_sequence(parse_workloads("4", "2x300", 128, 128)) == 512  # 301 tokens, rounded to 256
    assert context_per_sequence(parse_workloads("1", "", 8, 3)) == 256


@pytest.mark.parametrize("peers, dtypes, message", [("vllm,sglang", "float32", "--peer: 'sglang'"),
                                                    ("vllm", "int8", "--peer-dtype: 'int8'"),
                                                    ("vllm", "", "at least one")])
def test_bad_peers_are_named(peers, dtypes, message):
    with pytest.raises(ValueError, match=message):
        parse_peers(peers, dtypes)
    assert parse_peers("llama.cpp", "") == (["llama.cpp"], [])


def test_a_trace_runs_as_one_workload_with_its_output_lengths_and_sharing(tiny, tmp_path):
    from pagedllm.workloads.traces import TraceRequest, write_trace

    trace = [TraceRequest(arrival=0.0, prompt_len=12, output_len=2, prefix_id="p", prefix_len=8),
             TraceRequest(arrival=1.0, prompt_len=10, output_len=5, prefix_id="p", prefix_len=8),
             TraceRequest(arrival=2.0, prompt_len=6, output_len=3)]
    write_trace(tmp_path / "t.jsonl", trace)
    worker = tmp_path / "stand_in.py"
    worker.write_text(STAND_IN)
    out = tmp_path / "peers.json"
    assert cli_main(["bench", "peers", "--model", tiny, "--trace", str(tmp_path / "t.jsonl"), "--rounds", "2",
                     "--dtype", "float32", "--peer-dtype", "float32", "--no-progress", "--peer-python",
                     sys.executable, "--peer-model", str(tmp_path), "--peer-worker", str(worker),
                     "--json", str(out)]) == 0
    (w,) = json.loads(out.read_text())["workloads"]
    assert w["name"] == "trace t.jsonl" and w["unit"] == "output tok/s"
    for run in w["runs"]["pagedllm"]:
        assert run["output_tokens"] == 10 and run["prompt_tokens"] == 12 + 10 + 6 + 3  # + each round's first token
    jobs = [json.loads(line) for line in (tmp_path / "jobs-float32.jsonl").read_text().splitlines()][1:]
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
