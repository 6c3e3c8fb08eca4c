"""The interface every attention backend implements (reference, cpu, triton)."""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend:
    """``write_kv`` stores a step's new K/V rows through the slot mapping; ``forward`` attends
    through the block tables; ``store_and_attend`` does both (fused where a backend can)."""

    name = "base"
    fuses_rope = False  # True: ``rope_store_attend`` takes the raw qkv rows and applies RoPE itself

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def store_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.write_kv(k_cache, v_cache, key, value, meta)
        return self.forward(query, k_cache, v_cache, meta)
