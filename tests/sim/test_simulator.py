"""The simulator replays a trace through the engine's own scheduler and KV manager: on the same
trace and configuration it must agree with the real engine step for step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm import LLM
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.sim.engine_replay import replay
from pagedllm.sim.shapes import MODELS, Device, ModelShape
from pagedllm.sim.simulator import StepTimeModel, simulate
from pagedllm.workloads.traces import TraceRequest, make_trace
from tests.conftest import make_tiny_checkpoint

TINY = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 512)
SLOW_CPU = Device("test", 10**9, 1e9, 1e9)


def _agreement_trace() -> list[TraceRequest]:
    """All at t=0: requests on two shared prefixes (prefix hits), long enough to overflow the pool
    (preemptions), outputs of different lengths (a finish order to match)."""
    out = []
    for i in range(10):
        out.append(TraceRequest(arrival=0.0, prompt_len=30 + 9 * (i % 4), output_len=8 + 7 * (i % 3),
                                prefix_id=f"p{i % 2}", prefix_len=24))
    return out


def test_simulator_agrees_with_the_engine_on_blocks_preemptions_hits_and_finish_order(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama")
    trace = _agreement_trace()
    for layout in ("paged", "contiguous"):
        llm = LLM(model=folder, dtype="float32", block_size=8, num_kv_blocks=24, max_num_seqs=6,
                  max_num_batched_tokens=64, kv_layout=layout, max_model_len=128)
        real = replay(llm.engine, trace, time_scale=0.0)
        cfg = llm.engine.config
        used = []
        sim = simulate(trace, StepTimeModel(TINY, SLOW_CPU), cfg.cache, cfg.scheduler, llm.engine.kv_manager.num_blocks,
                       vocab_size=cfg.model.vocab_size,
                       on_step=lambda kv, used=used: used.append(kv.stats()["num_used_blocks"]))
        assert sim.finish_order == real.finish_order and len(real.finish_order) == len(trace)
        assert used == [s.used_blocks for s in real.steps]
        assert [s.num_seqs for s in sim.steps] == [s.num_seqs for s in real.steps]
        for key in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_free_blocks"):
            assert sim.kv[key] == real.kv[key], (layout, key)
        assert real.kv["num_free_blocks"] == real.kv["num_blocks"]
        assert sim.summary()["max_seq_len"] == real.summary()["max_seq_len"] == 128
        if layout == "paged":
            assert sim.kv["num_preemptions"] > 0 and sim.kv["prefix_cache_hits"] > 0  # the trace exercises both
        del llm


def test_simulated_times_follow_the_step_model_and_requests_too_long_are_rejected():
    cache = CacheConfig(block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    trace = [TraceRequest(arrival=0.0, prompt_len=100, output_len=10),
             TraceRequest(arrival=5.0, prompt_len=100, output_len=10),
             TraceRequest(arrival=0.0, prompt_len=500, output_len=20)]  # 520 > max_model_len
    timing = StepTimeModel(TINY, SLOW_CPU)
    res = simulate(trace, timing, cache, sched, 64, vocab_size=512)
    first, second, too_long = res.requests
    assert too_long.status == "rejected" and first.status == second.status == "length"
    # alone in the system, the first request takes one prefill step and 9 decode steps
    assert len([s for s in res.steps if s.time <= first.finish]) == 10
    assert first.ttft == res.steps[0].seconds
    # the second arrives after the first has finished: the clock jumps to its arrival
    assert second.arrival == 5.0 and second.first_token > 5.0 and first.finish < 5.0
    assert res.kv["num_free_blocks"] == 64 and res.summary()["rejected"] == 1
    # the last arrival refused too: the replay ends instead of waiting for a next arrival
    late = simulate(trace + [TraceRequest(arrival=9.0, prompt_len=600, output_len=1)], timing, cache, sched, 64,
                    vocab_size=512)
    assert [r.status for r in late.requests] == ["length", "length", "rejected", "rejected"]


def test_paged_holds_more_concurrent_sequences_than_contiguous_at_the_same_budget():
    trace = make_trace("sharegpt", 300, seed=0)
    timing = StepTimeModel(MODELS["llama-2-13b"], SLOW_CPU)
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096)
    res = {}
    for layout in ("paged", "contiguous"):
        cache = CacheConfig(block_size=16, num_kv_blocks=2000, kv_layout=layout, enable_prefix_caching=False)
        res[layout] = simulate(trace, timing, cache, sched, 2000).summary()
    assert res["paged"]["finished"] == res["contiguous"]["finished"] == 300
    assert res["paged"]["max_batch"] >= 3 * res["contiguous"]["max_batch"]
    assert res["paged"]["mean_fragmentation"] < 0.04 < 0.35 < res["contiguous"]["mean_fragmentation"]


def test_the_simulator_imports_no_torch():
    code = ("import sys; import pagedllm.sim.simulator, pagedllm.sim.shapes, pagedllm.workloads.traces; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_calibration_fit_recovers_the_rates_that_made_the_samples():
    import random

    from pagedllm.sim.calibrate import fit
    from pagedllm.sim.shapes import get_device

    rng = random.Random(0)
    samples = []
    for _ in range(200):
        flops, bytes_, seqs = rng.uniform(1e9, 5e11), rng.uniform(2.7e8, 4e8), rng.randint(1, 64)
        samples.append((flops, bytes_, seqs, flops / 150e9 + bytes_ / 12e9 + 8e-4 * seqs))
    device = fit(samples, get_device("this-cpu"))
    assert abs(device.peak_flops / 150e9 - 1) < 1e-6 and abs(device.bandwidth / 12e9 - 1) < 1e-6
    assert abs(device.seq_overhead_s / 8e-4 - 1) < 1e-6 and not device.overlap
    # a term that only hurts the fit (negative) is dropped, not kept at a negative rate
    noisy = [(f, b, n, f / 150e9 + 8e-4 * n - b * 1e-12) for f, b, n, _ in samples]
    assert fit(noisy, get_device("this-cpu")).bandwidth == 1e30


@pytest.mark.parametrize("block_size", ["0", "7", "129"])
def test_simulate_takes_the_engines_block_size_rule(block_size, capsys):
    """A block size the engine refuses is refused by the simulator with the engine's message (it
    divided by zero at 0 before)."""
    from pagedllm.cli import main

    assert main(["simulate", "--block-size", block_size, "--num-requests", "3", "--no-progress"]) == 2
    assert "pagedllm: error: block_size: Input should be" in capsys.readouterr().err


def test_simulate_and_plan_size_the_pool_by_the_kv_format(tmp_path):
    """The same KV memory holds 1.94x the blocks in int8 and 3.76x in int4 (head size 128: 1 + 2/128
    and 0.5 + 2/128 bytes a value against 2); plan's fifth stage tries each format it is given."""
    from pagedllm.cli import main

    reports = {}
    for kv in ("auto", "int8", "int4"):
        out = tmp_path / f"{kv}.json"
        assert main(["simulate", "--model", "llama-2-7b", "--device", "a100-80gb", "--kv-memory", "8GiB",
                     "--kv-cache-dtype", kv, "--num-requests", "20", "--layout", "paged", "--no-progress",
                     "--json", str(out)]) == 0
        reports[kv] = json.loads(out.read_text())
    blocks = {kv: r["num_blocks"] for kv, r in reports.items()}
    assert blocks["int8"] == int(8 * 2**30 // (16 * 2 * 32 * 32 * 128 * (1 + 2 / 128)))
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 / (1 + 2 / 128), rel=1e-3)
    assert blocks["int4"] / blocks["auto"] == pytest.approx(2 / (0.5 + 2 / 128), rel=1e-3)
    out = tmp_path / "plan.json"
    assert main(["plan", "--workload", "alpaca", "--num-requests", "40", "--model", "llama-2-7b", "--device",
                 "a100-80gb", "--block-sizes", "16", "--memory-shares", "1%,10%", "--max-num-seqs", "64",
                 "--max-num-batched-tokens", "2048", "--kv-cache-dtypes", "auto,int8", "--no-progress",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert [r["candidate"]["kv_cache_dtype"] for r in plan["kv_cache_dtypes"]] == ["int8"]
    assert plan["options"]["kv_cache_dtype"] in ("auto", "int8")


def test_the_simulators_bytes_per_value_are_the_engines():
    import torch

    from pagedllm.config import KV_CACHE_DTYPES, ModelConfig, kv_element_bytes
    from pagedllm.kvstore.spec import kv_spec_for

    model = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    for kv in KV_CACHE_DTYPES:
        spec = kv_spec_for(model, 16, kv, torch.bfloat16)
        assert spec.bytes_per_block == kv_element_bytes(kv, "bfloat16", 64) * 2 * 3 * 2 * 64 * 16, kv
