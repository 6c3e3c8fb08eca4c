"""Prometheus metrics (``prometheus_client``), named ``pagedllm:*`` after vLLM's ``vllm:*`` ones.

``--metrics-prefix vllm`` names them ``vllm:*`` instead, each with vLLM's ``model_name`` label (the
served name), so dashboards and alerts built for vLLM work unchanged: the names that vLLM has
(``num_requests_running``/``waiting``, ``kv_cache_usage_perc``, ``prefix_cache_queries``/``hits``,
``num_preemptions``, ``prompt_tokens``, ``generation_tokens``, ``request_success{finished_reason}``,
``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
``request_queue_time_seconds``) are the same metric, the others ours (docs/api.md).

Two sources. The engine's own state (queues, KV pool usage, fragmentation, cumulative prefix-cache
and preemption counters) is read at scrape time, between two engine steps (``engine_snapshot``
runs on the engine thread), so it is always consistent with one step. Request lifecycle metrics
(token counters, finished requests by reason, TTFT / inter-token / end-to-end / queue-time
histograms) are recorded by ``ServerMetrics.on_output`` as the engine thread hands out outputs.
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.engine.engine import Engine
from pagedllm.engine.outputs import RequestOutput

PREFIX = "pagedllm:"
METRIC_PREFIXES = ("pagedllm", "vllm")  # --metrics-prefix: ours (no labels) or vLLM's (with model_name)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


def engine_snapshot(engine: Engine) -> dict:
    """The engine's queues and KV pool (run on the engine thread), and the pool's format."""
    spec = engine.kv_spec
    snapshot = engine.stats() | {"kv_cache_dtype": spec.kv_cache_dtype, "kv_bytes_per_block": spec.bytes_per_block}
    if engine.scheduler.drafter is not None:
        snapshot["spec_decode_accepted_per_position"] = list(engine.scheduler.drafter.stats.accepted_per_position)
    return snapshot


class _EngineCollector:
    """Gauges and cumulative counters from the latest engine snapshot."""

    def __init__(self, prefix: str = PREFIX, labels: dict[str, str] | None = None) -> None:
        self.snapshot: dict = {}
        self.prefix, self.labels = prefix, dict(labels or {})

    def _family(self, kind, name: str, doc: str, value: float):
        if not self.labels:
            return kind(self.prefix + name, doc, value=value)
        family = kind(self.prefix + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s = self.snapshot
        if not s:
            return
        gauges = {
            "num_requests_running": ("requests running in the engine", s["num_requests_running"]),
            "num_requests_waiting": ("requests waiting (queued, preempted or swapped out)", s["num_requests_waiting"]),
            "kv_cache_usage_perc": ("fraction of KV blocks in use (1 = full)", s["usage"]),
            "num_free_blocks": ("KV blocks free (cached content included)", s["num_free_blocks"]),
            "num_blocks": ("KV blocks in the pool", s["num_blocks"]),
            "num_cached_blocks": ("KV blocks holding a prefix-cache entry", s["num_cached_blocks"]),
            "kv_cache_fragmentation": ("reserved but unfilled KV slots / reserved slots", s["fragmentation"]),
        }
        for name, (doc, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, value)
        # the pool's format as labels of a constant 1, as vLLM's cache_config_info (its label names)
        info = {"block_size": str(s["block_size"]), "cache_dtype": s["kv_cache_dtype"],
                "num_gpu_blocks": str(s["num_blocks"]), "bytes_per_block": str(s["kv_bytes_per_block"])}
        family = GaugeMetricFamily(self.prefix + "cache_config_info", "the KV pool's format and size (value 1)",
                                   labels=[*self.labels, *info])
        family.add_metric([*self.labels.values(), *info.values()], 1)
        yield family
        counters = {
            "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", s["prefix_cache_queries"]),
            "prefix_cache_hits": ("prompt tokens found in the prefix cache", s["prefix_cache_hits"]),
            "num_preemptions": ("requests preempted", s["num_preemptions"]),
            "swapped_out_blocks": ("KV blocks swapped out to the host tier", s["num_swapped_out_blocks"]),
            "swapped_in_blocks": ("KV blocks swapped back in", s["num_swapped_in_blocks"]),
            "engine_steps": ("engine steps run (a step: one forward pass over the batch)", s["num_steps"]),
        }
        for name, (doc, value) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, value)
        if "spec_decode_num_drafts" in s:
            yield from self._spec_decode(s)

    def _spec_decode(self, s: dict):
        """Speculative decoding (an engine with speculative_config): vLLM's spec_decode counters, and
        the acceptance rate and mean accepted length since start as gauges."""
        counters = {
            "spec_decode_num_drafts": "verification chunks that carried guessed tokens",
            "spec_decode_num_draft_tokens": "guessed tokens verified",
            "spec_decode_num_accepted_tokens": "guessed tokens accepted (equal to the model's own)",
        }
        for name, doc in counters.items():
            yield self._family(CounterMetricFamily, name, doc, s[name])
        gauges = {
            "spec_decode_acceptance_rate": "accepted / guessed tokens since start",
            "spec_decode_mean_accepted_length": "tokens per verification since start (accepted guesses + 1)",
        }
        for name, doc in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, s[name])
        family = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                     "guessed tokens accepted, by position in the guess (0: the first)",
                                     labels=[*self.labels, "position"])
        for pos, count in enumerate(s.get("spec_decode_accepted_per_position", ())):
            family.add_metric([*self.labels.values(), str(pos)], count)
        yield family


class ServerMetrics:
    """The server's registry: engine state at scrape time plus request lifecycle metrics."""

    def __init__(self, prefix: str = "pagedllm", model_name: str | None = None) -> None:
        """``prefix``: one of ``METRIC_PREFIXES``; with ``vllm``, every metric carries ``model_name``."""
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRIC_PREFIXES}, got {prefix!r}")
        if prefix == "vllm" and not model_name:
            raise ValueError("vLLM's metric names need the served model_name for their label")
        labels = {"model_name": model_name} if prefix == "vllm" else {}
        p = prefix + ":"
        self.registry = CollectorRegistry()
        self.engine_state = _EngineCollector(p, labels)
        self.registry.register(self.engine_state)
        r, names = self.registry, list(labels)

        def one(metric):  # the child of the constant labels (the metric itself without any)
            return metric.labels(**labels) if labels else metric

        self.prompt_tokens = one(Counter(p + "prompt_tokens", "prompt tokens of finished requests", names, registry=r))
        self.generation_tokens = one(Counter(p + "generation_tokens", "tokens generated", names, registry=r))
        success = Counter(p + "request_success", "finished requests by finish reason", [*names, "finished_reason"],
                          registry=r)
        self._success = lambda reason: success.labels(**labels, finished_reason=reason)
        self.ttft = one(Histogram(p + "time_to_first_token_seconds", "arrival to first token", names,
                                  buckets=LATENCY_BUCKETS, registry=r))
        self.itl = one(Histogram(p + "inter_token_latency_seconds", "time between a request's tokens", names,
                                 buckets=LATENCY_BUCKETS, registry=r))
        self.e2e = one(Histogram(p + "e2e_request_latency_seconds", "arrival to finish", names,
                                 buckets=LATENCY_BUCKETS, registry=r))
        self.queue_time = one(Histogram(p + "request_queue_time_seconds", "arrival to first scheduled", names,
                                        buckets=LATENCY_BUCKETS, registry=r))
        self._last_token_time: dict[str, float] = {}

    def on_output(self, out: RequestOutput) -> None:
        """Record one delta output (called on the engine thread)."""
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(new_tokens)
        m = out.metrics
        last = self._last_token_time.get(out.request_id)
        if new_tokens:
            if last is None and m is not None and m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            elif last is not None:
                self.itl.observe((now - last) / max(1, new_tokens // max(1, len(out.outputs))))
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
            self._success((reasons.pop() if len(reasons) == 1 else "mixed") if reasons else "abort").inc()
            if m is not None:
                self.e2e.observe(now - m.arrival_time)

    def render(self, snapshot: dict) -> bytes:
        self.engine_state.snapshot = snapshot
        return generate_latest(self.registry)
