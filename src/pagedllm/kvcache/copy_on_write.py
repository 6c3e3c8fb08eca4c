"""CopyOnWrite: block copies the data plane must run before a step's writes, and their count.

After a fork, sequences share blocks by reference count. A sequence about to write into a shared
block (its partly filled last block) first gets a private copy: a fresh block replaces the shared
one in its table, the shared block loses one holder, and ``(src, dst)`` is queued for the runner,
which copies whole blocks before any of the step's K/V writes. ``take`` hands the queue over once
per step. Invariants: a block is copied only while more than one table holds it; ``num_copies``
counts every copy ever queued (``add`` also takes the contiguous layout's eager fork copies).
"""

from __future__ import annotations

from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.block_table import BlockTable


class CopyOnWrite:
    """Pending ``(src, dst)`` block copies and the number of copies made so far."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, int]] = []
        self.num_copies = 0

    @staticmethod
    def shared_block_written(table: BlockTable, num_computed: int | None) -> int | None:
        """Index of the shared block that writing from position ``num_computed`` on starts in, or
        None if that position starts a block (nothing to preserve) or the block is not shared."""
        if num_computed is None or num_computed % table.block_size == 0:
            return None
        index = num_computed // table.block_size
        if index < len(table.blocks) and table.blocks[index].ref_count > 1:
            return index
        return None

    def copy_block(self, table: BlockTable, index: int, allocator: BlockAllocator) -> None:
        """Give ``table`` a private copy of its shared block ``index`` (one free block needed)."""
        shared = table.blocks[index]
        (copy,) = allocator.allocate(1)
        table.replace(index, copy)
        allocator.decref(shared)
        self.add(shared.block_id, copy.block_id)

    def add(self, src: int, dst: int) -> None:
        """Queue a copy of block ``src`` into block ``dst``."""
        self._pending.append((src, dst))
        self.num_copies += 1

    def take(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, in order."""
        copies, self._pending = self._pending, []
        return copies
