"""Eviction policies: the order in which free blocks are reused (and their cached content lost).

A block is free when no request holds it (ref count 0). A free block may still carry a prefix
cache entry; handing it out evicts that entry. Each policy keeps the free blocks and answers
``pop()`` (next block to reuse), ``push(block)`` (a block became free) and ``remove(block)`` (a free
block was taken back by a cache hit). All are O(1) (``lru``) or O(log n) (heap-based).

- ``lru`` (default, vLLM's): a FIFO of frees; a request's blocks are freed tail first, so the end
  of a chain is evicted before its beginning.
- ``lfu``: fewest uses first (uses = allocations + cache hits), ties to the least recent.
- ``lru-lfu``: LRFU (Lee et al.): each block's combined recency-frequency value
  ``CRF = sum over uses of 2^(-lambda * age)``, lowest first; ``lambda`` 0 is LFU, 1 is close to LRU.
- ``size-weighted``: GreedyDual-Size-Frequency: priority ``L + uses / size`` where ``size`` is how many
  blocks the owning sequence held when it freed this one and ``L`` rises to each evicted priority
  (ageing); prefers freeing large, rarely used entries.
Non-LRU policies hand out blocks that cache nothing before any cached block.

Each policy also picks preemption victims (``victim_index``): among candidate requests (oldest
first, each given as the blocks it holds) the one whose blocks the policy values least. ``lru``:
the newest (vLLM's choice: least work lost); ``lfu``: lowest mean uses; ``lru-lfu``: lowest mean
LRFU value (``crf``); ``size-weighted``: lowest mean uses / blocks held (large, rarely used).
Ties go to the newest; a request holding no blocks scores +inf (preempting it frees nothing).

Heap policies remove lazily: ``remove`` and re-``push`` leave the old heap entry behind, skipped
when it surfaces. Invariant: the heap holds at most ``2 * live + COMPACT_SLACK`` entries; when
stale entries pass that, the heap is rebuilt from its live entries (the same tuples, so the pop
order does not change), which costs O(1) amortized per operation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from pagedllm.config import EVICTION_POLICIES as POLICIES
from pagedllm.kvcache.block import Block, FreeBlockQueue

LRFU_LAMBDA = 0.5  # LRFU decay per clock tick: 0 = LFU, 1 ~ LRU
COMPACT_SLACK = 16  # stale heap entries tolerated on top of twice the live ones


class EvictionPolicy(Protocol):
    """The free blocks, in reuse order, and the choice of preemption victims."""

    name: str

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Block]: ...
    def __contains__(self, block: Block) -> bool: ...

    def push(self, block: Block) -> None:
        """``block`` became free."""

    def remove(self, block: Block) -> None:
        """A free ``block`` was taken back (a prefix-cache hit)."""

    def pop(self) -> Block:
        """Take the next block to reuse; IndexError if none is free."""

    def victim_index(self, candidates: Sequence[Sequence[Block]]) -> int:
        """Index of the candidate (oldest first; each the blocks one request holds) to preempt."""


def lowest_score_newest_first(candidates: Sequence[Sequence[Block]],
                              score: Callable[[Sequence[Block]], float]) -> int:
    """Index of the lowest ``score(blocks)``, ties to the newest (last); no blocks score +inf."""
    scores = [score(blocks) if blocks else math.inf for blocks in candidates]
    best = min(scores)
    return max(i for i, sc in enumerate(scores) if sc == best)


class LRUPolicy:
    name = "lru"

    def __init__(self, blocks: list[Block]) -> None:
        self.queue = FreeBlockQueue(blocks)

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.queue)

    def __contains__(self, block: Block) -> bool:
        return block in self.queue

    def push(self, block: Block) -> None:
        self.queue.append(block)

    def remove(self, block: Block) -> None:
        self.queue.remove(block)

    def pop(self) -> Block:
        return self.queue.popleft()

    def victim_index(self, candidates: Sequence[Sequence[Block]]) -> int:
        return len(candidates) - 1


class _HeapPolicy:
    """Free blocks in a min-heap of ``key(block)``; stale entries are skipped lazily."""

    name = "heap"

    def __init__(self, blocks: list[Block]) -> None:
        self._heap: list[tuple] = []
        self._entry: dict[int, int] = {}  # block id -> live entry number
        self._counter = itertools.count()
        self.num_compactions = 0
        for b in blocks:
            self.push(b)

    def key(self, block: Block) -> tuple:
        raise NotImplementedError

    def victim_score(self, blocks: Sequence[Block]) -> float:
        """How much the policy values a request's (non-empty) blocks: the lowest is preempted."""
        raise NotImplementedError

    def victim_index(self, candidates: Sequence[Sequence[Block]]) -> int:
        return lowest_score_newest_first(candidates, self.victim_score)

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block: Block) -> bool:
        return block.block_id in self._entry

    def __iter__(self) -> Iterator[Block]:
        return iter([e[-1] for e in sorted(e for e in self._heap if self._is_live(e))])

    def _is_live(self, entry: tuple) -> bool:
        return self._entry.get(entry[-1].block_id) == entry[-2]

    def _maybe_compact(self) -> None:
        """Drop stale entries once they outnumber the live ones (plus a slack). The live entries
        keep their tuples, so the heap pops them in exactly the same order as before."""
        if len(self._heap) > 2 * len(self._entry) + COMPACT_SLACK:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
            self.num_compactions += 1

    def push(self, block: Block) -> None:
        n = next(self._counter)
        self._entry[block.block_id] = n
        empty = 0 if block.block_hash is None else 1
        heapq.heappush(self._heap, (empty, *self.key(block), n, block))
        self._maybe_compact()

    def remove(self, block: Block) -> None:
        if self._entry.pop(block.block_id, None) is None:
            raise ValueError(f"{block} is not free")
        self._maybe_compact()

    def pop(self) -> Block:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):
                block = entry[-1]
                del self._entry[block.block_id]
                self.on_evict(entry)
                self._maybe_compact()
                return block
        raise IndexError("no free blocks")

    def on_evict(self, entry: tuple) -> None:
        pass


class LFUPolicy(_HeapPolicy):
    name = "lfu"

    def key(self, block: Block) -> tuple:
        return (block.uses, block.last_use)

    def victim_score(self, blocks: Sequence[Block]) -> float:
        return sum(b.uses for b in blocks) / len(blocks)


class LRFUPolicy(_HeapPolicy):
    """Combined recency-frequency; ``lam`` in [0, 1]."""

    name = "lru-lfu"

    def __init__(self, blocks: list[Block], lam: float = LRFU_LAMBDA) -> None:
        self.lam = lam
        super().__init__(blocks)

    def key(self, block: Block) -> tuple:
        # log2 CRF(now) = log2 CRF(last) - lam * (now - last): compare log2 CRF(last) + lam * last
        return (math.log2(max(block.crf, 1e-300)) + self.lam * block.last_use, block.last_use)

    def victim_score(self, blocks: Sequence[Block]) -> float:
        return sum(b.crf for b in blocks) / len(blocks)


class SizeWeightedPolicy(_HeapPolicy):
    """GreedyDual-Size-Frequency over blocks."""

    name = "size-weighted"

    def __init__(self, blocks: list[Block]) -> None:
        self.inflation = 0.0
        super().__init__(blocks)

    def key(self, block: Block) -> tuple:
        return (self.inflation + block.uses / max(1, block.owner_size), block.last_use)

    def victim_score(self, blocks: Sequence[Block]) -> float:
        return sum(b.uses for b in blocks) / len(blocks) / len(blocks)

    def on_evict(self, entry: tuple) -> None:
        if entry[0] == 1:  # only evicting cached content ages the cache
            self.inflation = max(self.inflation, entry[1])


def make_policy(name: str, blocks: list[Block]) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(blocks)
    if name == "lfu":
        return LFUPolicy(blocks)
    if name == "lru-lfu":
        return LRFUPolicy(blocks)
    if name == "size-weighted":
        return SizeWeightedPolicy(blocks)
    raise ValueError(f"eviction_policy must be one of {POLICIES}, got {name!r}")
