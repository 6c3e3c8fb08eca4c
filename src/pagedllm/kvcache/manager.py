"""KVCacheManager: the one facade between the scheduler and KV memory.

Owns the ``BlockAllocator`` and one ``BlockTable`` per request. The scheduler asks it to reserve
slots (``allocate_slots``), to release a request (``free``) and for block ids to hand to the
model runner. Invariants (checked by ``check_invariants``): free + used == total; every block's
ref count equals the number of block tables holding it.
"""

from __future__ import annotations

from collections import Counter

from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.block_table import BlockTable


class KVCacheManager:
    """Paged KV memory: blocks are reserved on demand, a block at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[str, BlockTable] = {}
        self.num_preemptions = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_slots: int) -> bool:
        """Make the request's table cover ``num_slots`` token slots. False if blocks run out."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = BlockTable(self.block_size)
        need = table.blocks_needed(num_slots)
        if need > self.allocator.num_free:
            if not table.blocks:
                del self.tables[request_id]
            return False
        table.append_blocks(self.allocator.allocate(need), num_slots)
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables[request_id].block_ids

    def free(self, request_id: str) -> None:
        """Release every block of a request (no-op if it holds none)."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.allocator.free(table.blocks)

    def record_preemption(self) -> None:
        self.num_preemptions += 1

    def stats(self) -> dict[str, float | int]:
        total = self.num_blocks
        free = self.num_free_blocks
        reserved = sum(len(t.blocks) for t in self.tables.values()) * self.block_size
        filled = sum(t.num_slots for t in self.tables.values())
        return {
            "num_blocks": total,
            "block_size": self.block_size,
            "num_free_blocks": free,
            "num_used_blocks": total - free,
            "usage": 1.0 - free / total,
            "fragmentation": (reserved - filled) / reserved if reserved else 0.0,
            "num_preemptions": self.num_preemptions,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's accounting is inconsistent."""
        alloc = self.allocator
        assert alloc.num_free + alloc.num_used == alloc.num_blocks
        holders = Counter(b.block_id for t in self.tables.values() for b in t.blocks)
        for block in alloc.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} != holders "
                f"{holders.get(block.block_id, 0)}")
            assert (block.ref_count == 0) == (block in alloc.free_queue), f"{block} free-queue mismatch"
        for t in self.tables.values():
            assert len(t.blocks) * self.block_size >= t.num_slots
