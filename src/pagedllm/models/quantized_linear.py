"""Linear layers: GGUF's own 4- and 8-bit weights for steps of few rows, prepacked dense ones else.

A decode step at batch 1 reads every weight once and does two flops per weight read, so its
matmuls are bound by memory bandwidth: reading the 4-bit codes of a Q4_1 model moves ~4x fewer
bytes than bfloat16 weights. Large steps (prefill, big batches) are compute-bound, where dense
GEMM is fastest. ``Linear`` therefore keeps its dense weight and, with ``quantization="gguf"``,
also a weight-only quantized kernel that it uses for steps of at most ``max_rows`` rows:

- 4-bit blocks (Q4_0/Q4_1) run on torch's ``_weight_int4pack_mm_for_cpu`` with group size 32:
  it computes ``(q - 8) * scale + zero`` per group, so ``zero = minimum + 8 * scale`` reproduces
  ``scale * q + minimum`` (exact in float32; scale and zero are rounded to the activation dtype).
- 8-bit blocks (Q8_0) run on the C++ ``q8_0_linear`` (float32 maths, exact GGUF weights).

Both copies hold the same GGUF weights, so the two paths differ only by rounding, like two GEMM
kernels would; float32 engines keep ``quantization="none"`` by default for exact HF parity.

The dense weight itself is kept, in bfloat16 on CPU, in oneDNN's blocked layout (``prepack``):
the same results as ``F.linear``, without oneDNN reordering the weight on every call. On a CPU
without native bf16 dot products (``cpu_features.matmul_dtype``) the packed weight is float32
instead: activations are widened (exact), multiplied in float32 and the result rounded back once,
3-4x faster there than oneDNN's emulated bf16 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.gguf_quant import BlockQuantized

# Crossover measured in the engine, where the weights stream from DRAM every step: decode at
# batch 2 / 4 / 8 is 1.76x / 1.37x / 1.05x faster with the GGUF blocks than with the prepacked
# dense weights (docs/benchmarks.md); hot-cache microbenchmarks favour the dense path sooner.
DEFAULT_MAX_ROWS = 8
# Where the dense GEMMs compute in float32 (a CPU without native bf16, ``cpu_features``), measured
# with weights streaming from DRAM (30 layers of SmolLM2's projections, a one-off cold-cache script on
# a Xeon without AVX512-BF16, docs/benchmarks.md): the
# 4-bit kernel is faster up to 16 rows (34 vs 41 ms at 16, 80 vs 60 ms at 32), and the Q8_0 kernel
# (no reuse across rows) never is (LM head: 8.9 vs 6.8 ms at 1 row, 69 vs 10 ms at 8).
WIDENED_INT4_MAX_ROWS = 16
WIDENED_INT8_MAX_ROWS = 0
# ... and for a single row, the bf16 LM head (half float32's bytes) is faster than float32's.
WIDENED_NATIVE_HEAD_MAX_ROWS = 1


class Int4Matmul:
    """x [M, K] @ W^T with W as 4-bit codes, groups of 32 along K; output in x's dtype."""

    def __init__(self, weight: BlockQuantized, dtype: torch.dtype) -> None:
        if weight.bits != 4:
            raise ValueError("Int4Matmul needs 4-bit codes")
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        zero = weight.minimum + 8 * weight.scale
        self.scales_and_zeros = torch.stack([weight.scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, 32, self.scales_and_zeros)


class Int8BlockMatmul:
    """x [M, K] @ W^T with W as GGUF Q8_0 blocks, through the C++ layer ops (float32 maths); output in
    x's dtype."""

    def __init__(self, weight: BlockQuantized, layer_ops) -> None:
        if weight.bits != 8:
            raise ValueError("Int8BlockMatmul needs 8-bit codes")
        self.codes, self.scale = weight.codes.contiguous(), weight.scale.contiguous()
        self.layer_ops = layer_ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_ops.q8_0_linear(x, self.codes, self.scale).to(x.dtype)


class NativePackedMatmul:
    """x [M, K] @ W^T through oneDNN in the weight's own dtype (no widening): for a single row, where
    reading half the bytes beats float32's faster arithmetic (the LM head at 1 row: 4.6 vs 6.2 ms)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, None)


def quantized_matmul(weight: BlockQuantized, dtype: torch.dtype, layer_ops):
    """The small-batch kernel for these blocks, or None when this machine has none for them."""
    if weight.bits == 4:
        return Int4Matmul(weight, dtype)
    if hasattr(layer_ops, "q8_0_linear"):
        return Int8BlockMatmul(weight, layer_ops)
    return None


def prepack_for_onednn(weight: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``weight`` [N, K] in oneDNN's blocked layout for ``onednn_linear``, or None where that does
    not apply. bfloat16 on CPU: there ``F.linear`` already runs oneDNN, so the results are
    identical (tested) and only the per-call weight reordering goes away (10-20% of each matmul
    at 1-64 rows, measured in docs/benchmarks.md); float32 weights keep MKL's sgemm, as HF does.
    ``compute_dtype=float32`` packs a bf16/fp16 weight widened to float32 (see ``Linear.prepack``)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if compute_dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        weight = weight.float()
    elif weight.dtype != torch.bfloat16:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: the batch it is tuned for
    except RuntimeError:  # a CPU without the instructions oneDNN wants for this dtype
        return None


_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default  # resolved once: called ~120 times a step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` with an optional oneDNN-prepacked weight (``prepack``) and an optional quantized
    kernel for steps of at most ``max_rows`` rows (``use_quantized``)."""

    small_batch = None
    small_batch_bias = None  # a plain tensor (not a Parameter): read without nn.Module's __getattr__
    max_rows = 0
    packed = None            # oneDNN layout of the dense weight; the dense Parameter is dropped then
    packed_bias = None       # the bias in the packed weight's dtype
    widen = None             # float32 when the packed weight computes in float32 for a bf16/fp16 model

    def use_quantized(self, kernel, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.small_batch, self.max_rows = kernel, max_rows
        self.small_batch_bias = None if self.bias is None else self.bias.detach()

    def prepack(self, compute_dtype: torch.dtype | None = None) -> bool:
        """Keep the weight only in oneDNN's layout; True if done. By default only where that gives
        results identical to ``F.linear`` (bfloat16); ``compute_dtype=float32`` packs a bf16/fp16
        weight as float32, for CPUs without native bf16/fp16 GEMMs (``cpu_features.matmul_dtype``):
        the output is then rounded to the model dtype once, as a native kernel's would be."""
        if self.weight is None:
            return False
        widen = compute_dtype == torch.float32 and self.weight.dtype in (torch.bfloat16, torch.float16)
        packed = prepack_for_onednn(self.weight, torch.float32 if widen else None)
        if packed is None:
            return False
        bias = None if self.bias is None else self.bias.detach()
        self.packed, self.weight = packed, None
        self.packed_bias = bias.float() if widen and bias is not None else bias
        self.widen = torch.float32 if widen else None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Small-batch kernels return x's dtype (each kernel's contract)."""
        if self.small_batch is not None and x.shape[0] <= self.max_rows:
            y = self.small_batch(x)
            return y if self.small_batch_bias is None else y + self.small_batch_bias
        if self.packed is not None:
            if self.widen is not None:
                return _LINEAR_POINTWISE(x.to(self.widen), self.packed, self.packed_bias, "none", [], "").to(x.dtype)
            return _LINEAR_POINTWISE(x, self.packed, self.packed_bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
