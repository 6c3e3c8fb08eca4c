"""Block size by formula (``simulate --sweep-block-size``): the terms, the choice, the command."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main
from pagedllm.config import SchedulerConfig
from pagedllm.sim.block_size import choose, neighbours, objective, parse_block_sizes, sweep
from pagedllm.sim.shapes import Device, ModelShape
from pagedllm.sim.simulator import StepTimeModel
from pagedllm.workloads.traces import TraceRequest, make_trace

TINY = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 512)


def test_block_sizes_are_powers_of_two_in_range():
    assert parse_block_sizes("32,8, 16,8") == [8, 16, 32]
    for bad in ("4,8", "24", "256", "x", ""):
        with pytest.raises(ValueError, match="--block-sizes"):
            parse_block_sizes(bad)


def test_the_choice_is_the_argmin_of_memory_share_plus_alpha_overhead():
    points = [{"block_size": 8, "memory": 0.4, "overhead": 0.30},   # 0.05 + a*0.30
              {"block_size": 16, "memory": 1.6, "overhead": 0.10},  # 0.10 + a*0.10
              {"block_size": 32, "memory": 6.4, "overhead": 0.05}]  # 0.20 + a*0.05
    for alpha, best in ((0.1, 8), (0.3, 16), (5.0, 32)):
        scored = [{**p, "objective": objective(p, alpha)} for p in points]
        assert choose(scored) == best, alpha
    assert objective(points[0], 0.5) == pytest.approx(0.05 + 0.15)
    assert neighbours(16, [8, 16, 32, 64]) == [8, 16, 32] and neighbours(8, [8, 16]) == [8, 16]


def test_sweep_terms_follow_their_definitions():
    trace = [TraceRequest(arrival=0.0, prompt_len=37 + 11 * i, output_len=5 + i) for i in range(12)]
    timing = StepTimeModel(TINY, Device("d", 10**9, 1e9, 1e9))
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)
    pool = 256 * 16 * TINY.kv_bytes_per_token(2.0)
    points = sweep(trace, timing, pool, sched, [8, 16, 32, 64], alpha=0.3, prefix_caching=False)
    assert [p["num_blocks"] for p in points] == [512, 256, 128, 64]  # the same bytes, bigger blocks
    for p in points:
        assert p["memory"] == pytest.approx(p["memory_share"] * p["block_size"], abs=1e-3)
        assert 0 <= p["memory"] < p["block_size"]
        assert p["objective"] == pytest.approx(p["memory_share"] + 0.3 * p["overhead"], abs=1e-5)
        assert p["finished"] == 12 and p["overhead"] > 0
    shares = [p["memory_share"] for p in points]
    assert shares == sorted(shares)  # larger blocks leave more of the last block empty
    entries = [p["table_entries_per_token"] for p in points]
    assert entries == sorted(entries, reverse=True)
    kernel = {8: 4e-6, 16: 2e-6, 32: 1e-6, 64: 1e-6}
    timed = sweep(trace, timing, pool, sched, [8, 16, 32, 64], 0.3, False, kernel_s_per_token=kernel)
    for p, q in zip(points, timed, strict=True):  # the kernel term: time above the fastest B, on decoded tokens
        assert 0 < q["decode_share"] < 1
        extra = (kernel[p["block_size"]] - 1e-6) * q["decode_share"] / q["token_s"]
        assert q["overhead"] - q["control_s_per_token"] / q["token_s"] == pytest.approx(extra, abs=2e-6)


def test_sweep_command_reports_a_choice_per_alpha(tmp_path, capsys):
    trace = make_trace("sharegpt", 60, seed=1)
    from pagedllm.workloads.traces import write_trace

    write_trace(tmp_path / "t.jsonl", trace)
    rc = main(["simulate", "--sweep-block-size", "--trace", str(tmp_path / "t.jsonl"), "--model", "llama-2-7b",
               "--device", "a100-80gb", "--block-sizes", "8,16,32", "--no-progress", "--plot", str(tmp_path),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [p["block_size"] for p in report["points"]] == [8, 16, 32]
    assert report["block_size_opt"] == choose(report["points"]) == report["by_alpha"]["0.3"]
    assert "B_opt = argmin Memory(B)/B + 0.3 * Overhead(B)" in capsys.readouterr().out
    assert (tmp_path / "block_size_sweep.png").stat().st_size > 0
    rc = main(["simulate", "--sweep-block-size", "--workload", "alpaca", "--num-requests", "5", "--kernel-times"])
    assert rc == 2 and "smollm2-135m" in capsys.readouterr().err
