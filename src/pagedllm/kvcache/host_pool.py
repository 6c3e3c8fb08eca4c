"""HostBlockPool: ids of the host-tier (CPU) blocks that hold swapped-out KV.

Plain bookkeeping, no tensors: ``kvstore.host_tier.HostTier`` owns the memory. Invariant:
free + used == total; a block id is never handed out twice.
"""

from __future__ import annotations


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))
        assert len(self._free) <= self.num_blocks and len(set(self._free)) == len(self._free)
