"""The contiguous baseline: one max-length reservation per request, first-fit, same interface."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kvcache.contiguous import ContiguousKVCacheManager
from tests.unit.test_scheduler import FakePagedModel, make, req, run_to_end


def test_reserves_max_model_len_up_front_and_counts_unfilled_slots():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=8, max_model_len=32)
    assert kv.allocate_slots("a", 5)
    assert kv.block_ids("a") == [0, 1, 2, 3]  # 32 slots reserved for a 5-token prompt
    assert kv.stats()["fragmentation"] == pytest.approx(27 / 32)
    assert kv.allocate_slots("a", 20) and kv.block_ids("a") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="outgrew"):
        kv.allocate_slots("a", 33)
    kv.check_invariants()


def test_request_sized_reservations_and_external_fragmentation():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=8, max_model_len=64, reservation="request")
    assert kv.allocate_slots("a", 4, max_total_tokens=16)   # blocks 0-1
    assert kv.allocate_slots("b", 4, max_total_tokens=24)   # blocks 2-4
    assert kv.allocate_slots("c", 4, max_total_tokens=16)   # blocks 5-6
    kv.free("a")
    kv.free("c")
    assert kv.num_free_blocks == 5
    # 5 blocks are free but the longest run is 3 (blocks 5-7): a 4-block reservation must wait
    assert not kv.allocate_slots("d", 4, max_total_tokens=32)
    assert kv.stats()["num_admission_stalls"] == 1
    assert kv.allocate_slots("e", 4, max_total_tokens=24) and kv.block_ids("e") == [5, 6, 7]
    kv.check_invariants()
    for rid in ("b", "e"):
        kv.free(rid)
    assert kv.num_free_blocks == 8 and kv.stats()["usage"] == 0.0


@settings(max_examples=40, deadline=None)
@given(workload=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=10),
       budget=st.integers(8, 64), reservation=st.sampled_from(["max_model_len", "request"]))
def test_contiguous_scheduling_finishes_everything_with_the_paged_outputs(workload, budget, reservation):
    block_size = 8
    kv = ContiguousKVCacheManager(num_blocks=24, block_size=block_size, max_model_len=64, reservation=reservation)
    sched = Scheduler(SchedulerConfig(8, budget, 64), kv)
    paged, paged_model = make(24, block_size, 8, budget, max_model_len=64)
    for i, (p, m) in enumerate(workload):
        sched.add(req(str(i), p, m, first=20 + i))
        paged.add(req(str(i), p, m, first=20 + i))
    assert run_to_end(sched, FakePagedModel(block_size)) == run_to_end(paged, paged_model)
    assert kv.num_preemptions == 0  # a reservation never grows
