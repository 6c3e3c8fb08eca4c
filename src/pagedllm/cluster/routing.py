"""Choosing the replica a request goes to (issue 26): pure policy, no Ray and no torch, so the Ray
Serve request router, the simulator and the tests share one implementation.

``ReplicaState`` is what the router knows of one replica: the block hashes it holds in its prefix
cache, kept current by its KV-cache events (``kvcache/kv_events.py``: stored, removed, cleared),
bounded in size (the least recently stored forgotten first), and its load as it reports it
(requests waiting and running, KV usage). When a replica's event stream has a gap that replay could
not fill, its view turns approximate: from then on the router also records what it sent there (the
request's full-block hashes, as SGLang's approximate router does) until a clear or a resync.

Policies (``ROUTING_POLICIES``), each ``choose(request_hashes, replicas) -> index``:
- ``round-robin``: in turn;
- ``power-of-two``: two replicas drawn at random (seeded), the less loaded of them;
- ``prefix-aware``: the replica holding the longest cached prefix of the request (its leading block
  hashes), unless its load exceeds the least-loaded replica's by more than ``load_threshold``
  requests, or its KV pool is full while requests wait there: then power-of-two. Ties in prefix go
  to the less loaded, ties in load to one of them drawn at random (seeded), never to the first
  listed. A request whose best replica holds less than ``min_match_rate`` of its full blocks
  (SGLang's ``cache_threshold``, Ray's ``match_rate_threshold``; none at all included) goes to the
  least-loaded replica instead, ties drawn at random: a prefix that short (a shared system prompt
  before a new conversation) saves less prefill than balancing gains, and following it would keep
  every new conversation on the replicas that served the first ones while the others stay cold.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from pagedllm.kvcache.hashing import BlockHasher
from pagedllm.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

DEFAULT_CAPACITY = 1_000_000  # hashes remembered per replica (16 B each: ~50 MB with the dict's overhead)
DEFAULT_LOAD_THRESHOLD = 4    # requests: how much busier than the least loaded a prefix holder may be
DEFAULT_MIN_MATCH_RATE = 0.5  # of a request's full blocks its best replica must hold to be chosen for them


@dataclass
class ReplicaState:
    replica_id: str
    capacity: int = DEFAULT_CAPACITY
    cached: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, oldest stored first
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    exact: bool = True        # False after events were lost: routed requests' hashes are recorded too
    last_seq: int = -1        # the last event batch applied

    @property
    def load(self) -> int:
        """Requests on the replica (waiting + running), what the threshold compares."""
        return self.num_waiting + self.num_running

    @property
    def saturated(self) -> bool:
        """Its KV pool is full and requests queue for it."""
        return self.kv_usage >= 0.99 and self.num_waiting > 0

    def apply(self, events, seq: int | None = None) -> None:
        """A batch of the replica's KV events (``seq``: its sequence number; a gap makes the view
        approximate; a batch already applied, met again in a replay, is skipped)."""
        if seq is not None:
            if seq <= self.last_seq:
                return
            if self.last_seq >= 0 and seq != self.last_seq + 1:
                self.exact = False
            self.last_seq = seq
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._remember(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.cached.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.cached.clear()
                self.exact = True  # a fresh start: nothing is left to have missed

    def _remember(self, block_hash: bytes) -> None:
        self.cached[block_hash] = None
        self.cached.move_to_end(block_hash)
        while len(self.cached) > self.capacity:
            self.cached.popitem(last=False)

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of the request's leading blocks the replica holds."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def routed(self, hashes: Sequence[bytes]) -> None:
        """A request was sent here: counted as waiting; in approximate mode its blocks are assumed cached."""
        self.num_waiting += 1
        if not self.exact:
            for h in hashes:
                self._remember(h)


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class PowerOfTwo:
    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> int:
        if len(replicas) == 1:
            return 0
        a, b = self.rng.sample(range(len(replicas)), 2)
        return a if replicas[a].load <= replicas[b].load else b


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, load_threshold: int = DEFAULT_LOAD_THRESHOLD, seed: int = 0,
                 min_match_rate: float = DEFAULT_MIN_MATCH_RATE) -> None:
        if load_threshold < 0:
            raise ValueError(f"load_threshold must be 0 or more, got {load_threshold}")
        if not 0.0 <= min_match_rate <= 1.0:
            raise ValueError(f"min_match_rate must be between 0 and 1, got {min_match_rate}")
        self.load_threshold = load_threshold
        self.min_match_rate = min_match_rate
        self.fallback = PowerOfTwo(seed)
        self.rng = self.fallback.rng  # one seeded stream for every draw
        self.decisions = {"prefix": 0, "overloaded": 0, "short_prefix": 0, "no_prefix": 0}  # why each choice
        self.last_reason = ""  # why the latest choice was made (one of ``decisions``)

    def choose(self, hashes: Sequence[bytes], replicas: Sequence[ReplicaState]) -> int:
        matched = [r.prefix_blocks(hashes) for r in replicas]
        best = max(matched)
        if best == 0 or best / len(hashes) < self.min_match_rate:
            self._decided("no_prefix" if best == 0 else "short_prefix")
            return self._least_loaded(range(len(replicas)), replicas)
        least = min(r.load for r in replicas)
        i = self._least_loaded([k for k, m in enumerate(matched) if m == best], replicas)
        if replicas[i].load - least > self.load_threshold or replicas[i].saturated:
            self._decided("overloaded")
            return self.fallback.choose(hashes, replicas)
        self._decided("prefix")
        return i

    def _least_loaded(self, candidates: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The index, among ``candidates`` (not empty), of a replica with the least load; ties drawn
        from ``self.rng`` (seeded), so a run repeats and no replica is preferred for its place."""
        lightest = min(replicas[k].load for k in candidates)
        tied = [k for k in candidates if replicas[k].load == lightest]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def _decided(self, reason: str) -> None:
        self.decisions[reason] += 1
        self.last_reason = reason


def request_block_hashes(hasher: BlockHasher, token_ids: Sequence[int], block_size: int,
                         salt: str | None = None) -> list[bytes]:
    """The hashes of a prompt's full blocks as its replica's prefix cache and KV events carry them
    (``hasher``: the replicas' algorithm and seed, ``prefix_caching_hash_seed``)."""
    hashes: list[int] = []
    hasher.extend(hashes, token_ids, block_size, (salt or "").encode())
    return [h.to_bytes(hasher.digest_bits // 8, "little") for h in hashes]


def hash_set_digest(hashes) -> str:
    """A short digest of a set of block hashes (order-free): a replica's cached set and the router's
    view of it are equal when their digests are (``/cluster`` shows both)."""
    h = xxhash.xxh3_64()
    for block_hash in sorted(hashes):
        h.update(block_hash)
    return f"{len(hashes)}:{h.hexdigest()}"


ROUTING_POLICIES = {"prefix-aware": PrefixAware, "power-of-two": PowerOfTwo, "round-robin": RoundRobin}


def make_policy(name: str, seed: int = 0, load_threshold: int = DEFAULT_LOAD_THRESHOLD,
                min_match_rate: float = DEFAULT_MIN_MATCH_RATE):
    """The policy ``name`` with the settings it takes (the others are ignored): a seed for
    power-of-two's draws, and prefix-aware's thresholds besides."""
    if name == "prefix-aware":
        return PrefixAware(load_threshold, seed, min_match_rate)
    if name == "power-of-two":
        return PowerOfTwo(seed)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {name!r}")
