"""BlockAllocator: a fixed pool of KV blocks handed out by reference count.

The pool is created once (like a slab allocator). Free blocks live in an eviction policy
(``eviction.py``) that decides which one is reused next; a free block may still hold a prefix
cache entry, which ``on_evict`` drops when the block is handed out again. Invariants:
``num_free + num_used == num_blocks``; a block is free exactly when its ``ref_count`` is 0.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.kvcache.block import Block
from pagedllm.kvcache.eviction import LRFU_LAMBDA, EvictionPolicy, make_policy


class BlockAllocator:
    """Pre-allocated pool of ``num_blocks`` blocks; allocate, touch (cache hit), incref, decref."""

    def __init__(self, num_blocks: int, eviction_policy: str = "lru") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: EvictionPolicy = make_policy(eviction_policy, self.blocks)
        self.clock = 0
        self.on_evict: Callable[[Block], None] | None = None
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _record_use(self, block: Block) -> None:
        self.clock += 1
        if block.uses:
            block.crf = block.crf * 2.0 ** (-LRFU_LAMBDA * (self.clock - block.last_use)) + 1.0
        else:
            block.crf = 1.0
        block.uses += 1
        block.last_use = self.clock

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks in the policy's order (all or none), evicting their cached content."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_blocks.pop()
            if block.block_hash is not None:
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block)
                block.block_hash = None
            block.uses = 0
            block.ref_count = 1
            self._record_use(block)
            out.append(block)
        return out

    def touch(self, block: Block) -> None:
        """A prefix-cache hit: one more holder, and a use for the eviction policy."""
        self.incref(block)
        self._record_use(block)

    def incref(self, block: Block) -> None:
        """Add a holder; a free block (ref 0) is taken out of the free set."""
        if block.ref_count == 0:
            self.free_blocks.remove(block)
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        """Drop a holder; the last one returns the block to the free set."""
        if block.ref_count <= 0:
            raise ValueError(f"{block} released more often than held")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.push(block)

    def free(self, blocks: list[Block]) -> None:
        """Release a sequence's blocks tail first, so its last blocks are reused first."""
        for block in reversed(blocks):
            block.owner_size = len(blocks)
            self.decref(block)
