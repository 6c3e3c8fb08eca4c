"""/metrics: Prometheus text with the ``pagedllm:*`` names, consistent with the engine after a
known workload (token counters, finish reasons, histograms, KV pool gauges)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

COMPLETION = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_count_a_known_workload(tiny_app):
    client, ctx = tiny_app
    before = samples(client.get("/metrics").text)
    for _ in range(3):
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = samples(r.text)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pagedllm:generation_tokens_total") == 12
    assert delta("pagedllm:prompt_tokens_total") == 12
    assert delta("pagedllm:request_success_total{finished_reason=length}") == 3
    assert delta("pagedllm:e2e_request_latency_seconds_count") == 3
    assert delta("pagedllm:time_to_first_token_seconds_count") == 3
    assert delta("pagedllm:request_queue_time_seconds_count") == 3
    assert delta("pagedllm:inter_token_latency_seconds_count") == 9  # 3 gaps in each of 3 requests
    assert delta("pagedllm:prefix_cache_queries_total") == 12
    assert delta("pagedllm:prefix_cache_hits_total") == 0  # 4 tokens: no full 8-token block to hit
    assert after["pagedllm:num_requests_running"] == 0 and after["pagedllm:num_requests_waiting"] == 0
    assert after["pagedllm:num_free_blocks"] == after["pagedllm:num_blocks"] == 64
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0
    assert delta("pagedllm:engine_steps_total") >= 12
    names = {m.group(1) for m in re.finditer(r"^# TYPE (\S+)", r.text, re.M)}
    assert {"pagedllm:num_preemptions_total", "pagedllm:kv_cache_fragmentation",
            "pagedllm:swapped_out_blocks_total", "pagedllm:swapped_in_blocks_total"} <= names
    spec = ctx.engine.engine.kv_spec
    info = (f"pagedllm:cache_config_info{{block_size=8,bytes_per_block={spec.bytes_per_block},"
            f"cache_dtype={spec.kv_cache_dtype},num_gpu_blocks=64}}")
    assert after[info] == 1 and spec.kv_cache_dtype == "float32"
