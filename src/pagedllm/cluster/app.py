"""The Ray Serve application of a cluster: the engine deployment (``EngineReplica`` per replica,
routed by ``KVAwareRequestRouter``) behind the ingress deployment (``ClusterIngress``, the OpenAI
app). ``build_cluster_app`` returns it bound, for ``serve.run``.

Replicas: a fixed ``num_replicas``, or Ray Serve's autoscaling between ``min_replicas`` and
``max_replicas`` on ``target_ongoing_requests`` per replica (starting at ``num_replicas``). Each
takes ``num_cpus`` CPUs (torch runs that many threads: Ray sets ``OMP_NUM_THREADS``) and
``num_gpus`` GPUs. The ingress takes no CPU of its own reservation (it tokenizes and relays).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedllm.cluster.ingress import ClusterIngress, IngressSettings
from pagedllm.cluster.replica import EngineReplica
from pagedllm.cluster.request_router import KVAwareRequestRouter
from pagedllm.cluster.routing import DEFAULT_LOAD_THRESHOLD, DEFAULT_MIN_MATCH_RATE, ROUTING_POLICIES

APP_NAME = "pagedllm"
ENGINE_DEPLOYMENT = "PagedEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
ROUTING_STATS_PERIOD_S = 0.5


@dataclass(frozen=True)
class ClusterConfig:
    """How many replicas, what each takes, and how requests are routed to them."""

    num_replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    routing: str = "prefix-aware"
    load_threshold: int = DEFAULT_LOAD_THRESHOLD
    min_match_rate: float = DEFAULT_MIN_MATCH_RATE
    max_ongoing_requests: int = 1024
    report_period_s: float = 1.0
    extra: dict = field(default_factory=dict)  # for tests: more deployment options of the engine

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--replicas must be 1 or more, got {self.num_replicas}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.load_threshold < 0:
            raise ValueError(f"--routing-load-threshold must be 0 or more, got {self.load_threshold}")
        if not 0.0 <= self.min_match_rate <= 1.0:
            raise ValueError(f"--routing-min-match-rate must be between 0 and 1, got {self.min_match_rate}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be 0 or more")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"--target-ongoing-requests must be positive, got {self.target_ongoing_requests}")
        if self.autoscaling:
            low, high = self.min_replicas or 1, self.max_replicas or max(self.num_replicas, self.min_replicas or 1)
            if not low <= self.num_replicas <= high:
                raise ValueError(f"--replicas {self.num_replicas} must lie within --min-replicas {low} and "
                                 f"--max-replicas {high}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return (self.max_replicas or self.num_replicas) if self.autoscaling else self.num_replicas

    def replica_count_options(self) -> dict:
        if not self.autoscaling:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas or 1,
                                       "max_replicas": self.max_replicas or self.num_replicas,
                                       "initial_replicas": self.num_replicas,
                                       "target_ongoing_requests": self.target_ongoing_requests}}


def build_cluster_app(options: dict, cluster: ClusterConfig, settings: IngressSettings, hash_seed: int,
                      app_name: str = APP_NAME):
    """The bound application (to run as ``app_name``): ``options`` the engine's (each replica builds
    one engine from them, ``prefix_caching_hash_seed`` set to ``hash_seed``)."""
    options = {**options, "prefix_caching_hash_seed": hash_seed}
    actor = {"num_cpus": cluster.num_cpus, **({"num_gpus": cluster.num_gpus} if cluster.num_gpus else {})}
    router = RequestRouterConfig(
        request_router_class=f"{KVAwareRequestRouter.__module__}.{KVAwareRequestRouter.__name__}",
        request_router_kwargs={"routing": cluster.routing, "load_threshold": cluster.load_threshold,
                               "min_match_rate": cluster.min_match_rate,
                               "hash_seed": hash_seed, "topic": options.get("kv_events_topic") or ""},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT, ray_actor_options=actor, max_ongoing_requests=cluster.max_ongoing_requests,
        request_router_config=router, health_check_period_s=2.0, health_check_timeout_s=30.0,
        logging_config={"enable_access_log": False}, **cluster.replica_count_options(), **cluster.extra)
    ingress = serve.deployment(serve.ingress()(ClusterIngress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings.max_queue + 1024, logging_config={"enable_access_log": False})
    settings = replace(settings, max_replicas=cluster.most_replicas)
    engine_app = engine.bind(options, settings.metrics_prefix, settings.model_name or options.get("model") or "",
                             (INGRESS_DEPLOYMENT, app_name), cluster.report_period_s)
    return ingress.bind(engine_app, settings, app_name, ENGINE_DEPLOYMENT)
