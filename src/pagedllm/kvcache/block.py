"""One KV block's bookkeeping, and the intrusive doubly linked queue of free blocks.

A ``Block`` is a handle on a fixed slice of the pre-allocated KV tensors: ``block_size`` token
slots per layer. ``FreeBlockQueue`` keeps the free blocks in the order they should be reused
(its head is reused first): O(1) ``popleft``, ``append`` and ``remove`` from the middle, with no
allocation, because the links live inside the blocks themselves.
Invariant: a block is in the queue exactly when its ``ref_count`` is 0.
"""

from __future__ import annotations

from collections.abc import Iterator


class Block:
    """Bookkeeping of one physical KV block."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free", "uses", "last_use", "crf",
                 "owner_size")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # usage history, read by the eviction policies
        self.uses = 0          # allocations + prefix-cache hits
        self.last_use = 0      # allocator clock at the latest use
        self.crf = 0.0         # LRFU combined recency-frequency value as of last_use
        self.owner_size = 1    # blocks held by the sequence that last freed it
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel ends; head = next to be reused."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free
