"""PrefixCache: chained block hash -> the physical block holding those tokens' K/V.

Only full blocks are cached. An entry lives as long as its block is not reused for other content:
a freed block keeps its hash and can still be hit until the allocator hands it out again.
Invariant: ``map[h].block_hash == h`` for every entry.
"""

from __future__ import annotations

from pagedllm.kvcache.block import Block


class PrefixCache:
    def __init__(self) -> None:
        self.map: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self.map)

    def block_ids(self) -> list[int]:
        """The ids of the blocks it holds (in use or not)."""
        return [block.block_id for block in self.map.values()]

    def get(self, block_hash: int) -> Block | None:
        return self.map.get(block_hash)

    def insert(self, block_hash: int, block: Block) -> bool:
        """Cache ``block`` under ``block_hash``; False if another block already holds it."""
        if block_hash in self.map or block.block_hash is not None:
            return False
        self.map[block_hash] = block
        block.block_hash = block_hash
        return True

    def evict(self, block: Block) -> None:
        if block.block_hash is not None and self.map.get(block.block_hash) is block:
            del self.map[block.block_hash]
