"""BlockAllocator and FreeBlockQueue: exact orders, ref counts, errors."""

import pytest

from pagedllm.kvcache import Block, BlockAllocator, BlockTable, FreeBlockQueue, KVCacheManager


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_pops_in_id_order_and_free_returns_tail_first():
    alloc = BlockAllocator(6)
    a = alloc.allocate(3)
    assert ids(a) == [0, 1, 2]
    assert alloc.num_free == 3 and alloc.num_used == 3
    alloc.free(a)  # tail first: 2, 1, 0 appended after 3, 4, 5
    assert ids(alloc.free_blocks) == [3, 4, 5, 2, 1, 0]
    assert ids(alloc.allocate(4)) == [3, 4, 5, 2]


def test_allocation_is_all_or_nothing():
    alloc = BlockAllocator(2)
    with pytest.raises(MemoryError):
        alloc.allocate(3)
    assert alloc.num_free == 2


def test_incref_takes_a_free_block_out_of_the_queue_and_decref_puts_it_back():
    alloc = BlockAllocator(3)
    block = alloc.blocks[1]
    alloc.incref(block)
    assert block.ref_count == 1 and ids(alloc.free_blocks) == [0, 2]
    alloc.incref(block)
    alloc.decref(block)
    assert block.ref_count == 1 and alloc.num_free == 2
    alloc.decref(block)
    assert ids(alloc.free_blocks) == [0, 2, 1]
    with pytest.raises(ValueError, match="released more often"):
        alloc.decref(block)


def test_free_queue_remove_from_middle_and_popleft_empty():
    blocks = [Block(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    assert ids(queue) == [0, 2] and len(queue) == 2 and blocks[1] not in queue
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    assert queue.popleft() is blocks[0]
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_table_slots_follow_the_block_ids():
    alloc = BlockAllocator(8)
    table = BlockTable(block_size=4)
    assert table.blocks_needed(9) == 3
    blocks = alloc.allocate(3)
    alloc.free([blocks[0]])  # make the physical order differ from the logical one
    table.append_blocks([blocks[2], blocks[1]] + alloc.allocate(1), 9)
    assert table.block_ids == [2, 1, 3]
    assert table.slots(0, 9) == [8, 9, 10, 11, 4, 5, 6, 7, 12]
    assert table.slot(5) == 5
    assert table.blocks_needed(12) == 0 and table.blocks_needed(13) == 1


def test_manager_allocates_on_demand_and_frees_everything():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert kv.allocate_slots("a", 8)  # still 2
    assert kv.num_free_blocks == 2
    assert not kv.allocate_slots("b", 12)  # needs 3
    assert "b" not in kv.tables and kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 8)
    assert kv.stats()["usage"] == 1.0
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.free("missing")
    assert kv.num_free_blocks == 4
    kv.check_invariants()


def test_fragmentation_counts_reserved_but_unfilled_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 5)  # 2 blocks = 8 slots, 5 filled
    kv.allocate_slots("b", 4)  # 1 block, full
    stats = kv.stats()
    assert stats["fragmentation"] == pytest.approx(3 / 12)
    assert stats["num_used_blocks"] == 3
