"""KVCacheManager: the one facade between the scheduler and paged KV memory.

Owns, per request, a ``BlockTable`` plus the chained hashes of its full blocks, and composes the
parts that each do one job:
- ``BlockAllocator`` (``allocator``): the block pool; its eviction policy orders free blocks and
  picks preemption victims (``choose_victim``);
- ``PrefixCache`` (``prefix_cache``) keyed by ``BlockHasher`` (``hasher``) hashes;
- ``CopyOnWrite`` (``cow``): private copies of shared blocks before a write, queued for the runner;
- ``SwapSpace`` (``swap``, with ``host`` its host block pool), only with a host tier: swapped-out
  requests and the swap copies queued for the step.
The scheduler asks it for the cached prefix of a request (``cached_prefix``), to reserve slots
(``allocate_slots``), to register blocks that became full (``cache_full_blocks``), to fork, swap
and release requests; the runner gets the step's copies from ``take_copies`` and ``take_swaps``.
Its interface is ``KVCacheManagerProtocol`` (``interface.py``), shared with the contiguous baseline.

Invariants (``check_invariants``): free + used == total; a table holds exactly the blocks its
reserved slots need (a rollback, ``trim``, returns the rest); every block's ref count equals the
number of block tables holding it; every prefix-cache entry points at a block carrying its hash;
every host block is free, held by one swapped-out request, or released at the next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.block import Block
from pagedllm.kvcache.block_table import BlockTable
from pagedllm.kvcache.copy_on_write import CopyOnWrite
from pagedllm.kvcache.hashing import DEFAULT_HASH_ALGO, BlockHasher
from pagedllm.kvcache.host_pool import HostBlockPool
from pagedllm.kvcache.kv_events import KVEventLog
from pagedllm.kvcache.prefix_cache import PrefixCache
from pagedllm.kvcache.swap_space import SwapSpace


class KVCacheManager:
    """Paged KV memory: blocks reserved on demand, full blocks shared through the prefix cache."""

    layout = "paged"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru", num_host_blocks: int = 0,
                 hash_algo: str = DEFAULT_HASH_ALGO, hash_seed: int | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(hash_algo, hash_seed)
        self.allocator = BlockAllocator(num_blocks, eviction_policy)
        self.prefix_cache = PrefixCache()
        self.allocator.on_evict = self._evict
        self.events: KVEventLog | None = None  # KV-cache events (kv_events.py), recorded when set
        self.tables: dict[str, BlockTable] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # full blocks of a request already registered
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0     # of which were found cached
        self.cow = CopyOnWrite()
        self.swap = SwapSpace(num_host_blocks) if num_host_blocks else None

    @property
    def host(self) -> HostBlockPool | None:
        """The host tier's block pool (None without swap space)."""
        return self.swap.pool if self.swap is not None else None

    @property
    def num_cow_copies(self) -> int:
        return self.cow.num_copies

    @property
    def num_swapped_out_blocks(self) -> int:
        return self.swap.num_swapped_out_blocks if self.swap is not None else 0

    @property
    def num_swapped_in_blocks(self) -> int:
        return self.swap.num_swapped_in_blocks if self.swap is not None else 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_for_request(self, max_total_tokens: int) -> int:
        """Blocks a request of at most ``max_total_tokens`` tokens can come to hold."""
        return self.blocks_for_tokens(max_total_tokens)

    # -- prefix cache ----------------------------------------------------------------------------
    def block_hashes(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        hashes = self._hashes.setdefault(request_id, [])
        self.hasher.extend(hashes, token_ids, self.block_size, (salt or "").encode())
        return hashes

    def cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[Block]:
        """Blocks holding the longest cached prefix of full blocks (no side effects).

        At most ``(len(token_ids) - 1) // block_size`` blocks: one token is always computed, so the
        step that admits the request produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(request_id, token_ids, salt)
        out = []
        for h in hashes[: (len(token_ids) - 1) // self.block_size]:
            block = self.prefix_cache.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          salt: str | None = None) -> None:
        """Register blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[request_id]
        start = self._num_cached.get(request_id, 0)
        end = min(num_computed // self.block_size, len(table.blocks))
        if end <= start:
            return
        hashes = self.block_hashes(request_id, token_ids[: end * self.block_size], salt)
        stored = [i for i in range(start, end) if self.prefix_cache.insert(hashes[i], table.blocks[i])]
        self._num_cached[request_id] = end
        if self.events is not None and stored:
            self._record_stored(hashes, token_ids, stored)

    def _record_stored(self, hashes: list[int], token_ids: Sequence[int], stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive blocks newly cached (a block whose hash another
        block already holds is not stored again, and breaks the run)."""
        run: list[int] = []
        for i in [*stored, None]:
            if run and (i is None or i != run[-1] + 1):
                first, bs = run[0], self.block_size
                parent = self.hash_bytes(hashes[first - 1]) if first else None
                self.events.stored([self.hash_bytes(hashes[j]) for j in run], parent,
                                   list(token_ids[first * bs:(run[-1] + 1) * bs]), bs)
                run = []
            if i is not None:
                run.append(i)

    def hash_bytes(self, block_hash: int) -> bytes:
        """A block hash as the events carry it: its digest's bytes."""
        return block_hash.to_bytes(self.hasher.digest_bits // 8, "little")

    def cached_block_hashes(self) -> set[bytes]:
        """Every block hash the prefix cache holds, as the events carry them (what a subscriber's
        replay of the events must equal)."""
        return {self.hash_bytes(h) for h in self.prefix_cache.map}

    def _evict(self, block: Block) -> None:
        """The allocator reuses a cached block: its entry leaves the prefix cache."""
        if self.events is not None and self.prefix_cache.get(block.block_hash) is block:
            self.events.removed(self.hash_bytes(block.block_hash))
        self.prefix_cache.evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, and nothing done, while
        any block is in use (a running request's blocks cannot be dropped from under it)."""
        if self.allocator.num_used:
            return False
        for block in self.prefix_cache.map.values():
            block.block_hash = None
        self.prefix_cache.map.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    # -- allocation -------------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_slots: int, cached: Sequence[Block] = (),
                       max_total_tokens: int | None = None, num_computed: int | None = None) -> bool:
        """Make the request's table cover ``num_slots`` slots, starting from ``cached`` blocks for a
        request that holds none yet. False (and nothing changed) if the pool cannot supply them.

        ``num_computed``: the first position this step writes. If it falls inside a block that
        other sequences share (after a fork), that block is copied first (copy-on-write).
        """
        table = self.tables.get(request_id)
        if cached and table is not None and table.blocks:
            raise ValueError("cached prefix blocks can only start a request's block table")
        held = len(table.blocks) if table is not None else 0
        need = max(0, self.blocks_for_tokens(num_slots) - held - len(cached))
        reclaimed = sum(1 for b in cached if b.ref_count == 0)  # free blocks a hit takes back
        cow = self.cow.shared_block_written(table, num_computed) if table is not None else None
        if need + reclaimed + (cow is not None) > self.allocator.num_free:
            return False
        if table is None:
            table = self.tables[request_id] = BlockTable(self.block_size)
        for block in cached:
            self.allocator.touch(block)
        if cached:
            table.append_blocks(list(cached), len(cached) * self.block_size)
            self._num_cached[request_id] = len(cached)
        if cow is not None:
            self.cow.copy_block(table, cow, self.allocator)
        table.append_blocks(self.allocator.allocate(need), num_slots)
        return True

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> bool:
        """Give ``child_id`` the parent's blocks (shared, ref counted) for its first ``num_computed``
        tokens. Shared blocks are copied only when one of the sequences writes into them."""
        parent = self.tables[parent_id]
        child = self.tables[child_id] = BlockTable(self.block_size)
        child.append_blocks(list(parent.blocks), parent.num_slots)
        for block in child.blocks:
            self.allocator.incref(block)
        full = num_computed // self.block_size
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), full)
        self._hashes[child_id] = self._hashes.get(parent_id, [])[:full]
        return True

    def trim(self, request_id: str, num_slots: int) -> None:
        """Roll the request's table back to its first ``num_slots`` slots (speculative decoding: the
        slots of guesses the model rejected): blocks wholly past them return to the pool. They were
        never in the prefix cache: only blocks full of verified tokens are registered."""
        table = self.tables.get(request_id)
        if table is None or num_slots >= table.num_slots:
            return
        dropped = table.truncate(self.blocks_for_tokens(num_slots))
        table.num_slots = num_slots
        if dropped:
            assert all(b.block_hash is None for b in dropped), "a rolled-back block was in the prefix cache"
            self.allocator.free(dropped)

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) the data plane must perform before this step's writes."""
        return self.cow.take()

    # -- swap -------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Host blocks read by the previous step's copy-in are free again (the runner waits for
        that copy before it starts the next one)."""
        if self.swap is not None:
            self.swap.begin_step()

    def swap_out(self, request_id: str) -> bool:
        """Move a request's KV to the host tier and free its device blocks. False if the host
        tier is absent or full (the caller then falls back to recompute)."""
        table = self.tables.get(request_id)
        if self.swap is None or table is None or not self.swap.swap_out(request_id, table.block_ids):
            return False
        self.free(request_id, keep_hashes=True, keep_host=True)
        return True

    def swap_in(self, request_id: str, num_slots: int) -> bool:
        """Give a swapped-out request fresh device blocks for its ``num_slots`` computed slots and
        schedule the copy back. False (nothing changed) if the device pool cannot hold them."""
        if self.swap is None or not self.swap.is_swapped_out(request_id):
            raise KeyError(f"request {request_id!r} is not swapped out")
        if not self.allocate_slots(request_id, num_slots):
            return False
        self.swap.swap_in(request_id, self.block_ids(request_id))
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(device->host, host->device) block copies decided since the last call."""
        return self.swap.take() if self.swap is not None else ([], [])

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables[request_id].block_ids

    def free(self, request_id: str, keep_hashes: bool = False, keep_host: bool = False) -> None:
        """Release every block of a request (no-op if it holds none). Cached blocks keep their
        hash and stay hittable until reused. ``keep_hashes`` for a request that will come back;
        ``keep_host`` keeps its swapped-out copy."""
        if not keep_host and self.swap is not None:
            self.swap.drop(request_id)
        table = self.tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if not keep_hashes:
            self._hashes.pop(request_id, None)
        if table is not None:
            self.allocator.free(table.blocks)

    def choose_victim(self, request_ids: Sequence[str]) -> int:
        """Index (into ``request_ids``, oldest first) of the request to preempt: the eviction
        policy's ``victim_index`` over the blocks each request holds (``lru``: the newest)."""
        candidates = [self.tables[rid].blocks if rid in self.tables else [] for rid in request_ids]
        return self.allocator.free_blocks.victim_index(candidates)

    def record_preemption(self) -> None:
        self.num_preemptions += 1

    # -- stats ------------------------------------------------------------------------------------
    def cached_block_ids(self) -> list[int]:
        return self.prefix_cache.block_ids()

    def stats(self) -> dict[str, float | int]:
        total = self.num_blocks
        free = self.num_free_blocks
        reserved = sum(len(t.blocks) for t in self.tables.values()) * self.block_size
        filled = sum(t.num_slots for t in self.tables.values())
        shared = {b.block_id for t in self.tables.values() for b in t.blocks if b.ref_count > 1}
        idle_cached = sum(1 for b in self.prefix_cache.map.values() if b.ref_count == 0)
        return {
            "kv_layout": self.layout,
            "num_blocks": total,
            "block_size": self.block_size,
            "num_free_blocks": free,
            "num_used_blocks": total - free,
            "usage": 1.0 - free / total,
            "fragmentation": (reserved - filled) / reserved if reserved else 0.0,
            "num_cached_blocks": len(self.prefix_cache),
            "num_idle_cached_blocks": idle_cached,  # cached and held by no request: evictable
            "num_shared_blocks": len(shared),       # held by more than one request
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_evictions": self.allocator.num_evictions,
            "num_cow_copies": self.num_cow_copies,
            "num_swapped_out_blocks": self.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.num_swapped_in_blocks,
            "num_host_blocks": self.host.num_blocks if self.host else 0,
            "num_free_host_blocks": self.host.num_free if self.host else 0,
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
            assert (block.ref_count == 0) == (block in alloc.free_blocks), f"{block} free-set mismatch"
        for h, block in self.prefix_cache.map.items():
            assert block.block_hash == h, f"cache entry {h:x} points at {block} with another hash"
        for t in self.tables.values():
            assert len(t.blocks) == self.blocks_for_tokens(t.num_slots), "a table holds blocks past its slots"
            assert t.block_ids == [b.block_id for b in t.blocks], "a table's cached ids differ from its blocks"
        if self.swap is not None:
            self.swap.check_invariants()
