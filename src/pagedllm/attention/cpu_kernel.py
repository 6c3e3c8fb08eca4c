"""The C++ paged-attention backend for CPU (``attention_backend="cpu"``).

Compiled when the package is installed (``-O3 -march=native``, OpenMP through ATen's thread
pool), or on first use where that build does not fit this machine (``pagedllm/cpu_extension.py``).
If no build can be had (no compiler), ``load_cpu_kernel`` returns None and says why once; the
backend selector then falls back to the reference.

It reads the model dtype's K/V and the quantized formats of ``kvstore/quant.py`` (int8, fp8_e4m3,
fp8_e5m2, int4; ``csrc/kv_codec.h``): rows are encoded as they are stored and decoded a block of
one KV head at a time inside the attention loop, never into a float copy of the cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu_extension import CppExtension
from pagedllm.cpu_features import CpuFeatures, current
from pagedllm.errors import ConfigError
from pagedllm.kvstore.quant import QUANTIZED_FORMATS
from pagedllm.kvstore.spec import KVSpec, LayerKV

EXTENSION = CppExtension("pagedllm_cpu", Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
                         "the C++ paged-attention kernel", "using the reference backend")


# Fresh bf16 prefills (no cached prefix) of at least this many rows attend through torch's SDPA
# (its flash-attention kernel: bf16 GEMMs on AMX tiles) on AMX CPUs; never (0) elsewhere: slower than
# the kernel on AVX-512 BF16 at every setting tried, unmeasured on the other families. The figures:
# docs/design.md, "Figures behind the code's choices".
DENSE_PREFILL_MIN_ROWS = {"amx": 128}


def dense_prefill_rows(cpu: CpuFeatures) -> int:
    """From how many rows a fresh bf16 prefill attends through SDPA on ``cpu`` (0: never)."""
    return DENSE_PREFILL_MIN_ROWS.get(cpu.family, 0)


def load_cpu_kernel():
    """The compiled extension module, or None if it cannot be built here."""
    return EXTENSION.load()


class CpuBackend(AttentionBackend):
    """Paged attention through the compiled C++ kernel; same interface as the reference."""

    name = "cpu"
    fuses_rope = True
    quant_formats = QUANTIZED_FORMATS

    def __init__(self, scale: float, module=None) -> None:
        self.scale = scale
        self.ops = module or load_cpu_kernel()
        if self.ops is None:
            raise RuntimeError(f"the C++ kernel is unavailable: {EXTENSION.failure}")
        self.dense_prefill_rows = dense_prefill_rows(current())
        self.ops.set_dense_prefill_min_rows(self.dense_prefill_rows)  # per process, the same for all

    def check_kv_spec(self, spec: KVSpec, model_dtype: torch.dtype) -> None:
        super().check_kv_spec(spec, model_dtype)
        if spec.quant != "none" and spec.head_dim % 16:
            raise ConfigError(f"the cpu attention backend reads quantized KV for head sizes divisible by 16, "
                              f"not {spec.head_dim}")
        if spec.quant == "int4" and spec.head_dim & (spec.head_dim - 1):
            raise ConfigError(f"the cpu attention backend rotates int4 KV by a Hadamard transform: it needs a "
                              f"power-of-two head size here, not {spec.head_dim}")

    def write_kv(self, kv: LayerKV, key, value, meta: AttentionMetadata) -> None:
        self.ops.store_kv(key, value, kv.kernel_tensors, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_attention(query, kv.kernel_tensors, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, self.scale)

    def rope_store_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          kv: LayerKV, meta: AttentionMetadata, num_heads: int) -> torch.Tensor:
        """One call into C++ per layer: RoPE on q/k, K/V stored into their slots, attention."""
        return self.ops.rope_store_attend(qkv, cos, sin, positions, kv.kernel_tensors, meta.slot_mapping,
                                          meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                                          num_heads)

    def store_and_attend(self, query, key, value, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """One call into C++: store the new K/V rows into their slots, then attend."""
        return self.ops.store_and_attend(query, key, value, kv.kernel_tensors, meta.slot_mapping,
                                         meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale)
