"""KVCacheStorage: the K and V tensors of every layer, allocated once.

Per layer, K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot
``block_id * block_size + offset`` indexes the flattened first two dimensions. Sizing converts a
memory budget into a block count (``bytes_per_block`` counts K and V of every layer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.errors import OutOfKVMemory


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: str = "cpu") -> int:
    """Blocks in the pool: ``num_kv_blocks`` if given, else what ``kv_cache_memory`` holds."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = bytes_per_block(model, cache.block_size, dtype)
    memory, what = kv_pool_bytes(cache.kv_cache_memory, device)
    n = memory // per_block
    if n < 1:
        raise OutOfKVMemory(f"kv_cache_memory={what} holds no KV block: one block of "
                            f"{cache.block_size} tokens needs {per_block} bytes for this model and dtype")
    return n


def free_device_memory(device: str | torch.device) -> int:
    """Bytes free on ``device`` now: the GPU's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_pool_bytes(kv_cache_memory, device: str | torch.device) -> tuple[int, str]:
    """(bytes, how to name them in an error) for a ``kv_cache_memory`` of bytes or a share ("25%")
    of the device's free memory when the engine is built (after the weights are loaded)."""
    if isinstance(kv_cache_memory, str):
        share = float(kv_cache_memory.strip().rstrip("%")) / 100
        free = free_device_memory(device)
        return int(share * free), f"{kv_cache_memory.strip()} of {free / 2**30:.2f} GiB free"
    return int(kv_cache_memory), kv_cache_memory.human_readable(decimal=False)


@dataclass
class KVCacheStorage:
    """Pre-allocated per-layer K/V tensors."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> KVCacheStorage:
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        ks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        vs = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        return cls(ks, vs, block_size)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: copy-on-write after a fork."""
        src = torch.tensor([c[0] for c in copies], device=self.k_caches[0].device)
        dst = torch.tensor([c[1] for c in copies], device=self.k_caches[0].device)
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @property
    def num_blocks(self) -> int:
        return self.k_caches[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)
