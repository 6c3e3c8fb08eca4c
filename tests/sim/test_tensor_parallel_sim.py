"""The simulator under tensor parallelism: one rank's share of the model, the all-reduce cost per
step, the KV pool per rank, and ``plan`` choosing a size."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main
from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedllm.sim.shapes import LINKS, get_device, get_model
from pagedllm.sim.simulator import StepTimeModel


def test_a_rank_holds_its_share_of_heads_channels_weights_and_kv():
    full = get_model("llama-2-70b")
    rank = full.shard(8)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (8, 1, 3584)
    assert rank.kv_bytes_per_token(2) * 8 == full.kv_bytes_per_token(2)
    embeddings = 2 * full.vocab_size * full.hidden_size  # untied: embedding and head, replicated
    assert rank.num_params - embeddings == pytest.approx((full.num_params - embeddings) / 8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide Llama-2-70B's query heads \(64\)"):
        full.shard(3)


def test_each_step_pays_two_ring_all_reduces_per_layer():
    shard, link = get_model("llama-2-70b").shard(4), LINKS["nvlink-h100"]
    timing = StepTimeModel(shard, get_device("h100"), 2.0, 2.0, 4, link)
    tokens = 64
    each = link.latency_s + 2 * 3 / 4 * tokens * 8192 * 2 / link.bandwidth
    assert timing.allreduce_seconds(tokens) == pytest.approx(2 * 80 * each)
    out = SchedulerOutput(chunks=[ScheduledChunk(str(i), [7], 1000, [], sample=True) for i in range(tokens)])
    alone = StepTimeModel(shard, get_device("h100"), 2.0, 2.0)
    assert timing.step_seconds(out) == pytest.approx(alone.step_seconds(out) + timing.allreduce_seconds(tokens))
    assert alone.allreduce_seconds(tokens) == 0.0
    with pytest.raises(ValueError, match="needs a link"):
        StepTimeModel(shard, get_device("h100"), 2.0, 2.0, 4)


def test_simulate_reports_the_per_rank_memory_and_the_all_reduce_cost(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--workload", "alpaca", "--num-requests", "40", "--rate", "20", "--model", "llama-2-70b",
                 "--device", "a100-80gb", "--tensor-parallel-size", "4", "--layout", "paged", "--no-progress",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    tp = report["tensor_parallel"]
    full = get_model("llama-2-70b")
    assert tp["size"] == 4 and "NVLink 3" in tp["link"]
    assert tp["weights_per_rank_bytes"] == full.shard(4).weight_bytes(2)
    assert tp["kv_pool_per_rank_bytes"] == int(0.9 * 80 * 10**9) - tp["weights_per_rank_bytes"]
    assert report["num_blocks"] == int(tp["kv_pool_per_rank_bytes"] // (16 * full.kv_bytes_per_token(2) / 4))
    decode = tp["steps"]["decode, 64 sequences at 1,024"]
    assert 0 < decode["allreduce_ms"] < decode["step_ms"]
    assert report["results"]["paged"]["finished"] == 40


def test_plan_skips_sizes_that_do_not_fit_and_picks_the_most_tokens_per_device(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--workload", "alpaca", "--num-requests", "60", "--rate", "20", "--model", "llama-2-70b",
                 "--device", "a100-80gb", "--tensor-parallel-sizes", "1,2,3,4,8", "--block-sizes", "16",
                 "--memory-shares", "90%", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
                 "--dtypes", "bfloat16", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["tensor_parallel_size"]: r for r in report["tensor_parallel"]}
    assert "does not fit" in rows[1]["skipped"] and "must divide" in rows[3]["skipped"]
    fitting = [r for r in rows.values() if "skipped" not in r]
    chosen = next(r for r in fitting if r["chosen"])
    best = max(r["per_device"] for r in fitting)
    assert chosen["per_device"] >= 0.98 * best
    near_best = [r["tensor_parallel_size"] for r in fitting if r["per_device"] >= 0.98 * best]
    assert chosen["tensor_parallel_size"] == min(near_best)
    assert report["options"]["tensor_parallel_size"] == chosen["tensor_parallel_size"]
