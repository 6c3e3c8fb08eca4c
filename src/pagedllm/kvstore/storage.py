"""KVCacheStorage: the K and V tensors of every layer, allocated once.

Per layer, K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot
``block_id * block_size + offset`` indexes the flattened first two dimensions. Sizing converts a
memory budget into a block count (``bytes_per_block`` counts K and V of every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.errors import OutOfKVMemory


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks in the pool: ``num_kv_blocks`` if given, else what ``kv_cache_memory`` holds."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = bytes_per_block(model, cache.block_size, dtype)
    n = cache.kv_cache_memory // per_block
    if n < 1:
        raise OutOfKVMemory(
            f"kv_cache_memory={cache.kv_cache_memory.human_readable(decimal=False)} holds no KV block: one block of "
            f"{cache.block_size} tokens needs {per_block} bytes for this model and dtype")
    return n


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
