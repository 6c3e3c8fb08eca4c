"""A short soak (issue 21) against the real ``pagedllm serve``: 32 clients of mixed valid, invalid,
cancelled, oversized and dropped requests for 20 s, every client killed every 3 s. No engine death,
no wrong answer, no unexpected status, no leaked block, and RSS growth after warm-up under 50 MB.
``pagedllm bench soak`` runs the same for 10 minutes (docs/benchmarks.md)."""

from __future__ import annotations

from pagedllm.loadgen.soak import KINDS, run_soak


def test_a_short_soak_loses_nothing(server):
    report = run_soak(server.url, server.proc.pid, duration_s=20, clients=32, kill_every_s=3, warmup_s=8)
    assert report["health_failures"] == [] and report["healthy_after"]
    assert report["wrong"] == [] and report["unexpected"] == []
    assert report["idle"] and report["leaked_blocks"] == 0
    assert report["kills"] >= 5 and all(report["requests"].get(kind, 0) > 0 for kind in KINDS), report["requests"]
    assert report["rss_growth_mb"] < 50, report
