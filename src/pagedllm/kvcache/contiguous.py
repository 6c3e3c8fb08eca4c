"""ContiguousKVCacheManager: the "traditional" baseline that PagedAttention replaced.

Each request reserves one contiguous run of slots up front, sized for the longest it could get
(``max_model_len`` tokens, or with ``reservation="request"`` its own prompt + max_tokens), on
the same block pool and block-table interface as the paged manager, so the engine, kernels and
benchmarks are unchanged: only this object differs. Runs are placed first-fit, so the pool also
suffers external fragmentation (free slots scattered between runs). No prefix sharing, no swap;
a fork copies the parent's blocks into its own run at once (``CopyOnWrite.add``). Implements
``KVCacheManagerProtocol`` (``interface.py``). Invariants: runs never overlap; free + reserved == total.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.config import RESERVATIONS
from pagedllm.kvcache.block import Block
from pagedllm.kvcache.block_table import BlockTable
from pagedllm.kvcache.copy_on_write import CopyOnWrite


class ContiguousKVCacheManager:
    """One contiguous max-length reservation per request, placed first-fit."""

    events = None  # no prefix cache, so no KV-cache events (kv_events.py)

    layout = "contiguous"
    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 reservation: str = "max_model_len") -> None:
        if reservation not in RESERVATIONS:
            raise ValueError(f"contiguous reservation must be one of {RESERVATIONS}, got {reservation!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reservation = reservation
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.used = bytearray(num_blocks)  # 1 where a block belongs to some reservation
        self.tables: dict[str, BlockTable] = {}
        self.num_preemptions = 0
        self.num_admission_stalls = 0  # a reservation found no contiguous run
        self.cow = CopyOnWrite()

    @property
    def num_cow_copies(self) -> int:
        return self.cow.num_copies

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - sum(self.used)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_for_request(self, max_total_tokens: int) -> int:
        tokens = self.max_model_len if self.reservation == "max_model_len" else max_total_tokens
        return self.blocks_for_tokens(tokens)

    def cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[Block]:
        return []

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        pass

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          salt: str | None = None) -> None:
        pass

    def _first_fit(self, n: int) -> int | None:
        """The first run of ``n`` free blocks (a byte search: this runs at every admission attempt)."""
        start = self.used.find(bytes(n))
        return None if start < 0 else start

    def _reserve(self, request_id: str, n: int) -> BlockTable | None:
        """A first-fit run of ``n`` blocks as the request's table, or None (counted as a stall)."""
        start = self._first_fit(n)
        if start is None:
            self.num_admission_stalls += 1
            return None
        table = self.tables[request_id] = BlockTable(self.block_size)
        for i in range(start, start + n):
            self.used[i] = 1
            self.blocks[i].ref_count = 1
        table.append_blocks(self.blocks[start:start + n], 0)
        return table

    def allocate_slots(self, request_id: str, num_slots: int, cached: Sequence[Block] = (),
                       max_total_tokens: int | None = None, num_computed: int | None = None) -> bool:
        table = self.tables.get(request_id)
        if table is None:
            table = self._reserve(request_id, self.max_blocks_for_request(max_total_tokens or num_slots))
            if table is None:
                return False
        if table.blocks_needed(num_slots):
            raise ValueError(f"request {request_id} outgrew its contiguous reservation")
        table.num_slots = max(table.num_slots, num_slots)
        return True

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> bool:
        """No sharing here: the child gets its own reservation and a copy of the parent's blocks.
        False if no contiguous run is free (the child then recomputes from the waiting queue)."""
        parent = self.tables[parent_id]
        table = self._reserve(child_id, len(parent.blocks))
        if table is None:
            return False
        table.num_slots = num_computed
        used = self.blocks_for_tokens(num_computed)
        for src, dst in zip(parent.block_ids[:used], table.block_ids[:used], strict=True):
            self.cow.add(src, dst)
        return True

    def trim(self, request_id: str, num_slots: int) -> None:
        """Roll back to ``num_slots`` slots; the reservation keeps its blocks (it is the request's
        whole length)."""
        table = self.tables.get(request_id)
        if table is not None:
            table.num_slots = min(table.num_slots, num_slots)

    def take_copies(self) -> list[tuple[int, int]]:
        return self.cow.take()

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables[request_id].block_ids

    def free(self, request_id: str, keep_hashes: bool = False, keep_host: bool = False) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            for b in table.blocks:
                self.used[b.block_id] = 0
                b.ref_count = 0

    def begin_step(self) -> None:
        pass

    def swap_out(self, request_id: str) -> bool:
        return False  # reservations never grow, so nothing is ever preempted here

    def swap_in(self, request_id: str, num_slots: int) -> bool:
        raise KeyError(f"request {request_id!r} is not swapped out (the contiguous layout never swaps)")

    def take_swaps(self) -> tuple[list, list]:
        return [], []

    def choose_victim(self, request_ids: Sequence[str]) -> int:
        return len(request_ids) - 1

    def record_preemption(self) -> None:
        self.num_preemptions += 1

    def cached_block_ids(self) -> list[int]:
        return []  # no prefix caching in the contiguous baseline

    def stats(self) -> dict[str, float | int | str]:
        total = self.num_blocks
        free = self.num_free_blocks
        reserved = sum(len(t.blocks) for t in self.tables.values()) * self.block_size
        filled = sum(t.num_slots for t in self.tables.values())
        return {
            "kv_layout": self.layout, "num_blocks": total, "block_size": self.block_size,
            "num_free_blocks": free, "num_used_blocks": total - free, "usage": 1.0 - free / total,
            "fragmentation": (reserved - filled) / reserved if reserved else 0.0,
            "num_cached_blocks": 0, "num_idle_cached_blocks": 0, "num_shared_blocks": 0,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0,
            "num_preemptions": self.num_preemptions, "num_evictions": 0,
            "num_admission_stalls": self.num_admission_stalls, "num_cow_copies": self.num_cow_copies,
            "num_swapped_out_blocks": 0, "num_swapped_in_blocks": 0, "num_host_blocks": 0,
            "num_free_host_blocks": 0,
        }

    def check_invariants(self) -> None:
        owner: dict[int, str] = {}
        for rid, t in self.tables.items():
            ids = t.block_ids
            assert ids == list(range(ids[0], ids[0] + len(ids))), f"{rid}'s reservation is not contiguous"
            for i in ids:
                assert i not in owner, f"block {i} reserved by {owner[i]} and {rid}"
                owner[i] = rid
        assert sum(self.used) == len(owner)
        for b in self.blocks:
            assert b.ref_count == (1 if b.block_id in owner else 0)
