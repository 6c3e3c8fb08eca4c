"""``KVAwareRequestRouter``: Ray Serve's ``RequestRouter`` for the engine deployment, around the
policies of ``cluster/routing.py`` (``--routing prefix-aware | power-of-two | round-robin``).

Ray Serve builds it inside every process that holds a handle to the engine deployment (the
ingress), with ``request_router_kwargs`` (``initialize_state``): the policy, its load threshold and
minimum match rate, and the cluster's secret ``prefix_caching_hash_seed``; the replicas' block size
and hash algorithm come from their routing stats.

- **The request's hashes**: ``generate(request_id, prompt, params)``'s prompt carries its token ids
  and ``cache_salt`` (the ingress tokenized it), hashed as the replicas' prefix caches hash them.
- **Each replica's cache**: its KV events, subscribed to through ``KVEventFeed`` at the endpoints
  its routing stats announce (replayed from the start on subscription).
- **Each replica's load**: requests this router has in flight there (``on_request_routed`` /
  ``on_request_completed``: exact at once for one ingress; Ray may report a short request completed
  before it reports it routed, since it registers the completion callback first, and such a request
  is never counted in flight) or what its routing stats report
  (requests waiting and running, for the requests other ingress replicas sent), whichever is
  larger; its KV usage and waiting requests (a full pool with a queue: saturated) from the stats.
- **The choice**: the policy's replica first, then the others from the least loaded, so Ray Serve
  moves on when the chosen one is at ``max_ongoing_requests``. A replica found for a request goes to
  that request (Ray's default matching by internal id, as in Ray's own prefix-aware routers), not to
  the oldest one waiting (Ray's ``FIFOMixin``): the choice was made for its prompt's prefix. A dead
  replica leaves the candidate list (Ray's replica updates), so requests not yet sent go elsewhere.

Every routed request is logged with its reason and the loads seen (``decisions``, the last
1,000; ``/cluster`` on the ingress shows them), so tests check decisions against the replicas'
state, never timings. ``router_registry.live_router(app, deployment)`` finds the router of this
process (the ingress reads its view for ``/cluster`` and ``/metrics``). Ray Serve pickles this
module by value: what it must share with the rest of the process lives in other modules.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pagedllm.cluster import router_registry
from pagedllm.cluster.event_feed import KVEventFeed
from pagedllm.cluster.routing import (
    DEFAULT_LOAD_THRESHOLD,
    DEFAULT_MIN_MATCH_RATE,
    PrefixAware,
    ReplicaState,
    hash_set_digest,
    make_policy,
    request_block_hashes,
)
from pagedllm.kvcache.hashing import BlockHasher

MAX_PENDING_CHOICES = 10_000


@dataclass(frozen=True)
class Decision:
    request_id: str
    replica: str
    reason: str              # prefix | overloaded | short_prefix | no_prefix | policy (round-robin, power-of-two)
    prefix_blocks: int       # the request's leading blocks the chosen replica held
    loads: dict[str, int]    # every candidate's load when it was chosen


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, routing: str = "prefix-aware", load_threshold: int = DEFAULT_LOAD_THRESHOLD,
                         hash_seed: int | None = None, topic: str = "", seed: int = 0,
                         min_match_rate: float = DEFAULT_MIN_MATCH_RATE) -> None:
        self.routing = routing
        self.policy = make_policy(routing, seed, load_threshold, min_match_rate)
        self.hash_seed = hash_seed
        self.hasher: BlockHasher | None = None  # the replicas' algorithm, from their routing stats
        self.block_size = 0
        self.states: dict[str, ReplicaState] = {}
        self.stats: dict[str, dict] = {}  # replica -> its latest routing stats
        self.in_flight: defaultdict[str, set[str]] = defaultdict(set)  # replica -> internal ids routed, not completed
        self._completed_unrouted: OrderedDict[tuple[str, str], None] = OrderedDict()  # completed first
        self.routed_total: Counter = Counter()  # replica -> requests routed there
        self.reasons: Counter = Counter()
        self.decisions: deque[Decision] = deque(maxlen=1000)
        self._choices: OrderedDict[str, tuple[Decision, list[bytes]]] = OrderedDict()  # internal id -> choice
        self.feed = KVEventFeed(topic) if routing == "prefix-aware" else None
        router_registry.register(self.app_name, self._deployment_id.name, self)

    # -- Ray Serve's hooks ----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        states = [self._state(r) for r in candidate_replicas]
        hashes = self._hashes(pending_request) if self.feed is not None else []
        if self.feed is not None:
            with self.feed.lock:
                i = self.policy.choose(hashes, states)
                held = states[i].prefix_blocks(hashes)
        else:
            i, held = self.policy.choose(hashes, states), 0
        reason = self.policy.last_reason if isinstance(self.policy, PrefixAware) else "policy"
        chosen = candidate_replicas[i]
        if pending_request is not None:  # a retry: what an earlier, rejected try left is done with
            for r in candidate_replicas:
                self._completed_unrouted.pop((r.replica_id.unique_id, pending_request.metadata.internal_request_id),
                                             None)
        if pending_request is not None and pending_request.metadata.call_method == "generate":
            decision = Decision(str(pending_request.args[0]) if pending_request.args else "",
                                chosen.replica_id.unique_id, reason, held,
                                {s.replica_id: s.load for s in states})
            self._choices[pending_request.metadata.internal_request_id] = (decision, hashes)
            while len(self._choices) > MAX_PENDING_CHOICES:  # requests cancelled before they were sent
                self._choices.popitem(last=False)
        rest = sorted((r for r in candidate_replicas if r is not chosen),
                      key=lambda r: self.states[r.replica_id.unique_id].load)
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid, internal_id = replica_id.unique_id, pending_request.metadata.internal_request_id
        if (rid, internal_id) in self._completed_unrouted:  # a short answer Ray reported done first
            del self._completed_unrouted[(rid, internal_id)]
        else:
            self.in_flight[rid].add(internal_id)
        self.routed_total[rid] += 1
        decision, hashes = self._choices.pop(internal_id, (None, []))
        if decision is not None:
            if decision.replica != rid:  # Ray moved it on (the chosen replica was full)
                decision = Decision(decision.request_id, rid, "full", 0, decision.loads)
            self.decisions.append(decision)
            self.reasons[decision.reason] += 1
        state = self.states.get(rid)
        if state is not None and self.feed is not None:
            with self.feed.lock:
                state.routed(hashes)  # approximate views assume what is sent there gets cached
        self._refresh_load(rid)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Ray calls this once per request sent to a replica: accepted, rejected (then retried with a
        new choice under the same internal id) or cancelled; an accepted one possibly before
        ``on_request_routed``. The choice stays for ``on_request_routed`` (``_choices`` is bounded)."""
        rid = replica_id.unique_id
        if internal_request_id in self.in_flight.get(rid, ()):
            self.in_flight[rid].remove(internal_request_id)
        else:
            self._completed_unrouted[(rid, internal_request_id)] = None
            while len(self._completed_unrouted) > MAX_PENDING_CHOICES:  # rejections, never routed
                self._completed_unrouted.popitem(last=False)
        self._refresh_load(rid)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in [r for r in self.states if r not in live]:
            del self.states[rid]  # a replica that died or was scaled away
            self.stats.pop(rid, None)
            self.in_flight.pop(rid, None)
            if self.feed is not None:
                self.feed.forget(rid)

    # -- the view -------------------------------------------------------------------------------
    def _state(self, replica: RunningReplica) -> ReplicaState:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        state = self.states.get(rid)
        if state is None:
            state = self.states[rid] = ReplicaState(rid)
        if self.feed is not None and rid not in self.stats and stats.get("kv_events"):
            self.feed.watch(rid, stats["kv_events"], stats.get("kv_replay"), state)
        if stats:
            self.stats[rid] = stats
            if self.hasher is None and "block_size" in stats:
                self.hasher = BlockHasher(stats["hash_algo"], self.hash_seed)
                self.block_size = stats["block_size"]
        self._refresh_load(rid)
        return state

    def _refresh_load(self, rid: str) -> None:
        state = self.states.get(rid)
        if state is None:
            return
        stats = self.stats.get(rid, {})
        waiting = int(stats.get("num_waiting", 0))
        reported = waiting + int(stats.get("num_running", 0))
        state.num_waiting = waiting
        state.num_running = max(len(self.in_flight.get(rid, ())), reported) - waiting
        state.kv_usage = float(stats.get("kv_usage", 0.0))

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        if self.hasher is None or pending_request is None or len(pending_request.args) < 2:
            return []
        prompt = pending_request.args[1]
        if isinstance(prompt, list):
            ids, salt = prompt, None
        elif isinstance(prompt, dict):
            ids, salt = prompt.get("prompt_token_ids"), prompt.get("cache_salt")
        else:
            return []
        if not ids:
            return []
        return request_block_hashes(self.hasher, ids, self.block_size, salt)

    def view(self) -> dict:
        """What ``/cluster`` shows: the policy and its settings, each replica's view and load, the
        routing counts and recent decisions."""
        lock = self.feed.lock if self.feed is not None else None
        if lock is not None:
            lock.acquire()
        try:
            replicas = [{"replica": rid, "cached_blocks": len(s.cached), "exact": s.exact, "load": s.load,
                         "num_waiting": s.num_waiting, "kv_usage": s.kv_usage,
                         "in_flight": len(self.in_flight.get(rid, ())), "routed": self.routed_total[rid],
                         "last_seq": s.last_seq, "cached_digest": hash_set_digest(s.cached)}
                        for rid, s in sorted(self.states.items())]
        finally:
            if lock is not None:
                lock.release()
        settings = ({"load_threshold": self.policy.load_threshold, "min_match_rate": self.policy.min_match_rate}
                    if isinstance(self.policy, PrefixAware) else {})
        return {"routing": self.routing, **settings, "replicas": replicas, "reasons": dict(self.reasons),
                "decisions": [vars(d) for d in list(self.decisions)]}  # list(): one step, as Ray's loop appends
