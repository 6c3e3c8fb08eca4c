"""``pagedllm bench compare`` and the engine replay under it: the same trace through the contiguous
baseline and the paged layout (prefix caching off and on) at one KV budget, measured."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM
from pagedllm.cli import main
from pagedllm.sim.engine_replay import replay
from pagedllm.sim.mission import CLAIMS, cost_per_m_tokens, format_table
from pagedllm.workloads.traces import TraceRequest, write_trace
from tests.conftest import make_tiny_checkpoint

# the tiny checkpoint: 2 layers x 2 KV heads x head dim 16, float32: 512 bytes of K and V per token
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _trace() -> list[TraceRequest]:
    reqs = [TraceRequest(arrival=0.0, prompt_len=40 + 3 * i, output_len=6 + i % 5, prefix_id="sys", prefix_len=32)
            for i in range(12)]
    return reqs + [TraceRequest(arrival=0.0, prompt_len=300, output_len=4)]  # longer than max_model_len 256


def test_compare_reports_paged_against_contiguous_at_one_budget(tmp_path, capsys):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    write_trace(tmp_path / "t.jsonl", _trace())
    budget = 2 * 256 * BYTES_PER_TOKEN  # two contiguous reservations of max_model_len
    rc = main(["bench", "compare", "--model", folder, "--dtype", "float32", "--trace", str(tmp_path / "t.jsonl"),
               "--kv-cache-memory", str(budget), "--max-model-len", "256", "--time-scale", "0", "--no-progress",
               "--price-per-hour", "3.6", "--plot", str(tmp_path / "plots"), "--json", str(tmp_path / "r.json")])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    res = report["results"]
    assert list(res) == ["contiguous", "paged", "paged + prefix caching"]
    for name, r in res.items():
        assert (r["finished"], r["rejected"]) == (12, 1), name
        assert r["num_blocks"] == budget // (16 * BYTES_PER_TOKEN) and r["max_seq_len"] == 256
        assert r["errors"] and "256" in r["errors"][0]  # the rejected request's message names the limit
        assert r["cost_per_m_tokens"] == pytest.approx(3.6 / 3600 / r["output_tokens_per_s"] * 1e6)
    contiguous, paged, cached = res["contiguous"], res["paged"], res["paged + prefix caching"]
    assert contiguous["max_batch"] == 2  # the pool holds two max_model_len reservations
    assert paged["max_batch"] >= 3 * contiguous["max_batch"]
    assert paged["mean_fragmentation"] < 0.2 < 0.6 < contiguous["mean_fragmentation"]
    assert contiguous["prefix_cache_hit_rate"] == paged["prefix_cache_hit_rate"] == 0 < cached["prefix_cache_hit_rate"]
    assert contiguous["peak_kv_bytes"] == budget  # both slots reserved in full
    out = capsys.readouterr().out
    assert "claimed paged" in out and "394" in out and "fragmentation mean / max" in out
    assert (tmp_path / "plots" / "compare_timeline.png").stat().st_size > 0


def test_replay_admits_each_request_at_its_arrival_and_frees_every_block(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=32, max_model_len=256)
    trace = [TraceRequest(arrival=0.0, prompt_len=20, output_len=3),
             TraceRequest(arrival=0.25, prompt_len=20, output_len=3)]
    res = replay(llm.engine, trace, time_scale=2.0)  # the second arrives at 0.5 s
    first, second = res.requests
    assert second.arrival == 0.5 and second.first_token >= 0.5 and first.finish < 0.5
    assert res.summary()["finished"] == 2 and 0 <= second.ttft < 0.5
    assert res.kv["num_free_blocks"] == res.kv["num_blocks"]
    with pytest.raises(ValueError, match="time_scale"):
        replay(llm.engine, trace, time_scale=-1.0)


def test_mission_table_puts_the_claims_beside_the_runs():
    run = {"max_seq_len": 8192, "mean_fragmentation": 0.01, "max_fragmentation": 0.02, "output_tokens_per_s": 50.0,
           "peak_kv_bytes": 200e6, "ttft_p50_s": 0.25, "ttft_p99_s": 1.5, "finished": 3, "rejected": 0}
    table = format_table({"paged": run}, claims=True, markdown=True).splitlines()
    assert table[0] == "| | paged | claimed contiguous | claimed paged |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[2:]}
    assert rows["fragmentation mean / max"].endswith("| 1.0% / 2.0% | 37.0% / - | 4.2% / - |")
    assert rows["TTFT p50 / p99 (ms)"].endswith("| 250 / 1500 | 580 / - | 340 / - |")
    assert rows["peak KV memory"].endswith("| 200 MB | 48.0 GB | 18.0 GB |")
    # the mission's cost claims agree with its throughput claims at $0.93/h, per thousand tokens
    for side in (0, 1):
        assert cost_per_m_tokens(0.93, CLAIMS["output_tokens_per_s"][side]) == pytest.approx(
            CLAIMS["cost_per_m_tokens"][side], rel=0.07)
    assert cost_per_m_tokens(0.0, 10.0) is None


def test_compare_runs_each_kv_format_at_the_same_budget(tmp_path):
    """int8 KV: 512 / 144 bytes per token of float32's, so 3.5x the blocks, and more sequences at once
    when the pool is what limits them."""
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    reqs = [TraceRequest(arrival=0.0, prompt_len=60, output_len=20) for _ in range(16)]
    write_trace(tmp_path / "t.jsonl", reqs)
    budget = 2 * 16 * 16 * BYTES_PER_TOKEN  # 32 float32 blocks of 16: two sequences' worth
    rc = main(["bench", "compare", "--model", folder, "--dtype", "float32", "--trace", str(tmp_path / "t.jsonl"),
               "--kv-cache-memory", str(budget), "--max-model-len", "256", "--time-scale", "0", "--no-progress",
               "--configs", "paged", "--kv-cache-dtype", "float32,int8", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    f32, int8 = res["paged, float32 KV"], res["paged, int8 KV"]
    assert (f32["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("float32", "int8")
    assert f32["num_blocks"] == 32 and int8["num_blocks"] == budget // (16 * 2 * 2 * 2 * (16 + 2)) == 113
    assert int8["blocks_per_gib"] == round(2**30 / (16 * 144))
    assert int8["finished"] == f32["finished"] == 16
    assert int8["mean_batch"] > 2 * f32["mean_batch"]
