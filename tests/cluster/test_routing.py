"""The routing policies (cluster/routing.py) on replica views built from KV events: a follow-up
turn goes to the replica holding its prefix, a saturated or overloaded holder loses it to the less
loaded, lost events make a view approximate, and a view stays within its size bound."""

from __future__ import annotations

import pytest

from pagedllm.cluster.routing import PowerOfTwo, PrefixAware, ReplicaState, RoundRobin, make_policy
from pagedllm.kvcache.hashing import BlockHasher
from pagedllm.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher("sha256")


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    out: list[int] = []
    HASHER.extend(out, tokens, block_size)
    return [h.to_bytes(32, "little") for h in out]


def stored(hs: list[bytes]) -> BlockStored:
    return BlockStored(hs, None, list(range(4 * len(hs))), 4)


def test_a_follow_up_turn_goes_to_the_replica_that_served_the_conversation():
    first_turn = list(range(1, 17))                  # 4 blocks
    follow_up = first_turn + list(range(50, 58))     # the same 4, then 2 more
    a, b = ReplicaState("a"), ReplicaState("b")
    b.apply([stored(hashes(first_turn))], seq=0)
    a.apply([stored(hashes(list(range(100, 108))))], seq=0)  # something else
    a.num_running, b.num_running = 1, 3                 # b busier, within the threshold (4)
    policy = PrefixAware(load_threshold=4)
    assert b.prefix_blocks(hashes(follow_up)) == 4 and a.prefix_blocks(hashes(follow_up)) == 0
    assert policy.choose(hashes(follow_up), [a, b]) == 1
    assert policy.decisions == {"prefix": 1, "overloaded": 0, "short_prefix": 0, "no_prefix": 0}


def test_an_overloaded_or_saturated_holder_loses_the_request_to_the_least_loaded():
    turn = list(range(1, 17))
    a, b = ReplicaState("a"), ReplicaState("b")
    b.apply([stored(hashes(turn))])
    policy = PrefixAware(load_threshold=4)
    b.num_waiting, b.num_running = 3, 2   # 5 more than a's 0: over the threshold
    assert policy.choose(hashes(turn), [a, b]) == 0
    b.num_waiting, b.num_running, b.kv_usage = 1, 0, 1.0  # within the threshold, but full and a request waits
    assert policy.choose(hashes(turn), [a, b]) == 0
    b.kv_usage = 0.5
    assert policy.choose(hashes(turn), [a, b]) == 1
    assert policy.decisions == {"prefix": 1, "overloaded": 2, "short_prefix": 0, "no_prefix": 0}


def test_removals_and_clears_follow_the_replica_and_lost_events_make_the_view_approximate():
    r = ReplicaState("r")
    hs = hashes(list(range(1, 17)))
    r.apply([stored(hs)], seq=0)
    r.apply([BlockRemoved(hs[2:3])], seq=1)
    assert r.prefix_blocks(hs) == 2 and r.exact
    r.apply([], seq=5)  # batches 2..4 never arrived
    assert not r.exact
    other = hashes(list(range(200, 208)))
    r.routed(other)  # approximate: what is routed here is assumed cached
    assert r.prefix_blocks(other) == 2 and r.num_waiting == 1
    r.apply([AllBlocksCleared()], seq=6)
    assert r.exact and r.prefix_blocks(hs) == 0 and r.prefix_blocks(other) == 0
    r.routed(other)
    assert r.prefix_blocks(other) == 0  # exact again: only events say what is cached


def test_a_view_forgets_its_oldest_hashes_beyond_its_bound():
    r = ReplicaState("r", capacity=3)
    hs = hashes(list(range(1, 21)))  # 5 blocks
    r.apply([stored(hs)])
    assert list(r.cached) == hs[2:]


def test_power_of_two_takes_the_less_loaded_of_two_and_round_robin_takes_turns():
    reps = [ReplicaState(str(i)) for i in range(2)]
    reps[0].num_running = 5
    assert {PowerOfTwo(seed=s).choose([], reps) for s in range(10)} == {1}
    rr = RoundRobin()
    assert [rr.choose([], reps) for _ in range(4)] == [0, 1, 0, 1]
    assert isinstance(make_policy("prefix-aware", load_threshold=2), PrefixAware)
    with pytest.raises(ValueError, match="routing must be one of prefix-aware, power-of-two, round-robin"):
        make_policy("random")


def test_holders_tied_in_prefix_and_load_share_the_requests_instead_of_the_first_listed_taking_all():
    system_prompt = list(range(1, 17))  # 4 blocks every conversation starts with
    replicas = [ReplicaState("a"), ReplicaState("b"), ReplicaState("c")]
    for r in replicas[:2]:
        r.apply([stored(hashes(system_prompt))])
    policy = PrefixAware(load_threshold=4, seed=3)
    new_conversations = [hashes(system_prompt + [100 + i] * 4) for i in range(40)]  # 4 of 5 blocks held
    chosen = [policy.choose(h, replicas) for h in new_conversations]
    assert set(chosen) == {0, 1}  # both holders, never c, which holds nothing of them
    assert 10 <= chosen.count(1) <= 30
    assert policy.decisions == {"prefix": 40, "overloaded": 0, "short_prefix": 0, "no_prefix": 0}
    replicas[0].num_running = 1  # a tie in prefix only: the less loaded holder
    assert {policy.choose(h, replicas) for h in new_conversations} == {1}


def test_a_prefix_shorter_than_the_match_rate_goes_to_the_least_loaded_so_cold_replicas_warm_up():
    system_prompt = list(range(1, 17))  # 4 blocks every conversation starts with
    warm, cold, busy = ReplicaState("warm"), ReplicaState("cold"), ReplicaState("busy")
    warm.apply([stored(hashes(system_prompt))])
    busy.num_running = 2
    replicas = [warm, cold, busy]
    policy = PrefixAware(load_threshold=4, min_match_rate=0.5, seed=1)
    new_conversation = hashes(system_prompt + [200] * 16)  # 8 blocks, 4 of them cached on warm: 0.5
    assert policy.choose(new_conversation, replicas) == 0 and policy.last_reason == "prefix"
    longer = hashes(system_prompt + [200] * 20)  # 9 blocks: 4 cached is under half
    chosen = {policy.choose(longer, replicas) for _ in range(30)}
    assert chosen == {0, 1} and policy.last_reason == "short_prefix"  # idle warm and cold, never busy
    warm.num_running = 1
    assert policy.choose(longer, replicas) == 1  # the least loaded, whatever it caches
    assert policy.choose(hashes([300] * 16), replicas) == 1 and policy.last_reason == "no_prefix"
    assert PrefixAware(min_match_rate=0.0).choose(longer, replicas) == 0  # any prefix counts
    assert policy.decisions == {"prefix": 1, "overloaded": 0, "short_prefix": 31, "no_prefix": 1}
    with pytest.raises(ValueError, match="min_match_rate must be between 0 and 1, got 1.5"):
        PrefixAware(min_match_rate=1.5)
