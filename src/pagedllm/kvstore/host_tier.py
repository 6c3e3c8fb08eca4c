"""HostTier: host-memory (CPU; pinned when the cache is on CUDA) copies of swapped-out KV blocks.

``swap_out`` copies device blocks to host blocks synchronously (their device blocks are reused in
the same step). ``start_swap_in`` copies host blocks back on a background thread (a side CUDA
stream on GPU) so the copy overlaps the step being computed; ``wait`` joins it before the next
step. The overlap is measured: ``copy_seconds`` is time spent copying in the background,
``wait_seconds`` the part of it the engine had to wait for.
"""

from __future__ import annotations

import threading
import time

import torch

from pagedllm.kvstore.storage import KVCacheStorage


class HostTier:
    def __init__(self, storage: KVCacheStorage, num_blocks: int) -> None:
        ref = storage.k_caches[0]
        shape = (num_blocks, *ref.shape[1:])
        pin = ref.is_cuda
        self.k = [torch.zeros(shape, dtype=ref.dtype, pin_memory=pin) for _ in storage.k_caches]
        self.v = [torch.zeros(shape, dtype=ref.dtype, pin_memory=pin) for _ in storage.v_caches]
        self.storage = storage
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(device=ref.device) if ref.is_cuda else None
        self._event = None
        self.copy_seconds = 0.0
        self.wait_seconds = 0.0
        self.num_swap_ins = 0

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        dev = torch.tensor([p[0] for p in pairs], device=self.storage.k_caches[0].device)
        host = torch.tensor([p[1] for p in pairs])
        for src, dst in ((self.storage.k_caches, self.k), (self.storage.v_caches, self.v)):
            for s, d in zip(src, dst, strict=True):
                d.index_copy_(0, host, s.index_select(0, dev).to("cpu"))

    def _copy_in(self, pairs: list[tuple[int, int]]) -> None:
        t0 = time.perf_counter()
        device = self.storage.k_caches[0].device
        host = torch.tensor([p[0] for p in pairs])
        dev = torch.tensor([p[1] for p in pairs], device=device)
        for src, dst in ((self.k, self.storage.k_caches), (self.v, self.storage.v_caches)):
            for s, d in zip(src, dst, strict=True):
                d.index_copy_(0, dev, s.index_select(0, host).to(device, non_blocking=True))
        self.copy_seconds += time.perf_counter() - t0

    def start_swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Begin copying host blocks back to their new device blocks, in the background."""
        self.wait()
        self.num_swap_ins += 1
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._copy_in(pairs)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
            return
        self._thread = threading.Thread(target=self._copy_in, args=(pairs,), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the in-flight copy-in (if any) is done."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event.synchronize()
            self._event = None
        self.wait_seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        overlap = 1.0 - self.wait_seconds / self.copy_seconds if self.copy_seconds else 0.0
        return {"swap_in_copy_seconds": self.copy_seconds, "swap_in_wait_seconds": self.wait_seconds,
                "swap_in_overlap": max(0.0, overlap)}
