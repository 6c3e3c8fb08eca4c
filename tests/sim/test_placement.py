"""Block placement experiments (``sim/placement.py``): merging adjacent blocks and a reserve of
large blocks, on the engine's own KV manager."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.sim.placement import (
    AdjacentKVManager,
    ReserveKVManager,
    compare_placements,
    make_manager,
    run_stats,
)
from pagedllm.sim.shapes import Device, ModelShape
from pagedllm.sim.simulator import StepTimeModel
from pagedllm.workloads.traces import TraceRequest


def test_run_stats_counts_physical_runs():
    kv = make_manager("policy", CacheConfig(block_size=8, enable_prefix_caching=False), 16)
    kv.allocate_slots("a", 24)  # blocks 0, 1, 2: one run
    kv.allocate_slots("b", 8)   # block 3
    kv.allocate_slots("a", 32)  # block 4: after b's block, a second run
    assert kv.block_ids("a") == [0, 1, 2, 4]
    assert run_stats(kv) == (5, 3)


def test_adjacent_placement_takes_the_block_after_the_last_one_when_it_is_free():
    kv = AdjacentKVManager(16, 4, enable_prefix_caching=False)
    kv.allocate_slots("a", 8)   # 0, 1
    kv.allocate_slots("b", 8)   # 2, 3
    kv.free("b")                # 3 and 2 go back to the free queue (behind 4..15)
    kv.allocate_slots("a", 12)  # the policy would hand out 4; the block after a's last is 2
    assert kv.block_ids("a") == [0, 1, 2]
    kv.allocate_slots("c", 4)   # no hint: the policy's order
    assert kv.block_ids("c") == [4]
    kv.allocate_slots("a", 16)  # 3 is free: taken
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.check_invariants()


def test_reserve_hands_long_sequences_whole_runs_and_takes_them_back():
    kv = ReserveKVManager(32, 4, enable_prefix_caching=True, reserve_share=0.25, run_blocks=4, threshold_blocks=2)
    assert kv.reserve_start == 24 and list(kv.free_runs) == [24, 28]
    assert kv.num_free_blocks == 24  # the reserve is not free for admission
    kv.allocate_slots("short", 4)
    kv.allocate_slots("long", 8)           # 2 ordinary blocks
    kv.allocate_slots("long", 9)           # past the threshold: a whole run of 4
    assert kv.block_ids("long")[2:] == [24, 25, 26, 27]
    kv.allocate_slots("long", 24)          # the run covers up to 24 slots: nothing new
    assert len(kv.block_ids("long")) == 6 and list(kv.free_runs) == [28]
    kv.cache_full_blocks("long", list(range(24)), 24)
    assert all(kv.allocator.blocks[i].block_hash is None for i in range(24, 28))  # never shared
    st = kv.stats()
    assert st["num_used_blocks"] == 3 + 4 and st["num_free_blocks"] == 32 - 7
    kv.free("long")
    assert sorted(kv.free_runs) == [24, 28] and kv.num_free_blocks == 23
    kv.free("short")
    assert kv.stats()["num_used_blocks"] == 0


def test_placements_replay_a_trace_to_the_end():
    shape = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 512)
    trace = [TraceRequest(arrival=0.0, prompt_len=60 + 7 * i, output_len=40) for i in range(10)]
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
    out = compare_placements(trace, StepTimeModel(shape, Device("d", 10**9, 1e9, 1e9)),
                             CacheConfig(block_size=8, num_kv_blocks=96, enable_prefix_caching=False), sched, 96,
                             sample_every=1, reserve_share=0.25, run_blocks=4, threshold_blocks=4)
    assert set(out) == {"policy", "adjacent", "reserve"}
    for name, r in out.items():
        assert r["finished"] == 10 and r["blocks_per_run"] >= 1, name
    assert out["reserve"]["blocks_per_run"] > out["policy"]["blocks_per_run"]
    with pytest.raises(ValueError, match="placement"):
        make_manager("random", CacheConfig(), 8)
