"""``pagedllm plan``: the recommendation is the best simulated configuration, memory is the smallest
share that gives up nothing, and the command prints options the engine accepts."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main
from pagedllm.config import EngineOptions
from pagedllm.sim.plan import Candidate, rank_key, smallest_sufficient


def _result(share: float, tok_s: float, preempt: float = 0.0, rejected: int = 0, ttft: float = 1.0) -> dict:
    return {"candidate": Candidate(16, share, 64, 2048, "bfloat16"), "output_tokens_per_s": tok_s,
            "preemption_rate": preempt, "rejected": rejected, "ttft_p99_s": ttft}


def test_memory_is_the_smallest_share_that_gives_up_nothing():
    results = [_result(0.1, 80.0, preempt=0.5), _result(0.2, 99.0), _result(0.3, 100.0), _result(0.9, 100.0)]
    assert smallest_sufficient(results, 0.02)["candidate"].memory_share == 0.2
    assert smallest_sufficient(results, 0.0)["candidate"].memory_share == 0.3
    # as fast, but preempting more than the best: not sufficient
    results = [_result(0.1, 100.0, preempt=0.2), _result(0.5, 100.0, preempt=0.0)]
    assert smallest_sufficient(results, 0.02)["candidate"].memory_share == 0.5


def test_ranking_is_throughput_then_rejections_then_ttft():
    a, b, c = _result(0.2, 100.0, ttft=2.0), _result(0.2, 100.0, ttft=1.0), _result(0.2, 101.0, rejected=3)
    assert sorted([a, b, c], key=rank_key) == [c, b, a]


def test_plan_command_recommends_options_the_engine_accepts(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--workload", "alpaca", "--num-requests", "80", "--rate", "50", "--model", "llama-2-7b",
               "--device", "a100-80gb", "--block-sizes", "8,16", "--memory-shares", "0.05%,10%,50%",
               "--max-num-seqs", "8,64", "--max-num-batched-tokens", "512,2048", "--no-progress", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rec = report["recommended"]
    ranked = sorted(report["limits"] + report["dtypes"], key=lambda r: (-r["output_tokens_per_s"], r["rejected"],
                                                                         r["ttft_p99_s"], r["preemption_rate"]))
    assert rec["output_tokens_per_s"] == ranked[0]["output_tokens_per_s"] and len(report["runners_up"]) == 2
    best_b = min(report["block_sweep"], key=lambda p: (p["objective"], p["block_size"]))["block_size"]
    assert rec["candidate"]["block_size"] == best_b
    memory = {r["candidate"]["memory_share"]: r for r in report["memory"]}
    assert memory[0.0005]["rejected"] > 0 or memory[0.0005]["preemption_rate"] > 0  # 0.05%: too small
    assert report["memory_choice"]["candidate"]["memory_share"] == 0.1  # 10% gives up nothing against 50%
    assert set(report["memory_rule"]) == {"20%", "30%"}
    EngineOptions(**report["options"])  # the options are valid engine options
    text = capsys.readouterr().out
    assert "recommended:" in text and "runner-up 1:" in text and "pre-allocate 20-30% of memory) holds" in text


@pytest.mark.parametrize("flag, value, message", [("--dtypes", "int3", "--dtypes"),
                                                   ("--memory-shares", "0%", "--memory-shares"),
                                                   ("--max-num-seqs", "0", "--max-num-seqs")])
def test_bad_plan_arguments_are_named(flag, value, message, capsys):
    assert main(["plan", "--workload", "alpaca", "--num-requests", "5", flag, value, "--no-progress"]) == 2
    assert message in capsys.readouterr().err
