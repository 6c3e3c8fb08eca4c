"""The cluster's ingress deployment: the same FastAPI OpenAI app as ``pagedllm serve``
(``server/app.py``: every route, streaming, structured output, errors, the API key and limits),
its engine the engine deployment's replicas (``ClusterEngine``).

What differs from one server:
- ``/metrics``: every replica's series, each with a ``replica`` label (the replicas report them
  every second, ``report``), then the router's: requests routed to each replica, decisions by
  reason, each replica's load and the size of the router's view of its cache.
- ``/dashboard/state``: ``{"replicas": [{"replica": id, ...its state...}], "routing": ...}``, as each
  replica last reported it; the page draws one pool per replica.
- ``GET /cluster``: the router's view (per replica: cached blocks it knows of, exact or
  approximate, load, requests routed) and its recent decisions with their reasons and loads.
- ``/health``: 503 also while no replica has reported for ``REPORT_TTL_S``.
A replica silent for ``REPORT_TTL_S`` (dead, or scaled away) leaves the reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pagedllm.cluster.remote_engine import ClusterEngine, EngineFacts
from pagedllm.cluster.router_registry import live_router
from pagedllm.server.app import build_app
from pagedllm.server.limits import ServerLimits
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.serving import ServerContext

REPORT_TTL_S = 5.0


class ReplicaBoard:
    """The latest report of each replica (its metrics text and dashboard state)."""

    def __init__(self, ttl_s: float = REPORT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._reports: dict[str, tuple[float, dict]] = {}

    def put(self, replica: str, report: dict) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def live(self) -> dict[str, dict]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._reports.items() if now - t > self.ttl_s]:
            del self._reports[replica]
        return {r: report for r, (_, report) in sorted(self._reports.items())}


def merged_metrics(texts: dict[str, str]) -> list[Metric]:
    """Each replica's Prometheus text as one family per metric, every sample with a ``replica`` label."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    return list(families.values())


class _Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        yield from self.families


def router_metrics(view: dict, prefix: str) -> list[Metric]:
    routed = CounterMetricFamily(prefix + "router_requests", "requests the router sent to each replica",
                                 labels=["replica"])
    reasons = CounterMetricFamily(prefix + "router_decisions", "routing decisions by reason (prefix: longest "
                                  "cached prefix; overloaded: power of two; short_prefix / no_prefix: least "
                                  "loaded; full: Ray moved it on)",
                                  labels=["reason"])
    load = GaugeMetricFamily(prefix + "router_replica_load", "requests on each replica as the router counts them",
                             labels=["replica"])
    cached = GaugeMetricFamily(prefix + "router_cached_blocks", "blocks the router knows each replica caches "
                               "(from its KV events)", labels=["replica"])
    for r in view["replicas"]:
        routed.add_metric([r["replica"]], r["routed"])
        load.add_metric([r["replica"]], r["load"])
        cached.add_metric([r["replica"]], r["cached_blocks"])
    for reason, n in sorted(view["reasons"].items()):
        reasons.add_metric([reason], n)
    return [routed, reasons, load, cached]


@dataclass
class ClusterContext(ServerContext):
    """``ServerContext`` whose metrics and dashboard come from the replicas' reports."""

    board: ReplicaBoard = field(default_factory=ReplicaBoard)
    router_key: tuple[str, str] = ("", "")  # (application, engine deployment): its router in this process
    metrics_prefix: str = "pagedllm"

    def health_problem(self) -> str | None:
        """The ingress's own engine face, then the replicas: 503 while none has reported within
        the board's time to live (all dead or being replaced; Ray Serve keeps at least one)."""
        problem = super().health_problem()
        if problem is None and not self.board.live():
            problem = f"no engine replica has reported in the last {self.board.ttl_s:g} s: none is serving"
        return problem

    def router_view(self) -> dict:
        router = live_router(*self.router_key)
        return router.view() if router is not None else {"routing": None, "replicas": [], "reasons": {},
                                                         "decisions": []}

    async def render_metrics(self) -> bytes:
        reports = self.board.live()
        families = merged_metrics({r: report["metrics"] for r, report in reports.items()})
        families += router_metrics(self.router_view(), self.metrics_prefix + ":")
        registry = CollectorRegistry()
        registry.register(_Families(families))
        return generate_latest(registry)

    async def dashboard_state(self) -> dict:
        reports = self.board.live()
        return {"replicas": [{"replica": r, **report["dashboard"]} for r, report in reports.items()],
                "routing": self.router_view()["routing"]}


@dataclass(frozen=True)
class IngressSettings:
    """What ``pagedllm serve`` gives the ingress (its server flags)."""

    model_name: str | None = None
    max_queue: int = 1024
    max_replicas: int = 1
    api_keys: tuple[str, ...] = ()
    guard_metrics: bool = False
    salt_per_key: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    tool_call_parser: str = "hermes"
    metrics_prefix: str = "pagedllm"
    max_body_bytes: int | None = None
    chat_template: str | None = None


class ClusterIngress:
    """The ingress deployment's body (``cluster/app.py`` wraps it with ``serve.ingress``)."""

    async def __init__(self, engine_handle, settings: IngressSettings, app_name: str, engine_deployment: str) -> None:
        described = await engine_handle.describe.remote()
        facts = EngineFacts(described, settings.max_replicas, settings.chat_template)
        model_name = settings.model_name or facts.model_path.stem
        self.ctx = ClusterContext(ClusterEngine(engine_handle, facts), model_name, settings.max_queue,
                                  ServerMetrics(settings.metrics_prefix, model_name), api_keys=settings.api_keys,
                                  guard_metrics=settings.guard_metrics, salt_per_key=settings.salt_per_key,
                                  limits=settings.limits, tool_call_parser=settings.tool_call_parser,
                                  router_key=(app_name, engine_deployment), metrics_prefix=settings.metrics_prefix)
        self.settings = settings
        self.described = described

    def __serve_build_asgi_app__(self) -> FastAPI:
        kwargs = {"max_body_bytes": self.settings.max_body_bytes} if self.settings.max_body_bytes else {}
        app = build_app(self.ctx, **kwargs)
        ctx = self.ctx

        @app.get("/cluster")
        async def cluster():
            """The router's view of each replica and its recent decisions; which replica served each
            recent request (``served``: engine request id -> replica); what each replica last
            reported (``reported``: its process, the digest of its cached block set, its KV-event
            endpoint)."""
            view = ctx.router_view()
            view["served"] = dict(ctx.engine.served)
            view["reported"] = {r: {k: report[k] for k in ("pid", "cached_digest", "kv_events", "time")}
                                for r, report in ctx.board.live().items()}
            return JSONResponse(view)

        return app

    def report(self, replica: str, report: dict) -> None:
        """A replica's periodic report (``cluster/replica.py``)."""
        self.ctx.board.put(replica, report)

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.engine.shutdown()
