"""What this CPU computes natively, asked of torch (which reads CPUID), for choices made at run time.

Only facts used to pick a code path live here: a kernel that needs an instruction is chosen only
where the CPU has it, so the same install runs on AVX-512-only AMD EPYCs and on Intel Xeons with AMX.
"""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """AVX512-BF16 dot products or AMX tiles: bfloat16 GEMMs run at (or above) float32's speed."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def native_fp16() -> bool:
    """AMX-FP16 tiles: float16 GEMMs without converting to float32 first."""
    return bool(torch.cpu._is_amx_fp16_supported())


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU GEMMs should compute in for weights and activations stored in ``dtype``.

    Without native bf16/fp16 dot products, oneDNN's bf16 GEMM converts inside its inner loop and
    runs 3-4x slower than float32 (measured on an AVX-512 Xeon without BF16: ~60 vs 200-270
    GFLOP/s at 64-512 rows, docs/benchmarks.md). Products of bf16 or fp16 values are exact in
    float32, so computing there and rounding the result once is what a native kernel does too,
    up to the order of the float32 sum."""
    if dtype == torch.bfloat16 and not native_bf16():
        return torch.float32
    if dtype == torch.float16 and not native_fp16():
        return torch.float32
    return dtype
