"""BlockTable: one request's map from logical block index to physical block.

Token at position ``p`` lives in ``blocks[p // block_size]`` at offset ``p % block_size``; its
slot in the flattened KV tensors is ``block_id * block_size + offset``.
Invariant: ``len(blocks) * block_size >= num_slots`` (capacity covers every reserved slot).
"""

from __future__ import annotations

from pagedllm.kvcache.block import Block


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The KV slots of positions ``start..end-1`` of a sequence holding ``block_ids``: the one rule
    (``block_id * block_size + offset``) that the tables and the model runner's metadata share."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockTable:
    """Logical -> physical block ids of one request, and its number of reserved slots."""

    __slots__ = ("block_size", "blocks", "num_slots", "_ids")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[Block] = []  # change only through append_blocks / replace (ids are kept beside)
        self.num_slots = 0
        self._ids: list[int] = []

    @property
    def block_ids(self) -> list[int]:
        """A copy (the scheduler hands it out every step: a list copy, not a walk over the blocks)."""
        return self._ids.copy()

    def replace(self, index: int, block: Block) -> None:
        """Logical block ``index`` now maps to ``block`` (copy on write)."""
        self.blocks[index] = block
        self._ids[index] = block.block_id

    def blocks_needed(self, num_slots: int) -> int:
        """How many more blocks reserving ``num_slots`` slots in total would take."""
        return max(0, -(-num_slots // self.block_size) - len(self.blocks))

    def append_blocks(self, blocks: list[Block], num_slots: int) -> None:
        self.blocks.extend(blocks)
        self._ids.extend(b.block_id for b in blocks)
        self.num_slots = max(self.num_slots, num_slots)
        assert len(self.blocks) * self.block_size >= self.num_slots

    def truncate(self, num_blocks: int) -> list[Block]:
        """Keep the first ``num_blocks`` blocks; returns the ones dropped (the caller frees them)."""
        dropped = self.blocks[num_blocks:]
        del self.blocks[num_blocks:]
        del self._ids[num_blocks:]
        self.num_slots = min(self.num_slots, num_blocks * self.block_size)
        return dropped

    def slot(self, position: int) -> int:
        block = self.blocks[position // self.block_size]
        return block.block_id * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1``."""
        return slot_mapping(self._ids, self.block_size, start, end)
