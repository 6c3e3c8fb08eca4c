"""The serving benchmark's arithmetic (TTFT, TPOT, ITL, percentiles, throughput), the synthetic text
workload and the CPU-time readers, on hand-made inputs."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pagedllm import cpu_features
from pagedllm.build_record import emulated_family
from pagedllm.loadgen.serve_metrics import RequestRecord, distribution_ms, percentile, summarize
from pagedllm.machine import KERNEL_FLAGS, CpuClock, machine_info, process_cpu_seconds
from pagedllm.workloads.text import WORDS, text_workload


def record(index: int, start: float, chunks: list[float], end: float, tokens: int | None = None) -> RequestRecord:
    return RequestRecord(index, 4, len(chunks), start_s=start, chunk_s=chunks, end_s=end, prompt_tokens=4,
                         output_tokens=len(chunks) if tokens is None else tokens)


def test_per_request_latencies_follow_vllm_definitions():
    r = record(0, 1.0, [1.5, 1.6, 1.8, 2.1], 2.2)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.2)
    assert r.tpot_s == pytest.approx((1.2 - 0.5) / 3)  # (E2E - TTFT) / (output tokens - 1)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert record(1, 0.0, [0.3], 0.4).tpot_s is None  # one token: no TPOT


def test_summary_pools_itl_counts_failures_and_uses_usage_tokens():
    ok = [record(0, 0.0, [0.5, 0.6, 0.8], 0.9), record(1, 0.2, [0.4, 0.9], 1.0, tokens=5)]
    failed = RequestRecord(2, 4, 3, start_s=0.1, error="HTTP 500: boom")
    s = summarize([*ok, failed], duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 500: boom": 1})
    assert s["total_output_tokens"] == 3 + 5 and s["streamed_chunks"] == 5 and s["usage_chunk_mismatches"] == 1
    assert s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0 and s["total_token_throughput"] == 8.0
    assert s["itl_ms"]["count"] == 3 and s["itl_ms"]["mean"] == pytest.approx((100 + 200 + 500) / 3, abs=1e-3)
    assert s["ttft_ms"]["p50"] == pytest.approx(350.0, abs=1e-3)
    assert s["tpot_ms"]["mean"] == pytest.approx((400 / 2 + 600 / 4) / 2, abs=1e-3)


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    d = distribution_ms([0.001, 0.002, 0.010])
    assert d["p50"] == 2.0 and d["max"] == 10.0 and d["mean"] == pytest.approx(13 / 3, abs=1e-3)
    assert distribution_ms([])["mean"] is None


def test_text_workload_is_seeded_and_sized():
    a = text_workload(5, (3, 9), (2, 4), seed=7)
    assert a == text_workload(5, (3, 9), (2, 4), seed=7) and a != text_workload(5, (3, 9), (2, 4), seed=8)
    for r in a:
        words = r.prompt.split(" ")
        assert len(words) == r.num_words and 3 <= r.num_words <= 9 and 2 <= r.output_len <= 4
        assert set(words) <= set(WORDS)


def test_cpu_time_readers():
    info = machine_info()
    assert info["cores"] == os.cpu_count() and info["cpu"]
    assert all(f.startswith(KERNEL_FLAGS) for f in info["flags"])
    assert info["family"] == cpu_features.detect().describe()
    if cpu_features.detect().avx2 and emulated_family() is None:
        assert {"avx2", "fma"} <= set(info["flags"])
    before = process_cpu_seconds(os.getpid())
    with CpuClock() as clock:
        t = time.process_time()
        while time.process_time() - t < 0.2:  # burn CPU time, not wall time
            pass
    assert clock.result.process_s >= 0.2 and clock.result.user_s + clock.result.system_s >= 0.15
    assert process_cpu_seconds(os.getpid()) - before >= 0.15  # /proc counts in clock ticks
    assert clock.result.as_dict()["cores_busy"] > 0
    steal = clock.result.as_dict()["machine_steal_s"]
    assert steal is None or steal >= 0
