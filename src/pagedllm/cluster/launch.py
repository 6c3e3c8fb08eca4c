"""``pagedllm serve --replicas N``: the OpenAI server as a Ray Serve application of N engine
replicas behind one endpoint (``cluster/app.py``), on a local Ray cluster started for it, or on an
existing one (``--ray-address auto`` or ``HOST:6379``, a cluster started with ``ray start``: every
machine that joined it can run replicas).

``serve`` without ``--replicas`` is the single-process server (``server/serve.py``), unchanged.

Startup: the engine options are checked before Ray starts (a bad option is one line); a replica
that cannot start (a bad model path) ends the command with that replica's error in one line,
found in Ray's deployment error. SIGINT / SIGTERM: the application is deleted (its replicas
abort what they run), then, if this command started the Ray cluster, ``ray.shutdown()`` stops
every Ray process it started; on an existing cluster only the application goes.
"""

from __future__ import annotations

import argparse
import logging
import re
import secrets
import signal
import time

from pydantic import ValidationError

from pagedllm.cluster.app import APP_NAME, ClusterConfig, build_cluster_app
from pagedllm.cluster.ingress import IngressSettings
from pagedllm.cluster.replica import REPLICA_ERROR
from pagedllm.cluster.routing import DEFAULT_LOAD_THRESHOLD, DEFAULT_MIN_MATCH_RATE, ROUTING_POLICIES
from pagedllm.config import EngineOptions, describe_error
from pagedllm.errors import ConfigError
from pagedllm.server import serve as single
from pagedllm.server.limits import ServerLimits

log = logging.getLogger("pagedllm.cluster")


class ClusterStartError(Exception):
    """The application could not start; the message is one line."""


def replica_error(message: str) -> str:
    """The line a replica raised (``REPLICA_ERROR``) out of Ray's deployment error, else its first line."""
    found = re.search(re.escape(REPLICA_ERROR) + r"[^\n]*", message)
    if found:
        return found.group(0).rstrip(".'\"")
    return message.strip().splitlines()[0] if message.strip() else "the application failed to start"


def deployment_messages(app_name: str) -> list[str]:
    """What Ray Serve says of each deployment of the application (a failed replica's traceback)."""
    from ray import serve

    try:
        status = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - only to improve an error message
        return []
    return [] if status is None else [d.message for d in status.deployments.values() if d.message]


def start(options: dict, cluster: ClusterConfig, settings: IngressSettings, host: str, port: int,
          ray_address: str | None = None, app_name: str = APP_NAME, route_prefix: str = "/") -> bool:
    """Start Ray (or join ``ray_address``) and the application; True if this call started Ray.
    Raises ``ClusterStartError`` (one line) if a replica cannot start."""
    import ray
    from ray import serve

    started = not ray.is_initialized() and ray_address is None
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    seed = options.get("prefix_caching_hash_seed")
    seed = secrets.randbits(64) if seed is None else seed  # one secret for the cluster, never sent to clients
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_cluster_app(options, cluster, settings, seed, app_name), name=app_name,
                  route_prefix=route_prefix)
    except Exception as exc:  # noqa: BLE001 - Ray's error is a wall of tracebacks: one line of it
        message = "\n".join([str(exc), *deployment_messages(app_name)])
        stop(started, app_name)
        raise ClusterStartError(replica_error(message)) from None
    return started


def stop(started_ray: bool, app_name: str = APP_NAME) -> None:
    """Delete the application; stop Ray too if ``start`` started it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if started_ray:
            serve.shutdown()
        else:
            serve.delete(app_name)
    finally:
        if started_ray:
            ray.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cluster_config(args) -> ClusterConfig:
    try:
        return ClusterConfig(num_replicas=args.replicas, min_replicas=args.min_replicas,
                             max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                             num_cpus=args.replica_cpus, num_gpus=args.replica_gpus, routing=args.routing,
                             load_threshold=args.routing_load_threshold,
                             min_match_rate=args.routing_min_match_rate)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def serve_cluster(args, options: dict, limits: ServerLimits) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = cluster_config(args)
    if options.get("kv_events_endpoint") or options.get("kv_events_replay_endpoint"):
        raise ConfigError("--kv-events-endpoint: with --replicas each replica publishes its KV events on ports of "
                          "its own (GET /cluster lists them)")
    try:
        EngineOptions(**options)  # a bad option is one line here, before Ray starts
    except ValidationError as e:
        raise ConfigError(describe_error(e)) from None
    api_keys = tuple(args.api_key or ()) or single.keys_from_env()
    if args.cache_salt_per_key and not api_keys:
        raise SystemExit("--cache-salt-per-key needs --api-key (one per tenant)")
    settings = IngressSettings(model_name=args.served_model_name or options.get("model"), max_queue=args.max_queue,
                               api_keys=api_keys, guard_metrics=args.guard_metrics,
                               salt_per_key=args.cache_salt_per_key, limits=limits,
                               tool_call_parser=args.tool_call_parser, metrics_prefix=args.metrics_prefix,
                               max_body_bytes=args.max_body_bytes, chat_template=args.chat_template)
    signal.signal(signal.SIGTERM, _interrupt)  # while starting, SIGTERM as Ctrl-C: undo what started
    try:
        started = start(options, cluster, settings, args.host, args.port, args.ray_address)
    except ClusterStartError as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: undo what started
        stop(args.ray_address is None)
        return 130
    stopping: list[int] = []  # the signal handler only appends: no lock a handler could deadlock on
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        count = (f"{cluster.min_replicas or 1}-{cluster.most_replicas}" if cluster.autoscaling
                 else cluster.num_replicas)
        log.info("pagedllm cluster serving at http://%s:%d/v1 | %s replicas (%s routing), %g CPUs each%s | "
                 "GET /cluster for the router's view", args.host, args.port, count, cluster.routing, cluster.num_cpus,
                 f", {cluster.num_gpus:g} GPUs each" if cluster.num_gpus else "")
        while not stopping:
            time.sleep(0.2)
        log.info("stopping the cluster")
    finally:
        stop(started)
    return 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s flags: the server's, then the cluster's (used with ``--replicas``)."""
    single.add_cli_args(p)
    g = p.add_argument_group("cluster (Ray Serve): with --replicas, docs/cluster.md")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve with N engine replicas behind one endpoint on Ray Serve (default: one process, "
                        "no Ray); with --min/--max-replicas, the number to start with")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (started with `ray start --head`; 'auto' or HOST:6379) instead of "
                        "starting a local one")
    g.add_argument("--routing", default="prefix-aware", choices=list(ROUTING_POLICIES),
                   help="how requests are sent to replicas: to the one caching the longest prefix of the prompt "
                        "(its KV events tell the router), or power of two choices, or in turn")
    g.add_argument("--routing-load-threshold", type=int, default=DEFAULT_LOAD_THRESHOLD,
                   help="prefix-aware: requests a prefix holder may have beyond the least loaded replica before "
                        "the request goes by power of two instead")
    g.add_argument("--routing-min-match-rate", type=float, default=DEFAULT_MIN_MATCH_RATE,
                   help="prefix-aware: the share of a prompt's full blocks a replica must cache for the request "
                        "to follow them; a shorter prefix (a shared system prompt) goes to the least loaded")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (torch threads)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscale: requests per replica Ray Serve aims for")


def main(args) -> int:
    if args.replicas is None:
        for flag in ("ray_address", "min_replicas", "max_replicas"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --replicas")
        return single.main(args)
    options, limits = single.options_from_args(args), single.limits_from_args(args)
    if args.root_path:
        raise ConfigError("--root-path: not supported with --replicas (Ray Serve's route prefix is /)")
    return serve_cluster(args, options, limits)
