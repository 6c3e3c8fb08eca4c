"""The cluster's pure parts, without Ray running: merging the replicas' metrics, the one-line
startup error, the replica board's expiry, the cluster flags' checks, the feed's replay order."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.cluster.app import ClusterConfig
from pagedllm.cluster.ingress import ReplicaBoard, merged_metrics
from pagedllm.cluster.launch import replica_error
from pagedllm.cluster.routing import ReplicaState, hash_set_digest
from pagedllm.kvcache.kv_events import BlockRemoved, BlockStored


def replica_text(tokens: float, usage: float) -> str:
    registry = CollectorRegistry()
    Counter("pagedllm:generation_tokens", "tokens", registry=registry).inc(tokens)
    Gauge("pagedllm:kv_cache_usage_perc", "usage", registry=registry).set(usage)
    return generate_latest(registry).decode()


def test_each_replicas_series_keeps_its_family_with_a_replica_label():
    registry = CollectorRegistry()

    class Merged:
        def collect(self):
            yield from merged_metrics({"a": replica_text(5, 0.25), "b": replica_text(7, 0.5)})

    registry.register(Merged())
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["replica"]: s.value for s in families["pagedllm:generation_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {"a": 5.0, "b": 7.0} and families["pagedllm:generation_tokens"].type == "counter"
    usage = {s.labels["replica"]: s.value for s in families["pagedllm:kv_cache_usage_perc"].samples}
    assert usage == {"a": 0.25, "b": 0.5}
    assert text.count("# TYPE pagedllm:kv_cache_usage_perc gauge") == 1  # one family, both replicas' samples


def test_a_replicas_startup_error_is_found_in_rays_message():
    wall = ("Deploying application x failed.\nThe deployment failed to start 3 times in a row. Error:\n"
            "  File \"replica.py\", line 62, in __init__\n"
            "RuntimeError: pagedllm replica could not start: ModelLoadError: model '/x.gguf' not found: give a "
            "local .gguf file\n  more traceback")
    assert replica_error(wall) == ("pagedllm replica could not start: ModelLoadError: model '/x.gguf' not found: "
                                   "give a local .gguf file")
    assert replica_error("Something else failed.\nwith details") == "Something else failed."


def test_a_silent_replica_leaves_the_board(monkeypatch):
    board, now = ReplicaBoard(ttl_s=5), [100.0]
    monkeypatch.setattr("pagedllm.cluster.ingress.time.monotonic", lambda: now[0])
    board.put("a", {"n": 1})
    now[0] += 3
    board.put("b", {"n": 2})
    assert list(board.live()) == ["a", "b"]
    now[0] += 3  # a: 6 s silent
    assert board.live() == {"b": {"n": 2}}


@pytest.mark.parametrize("kwargs, message", [
    ({"num_replicas": 0}, "--replicas"), ({"routing": "random"}, "--routing"),
    ({"load_threshold": -1}, "--routing-load-threshold"), ({"num_cpus": -1}, "--replica-cpus"),
    ({"min_match_rate": 1.5}, "--routing-min-match-rate must be between 0 and 1, got 1.5"),
    ({"num_replicas": 5, "max_replicas": 4}, "--max-replicas 4"), ({"target_ongoing_requests": 0}, "--target"),
])
def test_cluster_flags_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_autoscaling_options_are_ray_serves():
    fixed = ClusterConfig(num_replicas=3)
    assert fixed.replica_count_options() == {"num_replicas": 3} and fixed.most_replicas == 3
    scaled = ClusterConfig(num_replicas=2, min_replicas=1, max_replicas=6, target_ongoing_requests=4)
    assert scaled.replica_count_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 6, "initial_replicas": 2, "target_ongoing_requests": 4}}
    assert scaled.most_replicas == 6


def test_a_replayed_batch_is_applied_once_and_the_digest_follows_the_set():
    state = ReplicaState("r")
    hashes = [bytes([i]) * 16 for i in range(4)]
    stored = BlockStored(hashes, None, list(range(32)), 8, None, "CPU")
    state.apply([stored], seq=0)
    state.apply([BlockRemoved(hashes[3:])], seq=1)
    state.apply([stored], seq=0)  # replayed after it was published: already applied
    state.apply([BlockRemoved(hashes[3:])], seq=1)
    assert state.exact and list(state.cached) == hashes[:3]
    assert hash_set_digest(state.cached) == hash_set_digest(set(hashes[:3])) != hash_set_digest(set(hashes))
    assert hash_set_digest(set(hashes[:3])).startswith("3:")


def test_the_event_feed_sleeps_while_it_watches_no_replica():
    """Before any replica is watched the feed has nothing to poll; zmq's poll then returns at once,
    and the feed's thread spun a core, starving the ingress (its start-up took a minute)."""
    import time

    from pagedllm.cluster.event_feed import KVEventFeed

    feed = KVEventFeed()
    try:
        time.sleep(0.2)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    finally:
        feed.close()
    assert busy < 0.3, f"the idle feed kept {busy:.0%} of a core busy"


def test_cluster_health_is_503_while_no_replica_reports(tmp_path, monkeypatch):
    """The ingress runs on while every replica is dead or being replaced: its /health says so
    (it said ok with no replica at all), and ok again once one reports."""
    from starlette.testclient import TestClient

    from pagedllm.cluster.ingress import ClusterContext
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.builder import build_engine
    from pagedllm.server.app import build_app
    from pagedllm.server.metrics import ServerMetrics
    from tests.conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=2, with_tokenizer=True)
    engine = AsyncEngine(build_engine(model=folder, dtype="float32", num_kv_blocks=16, block_size=8, max_num_seqs=2))
    now = [100.0]
    monkeypatch.setattr("pagedllm.cluster.ingress.time.monotonic", lambda: now[0])
    ctx = ClusterContext(engine, "tiny", 4, ServerMetrics(), board=ReplicaBoard(ttl_s=5))
    try:
        with TestClient(build_app(ctx)) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.json() == {
                "status": "error", "error": "no engine replica has reported in the last 5 s: none is serving"}
            ctx.board.put("replica-a", {"metrics": "", "dashboard": {}})
            assert client.get("/health").json() == {"status": "ok"}
            now[0] += 6  # silent past the time to live
            assert client.get("/health").status_code == 503
    finally:
        engine.shutdown()
