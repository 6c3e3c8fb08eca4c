"""BlockAllocator: a fixed pool of KV blocks handed out by reference count.

The pool is created once (like a slab allocator); ``allocate`` pops the head of the free queue,
``decref`` returns a block to the tail when its last holder lets go. Invariants:
``num_free + num_used == num_blocks``; a block is free exactly when its ``ref_count`` is 0.
"""

from __future__ import annotations

from pagedllm.kvcache.block import Block, FreeBlockQueue


class BlockAllocator:
    """Pre-allocated pool of ``num_blocks`` blocks; O(1) allocate, incref and decref."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (all or none)."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            block.ref_count = 1
            out.append(block)
        return out

    def incref(self, block: Block) -> None:
        """Add a holder; a free block (ref 0) is taken out of the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        """Drop a holder; the last one returns the block to the tail of the free queue."""
        if block.ref_count <= 0:
            raise ValueError(f"{block} released more often than held")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue.append(block)

    def free(self, blocks: list[Block]) -> None:
        """Release a request's blocks tail first, so its last blocks are reused first."""
        for block in reversed(blocks):
            self.decref(block)
