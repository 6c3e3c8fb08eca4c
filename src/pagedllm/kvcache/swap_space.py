"""SwapSpace: the host tier's bookkeeping for swap preemption, and the copies queued for a step.

Owns the ``HostBlockPool`` (``pool``), which host blocks hold each swapped-out request, and the
block copies decided since the runner last took them: device->host for requests swapped out,
host->device for requests swapped back in. A host block read by a copy-in may still be in flight
during the step that schedules it, so it is released one step later (``begin_step``). Device
blocks are not its business: the ``KVCacheManager`` frees and allocates those.
Invariant: every host block is exactly one of free, held by one swapped-out request, or waiting
for release at the next step (``check_invariants``).
"""

from __future__ import annotations

from pagedllm.kvcache.host_pool import HostBlockPool


class SwapSpace:
    """Host blocks of swapped-out requests, queued swap copies, and swapped block counters."""

    def __init__(self, num_host_blocks: int) -> None:
        self.pool = HostBlockPool(num_host_blocks)
        self._host_tables: dict[str, list[int]] = {}  # swapped-out request -> host block ids
        self._swap_out: list[tuple[int, int]] = []    # (device, host) copies for this step
        self._swap_in: list[tuple[int, int]] = []     # (host, device) copies for this step
        self._release_next: list[int] = []            # host blocks whose copy-in may be in flight
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def begin_step(self) -> None:
        """Host blocks read by the previous step's copy-in are free again (the runner waits for
        that copy before it starts the next one)."""
        if self._release_next:
            self.pool.free(self._release_next)
            self._release_next = []

    def is_swapped_out(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def swap_out(self, request_id: str, device_block_ids: list[int]) -> bool:
        """Reserve host blocks for a request's device blocks and queue their copies out. False
        (nothing changed) if the host tier is full."""
        host_ids = self.pool.allocate(len(device_block_ids))
        if host_ids is None:
            return False
        self._swap_out.extend(zip(device_block_ids, host_ids, strict=True))
        self._host_tables[request_id] = host_ids
        self.num_swapped_out_blocks += len(host_ids)
        return True

    def swap_in(self, request_id: str, device_block_ids: list[int]) -> None:
        """Queue the copy of a swapped-out request back into ``device_block_ids``; its host blocks
        are released at the next step."""
        host_ids = self._host_tables.pop(request_id)
        self._swap_in.extend(zip(host_ids, device_block_ids, strict=True))
        self._release_next.extend(host_ids)
        self.num_swapped_in_blocks += len(host_ids)

    def drop(self, request_id: str) -> None:
        """Forget a request's swapped-out copy (it finished or was aborted while swapped out)."""
        if request_id in self._host_tables:
            self._release_next.extend(self._host_tables.pop(request_id))

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(device->host, host->device) block copies queued since the last call."""
        outs, ins = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        return outs, ins

    def check_invariants(self) -> None:
        held = [h for ids in self._host_tables.values() for h in ids] + self._release_next
        assert len(set(held)) == len(held), "a host block is held twice"
        assert self.pool.num_free + len(held) == self.pool.num_blocks, "host blocks leaked"
