"""One engine replica of a Ray Serve cluster (``pagedllm serve --replicas N``): an ``AsyncEngine``
in a Serve replica actor, with what the ingress and the router need from it.

- ``describe()``: the engine's facts the ingress validates requests with (context length,
  vocabulary, limits, the model file whose tokenizer it loads, the prefix cache's block size and
  hash) and the replica's KV-event endpoints.
- ``generate(request_id, prompt, params)``: a Serve streaming method. Its first item is
  ``{"replica": id}`` once the engine accepted the request (a rejected one raises its
  ``InvalidRequest`` instead, before anything streams); then the request's delta outputs. The
  ingress cancelling the stream (its client hung up) aborts the request, so its blocks are freed.
- ``record_routing_stats()``: Ray Serve's routing stats, read by the request router: requests
  waiting and running, KV usage, the KV-event endpoints.
- ``check_health()``: raises once the engine thread has stopped, so Ray replaces the replica.
- Every ``report_period_s`` the replica sends the ingress its Prometheus series and its dashboard
  state (``ClusterIngress.report``): ``/metrics`` and ``/dashboard`` show every replica's.

Each replica publishes its KV-cache events on ZMQ ports of its own (``tcp://*:*``, any free port,
announced in ``describe`` and the routing stats), so replicas sharing a machine never collide;
every replica of a cluster gets the same ``prefix_caching_hash_seed``, so the router hashes a
prompt as they do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from pagedllm.cluster.routing import hash_set_digest
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.parallel.launch import build_engine
from pagedllm.server.dashboard_state import dashboard_state
from pagedllm.server.metrics import ServerMetrics, engine_snapshot

log = logging.getLogger("pagedllm.cluster")

REPLICA_ERROR = "pagedllm replica could not start: "  # the launcher finds this line in Ray's error
ANY_PORT = "tcp://*:*"


def _reachable(endpoint: str, host: str) -> str:
    """A bound ``tcp://0.0.0.0:port`` as another machine reaches it (this node's address)."""
    return endpoint.replace("0.0.0.0", host, 1).replace("[::]", host, 1)


class EngineReplica:
    """The body of the engine deployment (``cluster/app.py`` wraps it with ``serve.deployment``)."""

    def __init__(self, options: dict, metrics_prefix: str, model_name: str, ingress: tuple[str, str] | None,
                 report_period_s: float = 1.0) -> None:
        """``options``: the engine's (as ``build_engine`` takes them); ``ingress``: (deployment,
        application) to report metrics and dashboard state to, or None."""
        import ray
        from ray import serve

        options = {**options, "kv_events_endpoint": ANY_PORT, "kv_events_replay_endpoint": ANY_PORT}
        try:  # the metrics are made once the model's name is known: no output comes before
            self.engine = AsyncEngine(lambda: build_engine(**options),
                                      on_output=lambda out: self.metrics.on_output(out))
        except Exception as exc:  # noqa: BLE001 - one line for the launcher, not a traceback wall
            raise RuntimeError(f"{REPLICA_ERROR}{type(exc).__name__}: {exc}") from None
        self.metrics = ServerMetrics(metrics_prefix, model_name or self.engine.engine.model_path.stem)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        host = ray.util.get_node_ip_address()
        publisher = self.engine.engine.kv_event_publisher
        self.kv_events, self.kv_replay = (_reachable(e, host) for e in publisher.bound_endpoints())
        self._ingress = None if ingress is None else serve.get_deployment_handle(*ingress)
        self._report_period_s = report_period_s
        self._reporter: asyncio.Task | None = None

    # -- what the ingress and the router read ------------------------------------------------------
    def describe(self) -> dict:
        engine = self.engine.engine
        cache = engine.config.cache
        return {"replica": self.replica_id, "pid": os.getpid(), "model_path": str(engine.model_path),
                "gguf": engine.model_path.suffix == ".gguf", "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size, "max_logprobs": engine.max_logprobs,
                "max_num_seqs": engine.max_num_seqs, "eos_token_ids": sorted(engine.eos_token_ids),
                "block_size": cache.block_size, "hash_algo": cache.prefix_caching_hash_algo,
                "kv_events": self.kv_events, "kv_replay": self.kv_replay}

    async def record_routing_stats(self) -> dict:
        self._start_reporting()
        stats = await asyncio.wrap_future(self.engine.call(self.engine.engine.stats))
        algo = self.engine.engine.config.cache.prefix_caching_hash_algo
        return {"num_waiting": stats["num_requests_waiting"], "num_running": stats["num_requests_running"],
                "kv_usage": stats["usage"], "kv_events": self.kv_events, "kv_replay": self.kv_replay,
                "block_size": stats["block_size"], "hash_algo": algo}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the engine thread stopped")

    # -- requests -----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt, params):
        self._start_reporting()
        stream = await self.engine.add_request(request_id, prompt, params)  # InvalidRequest: raised here
        try:
            yield {"replica": self.replica_id}
            async for out in stream:
                yield out
        finally:
            stream.close()  # cancelled by the ingress (its client left): the request is aborted

    def reset_prefix_cache(self) -> bool:
        return self.engine.call(self.engine.engine.reset_prefix_cache).result()

    # -- reports to the ingress ---------------------------------------------------------------------
    def _start_reporting(self) -> None:
        """Start the report loop on the replica's event loop (the constructor runs outside it)."""
        if self._ingress is not None and self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    def _read_report(self) -> dict:  # the engine thread: one step's counts, blocks and cached set
        engine = self.engine.engine
        state = dashboard_state(engine, self.metrics)
        cached = engine.kv_manager.cached_block_hashes() if engine.config.cache.kv_layout == "paged" else set()
        return {"snapshot": engine_snapshot(engine), "dashboard": state, "cached": cached}

    async def _report_loop(self) -> None:
        while True:
            try:
                read = await asyncio.wrap_future(self.engine.call(self._read_report))
                # rendered and digested here, off the engine thread (which only copied them out)
                report = {"metrics": self.metrics.render(read["snapshot"]).decode(), "dashboard": read["dashboard"],
                          "kv_events": self.kv_events, "pid": os.getpid(),
                          "cached_digest": hash_set_digest(read["cached"]), "time": time.time()}
                await self._ingress.report.remote(self.replica_id, report)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next report may get through
                log.debug("report to the ingress failed: %r", exc)
            await asyncio.sleep(self._report_period_s)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
