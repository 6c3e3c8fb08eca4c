"""Eviction policies: exact orders in which free blocks are reused, and preemption victims."""

from __future__ import annotations

import pytest

from pagedllm.kvcache import Block, BlockAllocator, KVCacheManager
from pagedllm.kvcache.eviction import LRFU_LAMBDA, POLICIES, make_policy


def ids(blocks):
    return [b.block_id for b in blocks]


def cached_pool(policy: str, n: int) -> tuple[BlockAllocator, list]:
    """n blocks allocated once (clock 1..n), marked as cached, then freed in id order."""
    alloc = BlockAllocator(n, policy)
    blocks = alloc.allocate(n)
    for b in blocks:
        b.block_hash = 1000 + b.block_id
    for b in blocks:
        alloc.decref(b)
    return alloc, blocks


def hit(alloc, block, times=1):
    for _ in range(times):
        alloc.touch(block)
        alloc.decref(block)


def test_lru_reuses_in_free_order_and_a_chain_tail_first():
    alloc = BlockAllocator(6, "lru")
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    alloc.free(b)
    alloc.free(a)
    assert ids(alloc.allocate(6)) == [5, 4, 3, 2, 1, 0]


def test_lfu_reuses_fewest_uses_first_ties_least_recent():
    alloc, blocks = cached_pool("lfu", 4)
    hit(alloc, blocks[0], 2)  # uses 3
    hit(alloc, blocks[2], 1)  # uses 2
    # uses: 0->3, 1->1, 2->2, 3->1; ties 1 and 3 broken by last use (1 at clock 2, 3 at clock 4)
    assert ids(alloc.allocate(4)) == [1, 3, 2, 0]


def test_non_lru_policies_hand_out_empty_blocks_before_cached_ones():
    for policy in ("lfu", "lru-lfu", "size-weighted"):
        alloc, blocks = cached_pool(policy, 3)
        blocks[1].block_hash = None  # freed, but caches nothing
        alloc.touch(blocks[1])
        alloc.decref(blocks[1])
        assert ids(alloc.allocate(1)) == [1], policy


def lrfu_value(use_times: list[int], now: int) -> float:
    """The LRFU definition: CRF(now) = sum over past uses of 2^(-lambda * (now - t))."""
    return sum(2.0 ** (-LRFU_LAMBDA * (now - t)) for t in use_times)


def test_lru_lfu_orders_by_combined_recency_frequency_unlike_lru():
    alloc, blocks = cached_pool("lru-lfu", 3)  # uses at clocks 1, 2, 3
    hit(alloc, blocks[0], 5)  # block 0 used at 1 and 4..8
    hit(alloc, blocks[2], 1)  # block 2 used at 3 and 9
    uses = {0: [1, 4, 5, 6, 7, 8], 1: [2], 2: [3, 9]}
    expected = sorted(uses, key=lambda i: lrfu_value(uses[i], alloc.clock))
    # LRU would follow the free order 1, 0, 2; block 0's frequency outweighs block 2's recency
    assert ids(alloc.allocate(3)) == expected == [1, 2, 0]


def test_lru_lfu_forgets_stale_frequency_unlike_lfu():
    alloc, blocks = cached_pool("lru-lfu", 3)
    hit(alloc, blocks[0], 5)   # block 0: 6 uses, all old (1, 4..8)
    hit(alloc, blocks[2], 10)  # block 2: 11 uses (3, 9..18)
    hit(alloc, blocks[1], 2)   # block 1: 3 uses, recent (2, 19, 20)
    uses = {0: [1, 4, 5, 6, 7, 8], 1: [2, 19, 20], 2: [3] + list(range(9, 19))}
    expected = sorted(uses, key=lambda i: lrfu_value(uses[i], alloc.clock))
    assert ids(alloc.allocate(3)) == expected == [0, 2, 1]  # LFU would reuse block 1 first
    lfu, lfu_blocks = cached_pool("lfu", 3)
    hit(lfu, lfu_blocks[0], 5)
    hit(lfu, lfu_blocks[2], 10)
    hit(lfu, lfu_blocks[1], 2)
    assert ids(lfu.allocate(3)) == [1, 0, 2]


def test_size_weighted_frees_large_rarely_used_sequences_first():
    alloc = BlockAllocator(6, "size-weighted")
    big = alloc.allocate(4)
    small = alloc.allocate(2)
    for b in big + small:
        b.block_hash = 1000 + b.block_id
    alloc.free(small)  # owner size 2: priority 0 + 1/2
    alloc.free(big)    # owner size 4: priority 0 + 1/4
    # big's blocks (lower priority) first, ties by last use (oldest first), then small's
    assert ids(alloc.allocate(6)) == [0, 1, 2, 3, 4, 5]


def test_size_weighted_ages_with_each_eviction():
    alloc = BlockAllocator(3, "size-weighted")
    a, b, c = alloc.allocate(3)
    for blk in (a, b, c):
        blk.block_hash = 1000 + blk.block_id
    alloc.free([a])
    hit(alloc, a, 3)              # a: 4 uses, owner size 1 -> priority 4
    alloc.free([b])               # b: priority 1
    assert ids(alloc.allocate(1)) == [1]          # evicts b: inflation L becomes 1
    c.owner_size = 1
    alloc.decref(c)               # c freed after the eviction: priority L + 1 = 2 < 4
    assert ids(alloc.allocate(2)) == [2, 0]


@pytest.mark.parametrize("policy,expected", [("lru", "c"), ("lfu", "a"), ("size-weighted", "b"),
                                             ("lru-lfu", "a")])
def test_preemption_victim_follows_the_policy(policy, expected):
    kv = KVCacheManager(num_blocks=16, block_size=8, eviction_policy=policy)
    shared = list(range(16))
    kv.allocate_slots("warm", 16)
    kv.cache_full_blocks("warm", shared, 16)
    kv.free("warm")
    kv.allocate_slots("a", 8)                                         # 1 fresh block: mean uses 1
    kv.allocate_slots("b", 40, kv.cached_prefix("b", shared + [1]))   # 2 shared + 3 fresh: 1.8, largest
    kv.allocate_slots("c", 24, kv.cached_prefix("c", shared + [1]))   # 2 shared + 1 fresh: 2.33
    # lru: newest (c); lfu: least used (a); size-weighted: mean uses / size lowest (b: 0.36);
    # lru-lfu: lowest mean LRFU value (a: one use; the shared blocks were used three times)
    assert ["a", "b", "c"][kv.choose_victim(["a", "b", "c"])] == expected


HEAP_POLICIES = ("lfu", "lru-lfu", "size-weighted")
HEAP_SLACK = 16  # stale heap entries tolerated on top of twice the live ones


def heap_entries(policy) -> int:
    """Entries in a heap policy's heap, stale ones included (white box: the defect is memory)."""
    return len(policy._heap)


def prefix_hit_run(policy: str, cycles: int, compact: bool = True) -> tuple[KVCacheManager, list[list[int]]]:
    """A 16-block manager serving ``cycles`` requests over 5 prompt families (3 full blocks each),
    so every request hits its family's cached prefix and families evict each other.

    Returns the manager and each request's block ids (the exact reuse order). With ``compact=False``
    the heap is never compacted: the reference the compacting heap must match."""
    kv = KVCacheManager(num_blocks=16, block_size=8, eviction_policy=policy)
    heap = kv.allocator.free_blocks
    if not compact:
        heap._maybe_compact = lambda: None
    families = [[1000 * f + t for t in range(24)] for f in range(5)]
    trace = []
    for i in range(cycles):
        rid = f"r{i}"
        tokens = families[(i * 7) % 5 if i % 3 else i % 5] + [i % 11, i % 13]
        cached = kv.cached_prefix(rid, tokens)
        assert kv.allocate_slots(rid, len(tokens), cached)
        kv.cache_full_blocks(rid, tokens, len(tokens))
        if i % 4 == 0:  # a second request holds blocks while the first is live
            other = f"o{i}"
            assert kv.allocate_slots(other, 8 * (1 + i % 3))
            trace.append(kv.block_ids(other))
            kv.free(other)
        trace.append(kv.block_ids(rid))
        kv.free(rid)
        if compact:
            assert heap_entries(heap) <= 2 * len(heap) + HEAP_SLACK, (i, heap_entries(heap), len(heap))
    kv.check_invariants()
    trace.append([b.block_id for b in kv.allocator.allocate(16)])
    return kv, trace


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_heap_policies_stay_bounded_over_many_prefix_hits(policy):
    kv, _ = prefix_hit_run(policy, 10_000)  # asserts the bound after every request
    assert kv.allocator.num_evictions > 100  # families evicted each other: pop order mattered


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_compacting_the_heap_keeps_the_exact_reuse_order(policy):
    kv, compacted = prefix_hit_run(policy, 2_000)
    _, reference = prefix_hit_run(policy, 2_000, compact=False)
    assert compacted == reference
    if policy != "lru-lfu":  # LRFU keys grow with time: here pops drain its stale entries first
        assert kv.allocator.free_blocks.num_compactions > 0


def touch_cycles(policy: str, compact: bool = True) -> tuple[BlockAllocator, list[int]]:
    """4 cached blocks; block 0 hit 10,000 times, and every 100 hits one block is reused and freed
    again. Returns the allocator and the reused blocks in order."""
    alloc, blocks = cached_pool(policy, 4)
    heap = alloc.free_blocks
    if not compact:
        heap._maybe_compact = lambda: None
    reused = []
    for i in range(10_000):
        hit(alloc, blocks[0])
        if i % 100 == 99:
            (b,) = alloc.allocate(1)
            b.block_hash = 2000 + i
            reused.append(b.block_id)
            alloc.free([b])
        if compact:
            assert heap_entries(heap) <= 2 * len(heap) + HEAP_SLACK
    return alloc, reused


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_free_touch_cycles_keep_the_heap_bounded_and_the_order_exact(policy):
    alloc, reused = touch_cycles(policy)
    assert alloc.free_blocks.num_compactions > 0
    assert reused == touch_cycles(policy, compact=False)[1]
    # blocks 1..3 have one use each (a reuse restarts the count), block 0 thousands: the three
    # take turns, least recent first, and block 0 is never reused
    assert reused == [1, 2, 3] * 33 + [1]
    assert ids(alloc.allocate(4)) == [2, 3, 1, 0]


def held(*uses_and_crf: tuple[int, float]) -> list[Block]:
    """The blocks one request holds, with the given (uses, crf) each."""
    out = []
    for uses, crf in uses_and_crf:
        b = Block(len(out))
        b.uses, b.crf = uses, crf
        out.append(b)
    return out


@pytest.mark.parametrize("policy,expected", [("lru", 3), ("lfu", 1), ("size-weighted", 0), ("lru-lfu", 3)])
def test_each_policy_chooses_its_own_victim(policy, expected):
    candidates = [
        held(*[(2, 0.5)] * 4),    # 0: mean uses 2, uses/size 0.5, mean crf 0.5
        held((1, 2.0)),           # 1: mean uses 1, uses/size 1, mean crf 2
        [],                       # 2: holds nothing: never worth preempting (+inf)
        held((3, 0.5), (3, 0.5)),  # 3: mean uses 3, uses/size 1.5, mean crf 0.5 (ties 0: newest wins)
    ]
    assert make_policy(policy, []).victim_index(candidates) == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_victim_ties_go_to_the_newest_and_empty_requests_last(policy):
    same = [held((2, 1.0)), held((2, 1.0)), held((2, 1.0))]
    assert make_policy(policy, []).victim_index(same) == 2
    assert make_policy(policy, []).victim_index([[], [], []]) == 2
    if policy != "lru":  # lru always takes the newest, even one holding nothing
        assert make_policy(policy, []).victim_index([held((2, 1.0)), held((9, 9.0)), []]) == 0
