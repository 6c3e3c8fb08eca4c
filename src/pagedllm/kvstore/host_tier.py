"""HostTier: host-memory (CPU; pinned when the cache is on CUDA) copies of swapped-out KV blocks.

Holds one ``LayerKV`` per layer in the device storage's ``KVSpec``, so every tensor of a block
(K, V and, where the format has them, their scales) is swapped with it. ``swap_out`` copies
device blocks to host blocks synchronously (their device blocks are reused in the same step).
``start_swap_in`` copies host blocks back on a background thread (a side CUDA stream on GPU) so
the copy overlaps the step being computed; ``wait`` joins it before the next step. The overlap is
measured: ``copy_seconds`` is time spent copying in the background, ``wait_seconds`` the part of
it the engine had to wait for.
"""

from __future__ import annotations

import threading
import time

import torch

from pagedllm.kvstore.spec import LayerKV, as_movable
from pagedllm.kvstore.storage import KVCacheStorage


class HostTier:
    def __init__(self, storage: KVCacheStorage, num_blocks: int) -> None:
        ref = storage.layers[0].k
        self.layers = [LayerKV.allocate(storage.spec, num_blocks, "cpu", pin_memory=ref.is_cuda)
                       for _ in storage.layers]
        self.storage = storage
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(device=ref.device) if ref.is_cuda else None
        self._event = None
        self.copy_seconds = 0.0
        self.wait_seconds = 0.0
        self.num_swap_ins = 0

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks

    def _pairs(self):
        """(device tensor, host tensor) of every tensor of every layer."""
        for device_layer, host_layer in zip(self.storage.layers, self.layers, strict=True):
            yield from zip(map(as_movable, device_layer.tensors), map(as_movable, host_layer.tensors), strict=True)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        dev = torch.tensor([p[0] for p in pairs], device=self.storage.layers[0].k.device)
        host = torch.tensor([p[1] for p in pairs])
        for device_tensor, host_tensor in self._pairs():
            host_tensor.index_copy_(0, host, device_tensor.index_select(0, dev).to("cpu"))

    def _copy_in(self, pairs: list[tuple[int, int]]) -> None:
        t0 = time.perf_counter()
        device = self.storage.layers[0].k.device
        host = torch.tensor([p[0] for p in pairs])
        dev = torch.tensor([p[1] for p in pairs], device=device)
        for device_tensor, host_tensor in self._pairs():
            device_tensor.index_copy_(0, dev, host_tensor.index_select(0, host).to(device, non_blocking=True))
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
