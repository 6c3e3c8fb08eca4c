"""SwapSpace and CopyOnWrite alone: exact queued copies, host blocks released one step late."""

from __future__ import annotations

import pytest

from pagedllm.kvcache import BlockAllocator, BlockTable
from pagedllm.kvcache.copy_on_write import CopyOnWrite
from pagedllm.kvcache.swap_space import SwapSpace


def test_swap_out_and_in_queue_exact_copies_and_release_host_blocks_a_step_later():
    swap = SwapSpace(4)
    assert swap.swap_out("a", [7, 3])
    assert not swap.swap_out("b", [1, 2, 5])  # 2 host blocks left: nothing changes
    assert swap.take() == ([(7, 0), (3, 1)], [])
    assert swap.pool.num_free == 2 and swap.is_swapped_out("a") and not swap.is_swapped_out("b")
    swap.swap_in("a", [5, 6])
    assert swap.take() == ([], [(0, 5), (1, 6)])
    assert swap.pool.num_free == 2  # the copy-in may still be reading them during this step
    swap.check_invariants()
    swap.begin_step()
    assert swap.pool.num_free == 4 and swap.num_swapped_out_blocks == swap.num_swapped_in_blocks == 2
    swap.check_invariants()


def test_dropping_a_swapped_out_request_frees_its_host_blocks_at_the_next_step():
    swap = SwapSpace(2)
    assert swap.swap_out("a", [0, 1])
    swap.drop("a")
    swap.drop("a")  # idempotent
    assert swap.pool.num_free == 0 and not swap.is_swapped_out("a")
    swap.begin_step()
    assert swap.pool.num_free == 2
    with pytest.raises(KeyError):
        swap.swap_in("a", [0, 1])


def test_copy_on_write_copies_only_a_shared_partly_written_block():
    alloc = BlockAllocator(4)
    parent, child = BlockTable(4), BlockTable(4)
    parent.append_blocks(alloc.allocate(2), 6)
    child.append_blocks(list(parent.blocks), 6)
    for b in child.blocks:
        alloc.incref(b)
    cow = CopyOnWrite()
    assert cow.shared_block_written(child, 4) is None   # writing starts a fresh block
    assert cow.shared_block_written(child, None) is None
    assert cow.shared_block_written(child, 6) == 1      # position 6 is inside shared block 1
    cow.copy_block(child, 1, alloc)
    assert child.block_ids == [0, 2] and parent.block_ids == [0, 1]
    assert [b.ref_count for b in alloc.blocks] == [2, 1, 1, 0]
    assert cow.shared_block_written(parent, 6) is None  # block 1 is the parent's alone now
    assert cow.take() == [(1, 2)] and cow.take() == [] and cow.num_copies == 1
