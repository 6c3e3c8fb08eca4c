"""``KVAwareRequestRouter``'s bookkeeping, driven through Ray Serve's hooks in the orders Ray calls
them, without Ray running: each routed request's decision is logged once, and its replica's
in-flight count returns to zero when it completes, whichever of Ray's two callbacks comes first.

Ray 2.60's router registers a request's completion callback before it awaits the replica's
accept/reject answer and calls ``on_request_routed`` after it; both run on the router's event loop,
in whatever order they were scheduled, so a short answer can complete before it is reported routed.
And a replica found for one request goes to that request, not to the oldest one waiting.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from pagedllm.cluster.request_router import KVAwareRequestRouter


def replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})


def pending(request_id: str, internal_id: str):
    return SimpleNamespace(args=(request_id, [1, 2, 3], None),
                           metadata=SimpleNamespace(call_method="generate", internal_request_id=internal_id))


@pytest.fixture
def router():
    r = KVAwareRequestRouter(deployment_id=DeploymentID(name="Engine", app_name="unit"),
                             handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(routing="round-robin")
    return r


def route(router, request, replicas):
    """Ray's first step: the router's choice (the replica it puts first)."""
    return asyncio.run(router.choose_replicas(replicas, request))[0][0]


def logged(router) -> list[tuple[str, str]]:
    return [(d["request_id"], d["replica"]) for d in router.view()["decisions"]]


def loads(router) -> dict[str, int]:
    return {r["replica"]: (r["in_flight"], r["load"]) for r in router.view()["replicas"]}


def test_a_request_reported_routed_then_completed(router):
    a, b = replica("a"), replica("b")
    request = pending("req-1", "i1")
    chosen = route(router, request, [a, b])
    router.on_request_routed(request, chosen.replica_id, None)
    assert loads(router)[chosen.replica_id.unique_id] == (1, 1)
    router.on_request_completed(chosen.replica_id, "i1")
    assert logged(router) == [("req-1", chosen.replica_id.unique_id)]
    assert loads(router) == {"a": (0, 0), "b": (0, 0)}


def test_a_short_answer_that_completes_before_it_is_reported_routed_keeps_its_decision(router):
    a, b = replica("a"), replica("b")
    request = pending("req-1", "i1")
    chosen = route(router, request, [a, b])
    router.on_request_completed(chosen.replica_id, "i1")  # its done callback ran first
    router.on_request_routed(request, chosen.replica_id, None)
    assert logged(router) == [("req-1", chosen.replica_id.unique_id)]
    assert loads(router) == {"a": (0, 0), "b": (0, 0)}  # no phantom request left in flight


def test_a_request_rejected_by_one_replica_and_accepted_by_another(router):
    a, b = replica("a"), replica("b")
    request = pending("req-1", "i1")
    first = route(router, request, [a, b])
    router.on_request_completed(first.replica_id, "i1")  # rejected: Ray cancels it, its callback fires
    other = b if first is a else a
    second = route(router, request, [other])  # Ray retries with the replica that has room
    router.on_request_routed(request, second.replica_id, None)
    assert loads(router)[other.replica_id.unique_id] == (1, 1)
    router.on_request_completed(second.replica_id, "i1")
    assert logged(router) == [("req-1", other.replica_id.unique_id)]
    assert loads(router) == {"a": (0, 0), "b": (0, 0)}


def test_a_request_rejected_and_then_accepted_by_the_same_replica_is_counted_in_flight(router):
    a = replica("a")
    request = pending("req-1", "i1")
    route(router, request, [a])
    router.on_request_completed(a.replica_id, "i1")  # rejected: the replica was full
    route(router, request, [a])  # Ray tries again, and this time it has room
    router.on_request_routed(request, a.replica_id, None)
    assert loads(router) == {"a": (1, 1)}
    router.on_request_completed(a.replica_id, "i1")
    assert logged(router) == [("req-1", "a")] and loads(router) == {"a": (0, 0)}


def test_a_replica_chosen_for_one_request_goes_to_that_request_not_the_oldest_waiting(router):
    """Ray's routing tasks (at most two per replica) each choose for one pending request; the replica
    found is then handed to a pending request by the router's matching rule. The choice is this
    request's (its prompt's cached prefix), so it must go to this request, as in Ray's own
    prefix-aware routers, and not to the oldest one waiting (Ray's FIFOMixin)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    async def hand_over() -> tuple[bool, bool]:
        older, newer = (PendingRequest(args=[f"{name}-0", [1] * 8, None], kwargs={},
                                       metadata=RequestMetadata(request_id=name, internal_request_id=f"i-{name}",
                                                                call_method="generate"))
                        for name in ("older", "newer"))
        for pr in (older, newer):
            router._pending_requests_to_fulfill.append(pr)
            router._add_pending_request_to_indices(pr)
        a = replica("a")
        router._fulfill_next_pending_request(a, newer.metadata)  # newer's routing task found a for it
        return newer.future.done() and newer.future.result() is a, older.future.done()

    assert asyncio.run(hand_over()) == (True, False)
