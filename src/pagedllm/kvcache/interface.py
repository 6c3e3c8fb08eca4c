"""KVCacheManagerProtocol: what the scheduler, engine and benchmarks may ask of a KV manager.

Two managers implement it: ``KVCacheManager`` (paged: blocks on demand, prefix sharing, forks by
reference, swap) and ``ContiguousKVCacheManager`` (one reservation per request, the baseline), so
a benchmark compares them by swapping one object. The control plane sees block ids only; the
copies a manager decides (``take_copies``, ``take_swaps``) are plain ``(src, dst)`` pairs for the
runner. Contract shared by both: a request's table covers every slot it was granted;
``allocate_slots``, ``fork`` and ``swap_in`` either succeed or change nothing; ``free`` is
idempotent; ``check_invariants`` raises AssertionError on inconsistent accounting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pagedllm.kvcache.block import Block
from pagedllm.kvcache.block_table import BlockTable
from pagedllm.kvcache.kv_events import KVEventLog


@runtime_checkable
class KVCacheManagerProtocol(Protocol):
    """The interface shared by the paged and the contiguous KV managers."""

    layout: str                     # "paged" | "contiguous"
    block_size: int                 # token slots per block
    enable_prefix_caching: bool
    tables: dict[str, BlockTable]   # request id -> its block table (requests holding blocks)
    num_preemptions: int
    events: KVEventLog | None       # KV-cache events recorded (paged with a recorder set), else None

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_cow_copies(self) -> int: ...

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` slots take."""

    def max_blocks_for_request(self, max_total_tokens: int) -> int:
        """Blocks a request of at most ``max_total_tokens`` tokens can come to hold."""

    def cached_block_ids(self) -> list[int]:
        """The blocks the prefix cache holds, in use or not (none without prefix caching)."""

    # prefix cache
    def cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> list[Block]:
        """Blocks holding the longest cached prefix of full blocks (no side effects)."""

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's prefix-cache lookup (in tokens)."""

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          salt: str | None = None) -> None:
        """Register blocks now full of computed tokens in the prefix cache."""

    # allocation and sharing
    def allocate_slots(self, request_id: str, num_slots: int, cached: Sequence[Block] = (),
                       max_total_tokens: int | None = None, num_computed: int | None = None) -> bool:
        """Make the request's table cover ``num_slots`` slots; False (nothing changed) if it cannot."""

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> bool:
        """Give ``child_id`` the parent's first ``num_computed`` tokens of KV; False if no room."""

    def trim(self, request_id: str, num_slots: int) -> None:
        """Roll a request back to its first ``num_slots`` slots (rejected speculative guesses)."""

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) to run before this step's writes."""

    def block_ids(self, request_id: str) -> list[int]:
        """The request's physical block ids, in logical order."""

    def free(self, request_id: str, keep_hashes: bool = False, keep_host: bool = False) -> None:
        """Release every block of a request (no-op if it holds none)."""

    # swap
    def begin_step(self) -> None:
        """Start of a scheduling step: release what the previous step's copies no longer need."""

    def swap_out(self, request_id: str) -> bool:
        """Move a request's KV to the host tier and free its device blocks; False if impossible."""

    def swap_in(self, request_id: str, num_slots: int) -> bool:
        """Bring a swapped-out request back; False (nothing changed) if the pool cannot hold it."""

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(device->host, host->device) block copies decided since the last call."""

    # preemption and accounting
    def choose_victim(self, request_ids: Sequence[str]) -> int:
        """Index (into ``request_ids``, oldest first) of the request to preempt."""

    def record_preemption(self) -> None: ...

    def stats(self) -> dict[str, float | int | str]:
        """Usage, fragmentation, cache and preemption counters: the one source for metrics."""

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent."""
