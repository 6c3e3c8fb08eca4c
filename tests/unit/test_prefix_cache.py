"""Prefix caching through the scheduler (torch-free): exact hit counts for designed prompt sets."""

from __future__ import annotations

import pytest

from pagedllm.engine.request import Request
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.kvcache import KVCacheManager
from tests.unit.test_scheduler import make, run_to_end

B = 8


def request(rid: str, tokens: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   eos_token_ids=frozenset({2}), cache_salt=salt)


def serve(sched, model, *reqs):
    """Run requests one after another (each to completion); returns their outputs."""
    outs = []
    for r in reqs:
        sched.add(r)
        outs.append(run_to_end(sched, model)[r.request_id])
    return outs


def stats(sched):
    return sched.kv.stats()


def test_shared_system_prompt_hits_its_full_blocks():
    sched, model = make(block_size=B)
    system = list(range(100, 121))  # 21 tokens: two full blocks + 5
    a = request("a", system + [1000, 1001, 1002])
    b = request("b", system + [2000, 2001])
    serve(sched, model, a, b)
    s = stats(sched)
    assert s["prefix_cache_queries"] == 24 + 23
    assert s["prefix_cache_hits"] == 16  # b reuses the two full system-prompt blocks
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_multi_turn_chat_reuses_the_previous_turn_including_generated_tokens():
    sched, model = make(block_size=B)
    turn1 = list(range(300, 337))  # 37 tokens
    out1 = serve(sched, model, request("t1", turn1, max_tokens=10))[0]
    turn2 = turn1 + out1 + [400, 401, 402]  # 50 tokens
    out2 = serve(sched, model, request("t2", turn2, max_tokens=6))[0]
    turn3 = turn2 + out2 + [500]
    serve(sched, model, request("t3", turn3, max_tokens=3))
    # turn 1 computed 37 + 9 tokens (the last sampled one is never fed back): 5 full blocks
    # turn 2 computed 50 + 5 = 55 tokens: 6 full blocks; turn 3 has 57 tokens
    assert stats(sched)["prefix_cache_hits"] == 5 * B + 6 * B
    assert stats(sched)["prefix_cache_queries"] == 37 + 50 + 57


def test_a_prefix_shorter_than_a_block_is_not_shared():
    sched, model = make(block_size=B)
    serve(sched, model, request("a", [7, 7, 7, 7, 7, 1, 2, 3]), request("b", [7, 7, 7, 7, 7, 4, 5, 6, 9]))
    assert stats(sched)["prefix_cache_hits"] == 0


def test_different_cache_salts_never_share_and_equal_salts_do():
    sched, model = make(block_size=B)
    prompt = list(range(50, 70))
    serve(sched, model, request("a", prompt, salt="tenant-a"), request("b", prompt, salt="tenant-b"),
          request("c", prompt))
    assert stats(sched)["prefix_cache_hits"] == 0
    serve(sched, model, request("d", prompt, salt="tenant-b"), request("e", prompt))
    assert stats(sched)["prefix_cache_hits"] == 2 * 16


def test_fully_cached_prompt_still_computes_one_token():
    sched, model = make(block_size=B)
    prompt = list(range(10, 26))  # exactly two blocks
    first, again = serve(sched, model, request("a", prompt), request("b", prompt))
    assert stats(sched)["prefix_cache_hits"] == 8  # (16 - 1) // 8 blocks
    assert first == again


def test_freed_blocks_stay_hittable_until_evicted_lru_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    tokens = list(range(32))
    assert kv.allocate_slots("a", 32)
    kv.cache_full_blocks("a", tokens, 32)
    kv.free("a")
    assert [b.block_id for b in kv.allocator.free_blocks] == [3, 2, 1, 0]
    assert [b.block_id for b in kv.cached_prefix("x", tokens + [99])] == [0, 1, 2, 3]
    # a new 8-token request takes the head of the free queue: block 3, the chain's tail
    assert kv.allocate_slots("other", 8)
    assert kv.block_ids("other") == [3] and kv.stats()["num_evictions"] == 1
    assert [b.block_id for b in kv.cached_prefix("y", tokens + [99])] == [0, 1, 2]
    kv.check_invariants()


def test_a_hit_on_a_free_block_takes_it_back_from_the_free_set():
    kv = KVCacheManager(num_blocks=3, block_size=B)
    tokens = list(range(16))
    kv.allocate_slots("a", 16)
    kv.cache_full_blocks("a", tokens, 16)
    kv.free("a")
    cached = kv.cached_prefix("b", tokens + [1])
    assert len(cached) == 2
    assert not kv.allocate_slots("b", 40, cached)  # would need 3 new blocks + the 2 reclaimed
    assert kv.num_free_blocks == 3 and "b" not in kv.tables
    assert kv.allocate_slots("b", 24, cached)
    assert kv.block_ids("b")[:2] == [b.block_id for b in cached] and kv.num_free_blocks == 0
    kv.check_invariants()


@pytest.mark.parametrize("enable", [True, False])
def test_outputs_are_identical_with_prefix_caching_on_and_off(enable):
    sched, model = make(num_blocks=12, block_size=B, budget=24)
    sched.kv.enable_prefix_caching = enable
    system = list(range(100, 125))
    for i in range(6):
        sched.add(request(str(i), system + [1000 + i] * (i + 1), max_tokens=6))
    got = run_to_end(sched, model)
    ref, ref_model = make(num_blocks=12, block_size=B, budget=24)
    ref.kv.enable_prefix_caching = False
    for i in range(6):
        ref.add(request(str(i), system + [1000 + i] * (i + 1), max_tokens=6))
    assert got == run_to_end(ref, ref_model)
    assert (stats(sched)["prefix_cache_hits"] > 0) == enable
