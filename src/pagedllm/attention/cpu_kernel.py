"""The C++ paged-attention backend for CPU (``attention_backend="cpu"``).

Compiled when the package is installed (``-O3 -march=native``, OpenMP through ATen's thread
pool), or on first use where that build does not fit this machine (``pagedllm/cpu_extension.py``).
If no build can be had (no compiler), ``load_cpu_kernel`` returns None and says why once; the
backend selector then falls back to the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu_extension import CppExtension

EXTENSION = CppExtension("pagedllm_cpu", Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
                         "the C++ paged-attention kernel", "using the reference backend")


def load_cpu_kernel():
    """The compiled extension module, or None if it cannot be built here."""
    return EXTENSION.load()


class CpuBackend(AttentionBackend):
    """Paged attention through the compiled C++ kernel; same interface as the reference."""

    name = "cpu"
    fuses_rope = True

    def __init__(self, scale: float, module=None) -> None:
        self.scale = scale
        self.ops = module or load_cpu_kernel()
        if self.ops is None:
            raise RuntimeError(f"the C++ kernel is unavailable: {EXTENSION.failure}")

    def write_kv(self, k_cache, v_cache, key, value, meta: AttentionMetadata) -> None:
        self.ops.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, self.scale)

    def rope_store_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          num_heads: int) -> torch.Tensor:
        """One call into C++ per layer: RoPE on q/k, K/V stored into their slots, attention."""
        return self.ops.rope_store_attend(qkv, cos, sin, positions, k_cache, v_cache, meta.slot_mapping,
                                          meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                                          num_heads)

    def store_and_attend(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """One call into C++: store the new K/V rows into their slots, then attend."""
        return self.ops.store_and_attend(query, key, value, k_cache, v_cache, meta.slot_mapping,
                                         meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale)
