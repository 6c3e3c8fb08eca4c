"""Block placement experiments for the simulator: merging adjacent blocks, and a reserve of large blocks.

The paged kernel reads a sequence's K/V block by block through its table. When consecutive
entries are physically adjacent (ids k, k + 1, ...) the reads form one longer stretch, which the
CPU's prefetchers follow (``pagedllm bench attention --block-order shuffled,adjacent`` measures
what that is worth to the kernel). Two placements that make such runs, built on the engine's own
``KVCacheManager`` and ``BlockAllocator`` (subclasses; the engine's classes are unchanged):

- ``adjacent`` (merging): a growing sequence takes the block right after its last one when that
  block is free and caches nothing, else the eviction policy's choice as usual.
- ``reserve`` (a reserve pool of large blocks): ``reserve_share`` of the pool is held back in
  aligned runs of ``run_blocks`` blocks (a large block of ``run_blocks x B`` tokens); a sequence
  already holding ``threshold_blocks`` blocks (a long burst) takes its next blocks a whole run at
  a time from the reserve while one is free. Reserve blocks are never shared through the prefix
  cache (their hashes are dropped), and the scheduler does not count them as free: short
  requests cannot use them, which is the reserve's cost.

``run_stats(kv)`` gives the blocks held and the physical runs they form (blocks per run: 1 when
no two consecutive entries are adjacent). ``compare_placements`` replays one trace with each.
"""

from __future__ import annotations

from collections import deque

from pagedllm.config import CacheConfig
from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.manager import KVCacheManager
from pagedllm.sim.simulator import simulate

PLACEMENTS = ("policy", "adjacent", "reserve")


def run_stats(kv) -> tuple[int, int]:
    """(blocks held, physical runs) over every sequence's table."""
    blocks = runs = 0
    for table in kv.tables.values():
        ids = table.block_ids
        if not ids:
            continue
        blocks += len(ids)
        runs += 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1)
    return blocks, runs


class AdjacentAllocator(BlockAllocator):
    """Hands out the block after ``hint`` when it is free and caches nothing."""

    def __init__(self, num_blocks: int, eviction_policy: str = "lru") -> None:
        super().__init__(num_blocks, eviction_policy)
        self.hint: int | None = None

    def allocate(self, n: int) -> list:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, only {self.num_free} free")
        out = []
        while len(out) < n:
            after = out[-1].block_id if out else self.hint
            block = self.blocks[after + 1] if after is not None and after + 1 < len(self.blocks) else None
            if block is not None and block.ref_count == 0 and block.block_hash is None:  # free, caching nothing
                self.free_blocks.remove(block)
                block.uses = 0
                block.ref_count = 1
                self._record_use(block)
                out.append(block)
            else:
                out += super().allocate(1)
        return out


class AdjacentKVManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru") -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, eviction_policy)
        self.allocator = AdjacentAllocator(num_blocks, eviction_policy)
        self.allocator.on_evict = self.prefix_cache.evict

    def allocate_slots(self, request_id, num_slots, cached=(), max_total_tokens=None, num_computed=None) -> bool:
        table = self.tables.get(request_id)
        last = table.block_ids[-1] if table is not None and table.blocks else None
        self.allocator.hint = cached[-1].block_id if cached else last
        return super().allocate_slots(request_id, num_slots, cached, max_total_tokens, num_computed)


class ReserveKVManager(KVCacheManager):
    """The last ``reserve_share`` of the pool, in aligned runs of ``run_blocks``, kept for long sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru", reserve_share: float = 0.25, run_blocks: int = 4,
                 threshold_blocks: int = 8) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, eviction_policy)
        runs = int(reserve_share * num_blocks) // run_blocks
        self.reserve_start = num_blocks - runs * run_blocks
        self.run_blocks, self.threshold_blocks = run_blocks, threshold_blocks
        for block in self.allocator.blocks[self.reserve_start:]:  # out of the ordinary free set
            self.allocator.free_blocks.remove(block)
        self.free_runs = deque(range(self.reserve_start, num_blocks, run_blocks))
        self.runs_taken = 0

    def _is_reserve(self, block) -> bool:
        return block.block_id >= self.reserve_start

    @property
    def num_free_blocks(self) -> int:  # the ordinary pool only: the reserve is not for admission
        return self.allocator.num_free

    def allocate_slots(self, request_id, num_slots, cached=(), max_total_tokens=None, num_computed=None) -> bool:
        table = self.tables.get(request_id)
        if table is not None and len(table.blocks) >= self.threshold_blocks and self.free_runs:
            need = self.blocks_for_tokens(num_slots) - len(table.blocks)
            if 0 < need <= self.run_blocks:
                start = self.free_runs.popleft()
                blocks = self.allocator.blocks[start:start + self.run_blocks]
                for block in blocks:
                    block.ref_count, block.uses = 1, 1
                table.append_blocks(blocks, num_slots)
                self.runs_taken += 1
                return True
        return super().allocate_slots(request_id, num_slots, cached, max_total_tokens, num_computed)

    def cache_full_blocks(self, request_id, token_ids, num_computed, salt=None) -> None:
        super().cache_full_blocks(request_id, token_ids, num_computed, salt)
        for block in self.tables[request_id].blocks if request_id in self.tables else []:
            if self._is_reserve(block) and block.block_hash is not None:
                self.prefix_cache.evict(block)
                block.block_hash = None

    def free(self, request_id: str, keep_hashes: bool = False, keep_host: bool = False) -> None:
        table = self.tables.get(request_id)
        if table is not None:
            reserve = [b for b in table.blocks if self._is_reserve(b)]
            if reserve:
                table.blocks[:] = [b for b in table.blocks if not self._is_reserve(b)]
                table._ids[:] = [b.block_id for b in table.blocks]
                for block in reserve:
                    block.ref_count = 0
                for start in sorted({b.block_id - (b.block_id - self.reserve_start) % self.run_blocks
                                     for b in reserve}):
                    self.free_runs.append(start)
        super().free(request_id, keep_hashes, keep_host)

    def stats(self) -> dict:
        st = super().stats()
        used_reserve = (self.num_blocks - self.reserve_start) - len(self.free_runs) * self.run_blocks
        st["num_used_blocks"] = st["num_used_blocks"] - (self.num_blocks - self.reserve_start) + used_reserve
        st["num_free_blocks"] = self.num_blocks - st["num_used_blocks"]
        return st


def make_manager(placement: str, cache: CacheConfig, num_blocks: int, **reserve_options):
    if placement == "adjacent":
        return AdjacentKVManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.eviction_policy)
    if placement == "reserve":
        return ReserveKVManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.eviction_policy,
                                **reserve_options)
    if placement == "policy":
        return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.eviction_policy)
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def compare_placements(trace, timing, cache: CacheConfig, sched, num_blocks: int, sample_every: int = 8,
                       **reserve_options) -> dict:
    """One replay per placement: the run's summary plus blocks per physical run (the mean over
    sampled steps of blocks held / runs: how long the stretches the kernel reads are)."""
    out = {}
    for placement in PLACEMENTS:
        samples, steps = [], [0]

        def on_step(kv, samples=samples, steps=steps):
            steps[0] += 1
            if steps[0] % sample_every == 0:
                blocks, runs = run_stats(kv)
                if runs:
                    samples.append(blocks / runs)

        res = simulate(trace, timing, cache, sched, num_blocks, on_step=on_step,
                       kv_factory=lambda c, n, m, p=placement: make_manager(p, c, n, **reserve_options))
        out[placement] = {**res.summary(), "blocks_per_run": round(sum(samples) / len(samples), 3) if samples else 0}
    return out
