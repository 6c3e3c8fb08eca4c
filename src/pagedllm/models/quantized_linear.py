"""Linear layers: GGUF's own 4- and 8-bit weights for steps of few rows, prepacked dense ones else.

A decode step at batch 1 reads every weight once and does two flops per weight read, so its
matmuls are bound by memory bandwidth: reading the 4-bit codes of a Q4_1 model moves ~4x fewer
bytes than bfloat16 weights. Large steps (prefill, big batches) are compute-bound, where dense
GEMM is fastest. ``Linear`` therefore keeps its dense weight and, with ``quantization="gguf"``,
also a weight-only quantized kernel that it uses for steps of at most ``max_rows`` rows:

- 4-bit blocks (Q4_0/Q4_1) run on torch's ``_weight_int4pack_mm_for_cpu`` with group size 32:
  it computes ``(q - 8) * scale + zero`` per group, so ``zero = minimum + 8 * scale`` reproduces
  ``scale * q + minimum`` (exact in float32; scale and zero are rounded to the activation dtype);
  or, where the kernel plan says so (AVX2), on the C++ ``q4_linear`` (float32 maths, exact GGUF
  weights), faster than torch's there (figures: docs/design.md); or (AVX-512 BF16, bfloat16 models)
  on the C++ ``q4_tiles_linear``: BF16 dot products of the exact codes in tiles of 16 channels,
  2x torch's kernel's speed at 1 and at 8 rows, and 8 rows for much less than 8 times 1.
- 8-bit blocks (Q8_0) run on the C++ ``q8_0_linear`` (float32 maths, exact GGUF weights).

Both copies hold the same GGUF weights, so the two paths differ only by rounding, like two GEMM
kernels would; float32 engines keep ``quantization="none"`` by default for exact HF parity.

The dense weight itself is kept, in bfloat16 on CPU, in oneDNN's blocked layout (``prepack``):
the same results as ``F.linear``, without oneDNN reordering the weight on every call. On a CPU
without native bf16 dot products (``cpu_features.matmul_dtype``) the packed weight is float32
instead: activations are widened (exact), multiplied in float32 and the result rounded back once,
3-4x faster there than oneDNN's emulated bf16 GEMM; where oneDNN packs no float32 either, a plain
float32 copy (MKL's sgemm). On the AVX2 family the float32 weight is kept as panels of 16 columns
for our own GEMM instead (``pack_panels``, ``csrc/panel_gemm.h``): 1.2-1.5x oneDNN's float32 rate
there from 32 rows. Which of these a CPU family runs, and up to how many rows each
small-batch kernel does, is ``kernel_plan``'s choice; nothing here is tried and then caught.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import cpu_features
from pagedllm.models.gguf_quant import BlockQuantized

# Rows up to which a small-batch kernel runs by default; each CPU family's own crossovers are in
# ``kernel_plan`` (measured in the engine, where the weights stream from DRAM every step).
DEFAULT_MAX_ROWS = 8


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


def exact_scale_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Blocks' (scale, minimum) values in float16 where float16 holds them all exactly (GGUF stores
    both so: half the bytes), else in float32 (an AWQ group's minimum ``-scale * zero`` generally
    needs more bits than float16's). The C++ 4-bit kernels take either, so the weights stay exact."""
    half = pairs.half()
    return (half if torch.equal(half.float(), pairs.float()) else pairs.float()).contiguous()


class Int4BlockMatmul:
    """x [M, K] @ W^T with W as 4-bit blocks (GGUF's Q4_0/Q4_1, or AWQ's groups as such blocks)
    through the C++ ``q4_linear``: float32 maths on the exact weights (scale and minimum as
    ``exact_scale_pairs``; torch's kernel rounds its zero point to the activation dtype), codes
    packed two per byte in GGUF's own nibble order. Output in x's dtype. Its AVX2 body widens 8
    bytes into 16 weights at once and shares each unpacked block among up to 8 rows."""

    def __init__(self, weight: BlockQuantized, layer_ops) -> None:
        if weight.bits != 4:
            raise ValueError("Int4BlockMatmul needs 4-bit codes")
        n, k = weight.codes.shape
        halves = weight.codes.view(n, k // 32, 2, 16)  # weights j and j + 16 of a block share byte j
        self.codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        self.scale_min = exact_scale_pairs(torch.stack([weight.scale, weight.minimum], dim=-1))
        self.layer_ops = layer_ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_ops.q4_linear(x, self.codes, self.scale_min).to(x.dtype)


class Int4TileMatmul:
    """bfloat16 x [M, K] @ W^T with W as GGUF 4-bit blocks (Q4_0/Q4_1) through the C++
    ``q4_tiles_linear`` (``csrc/bf16_tiles.h``): AVX-512 BF16 dot products over the exact weights
    (codes are exact in bfloat16, so are their products with bfloat16 inputs; float32 sums, the
    blocks' scale and minimum, as ``exact_scale_pairs``, applied in float32), in tiles of 16 output channels that
    each serve up to 8 rows at once: a step of 8 rows costs far less than 8 steps of one (the
    figures: docs/design.md). Output in x's dtype; bfloat16 x only (float32 inputs would have to
    be rounded)."""

    TILE = 16

    def __init__(self, weight: BlockQuantized, layer_ops) -> None:
        if not self.accepts(weight):
            raise ValueError("Int4TileMatmul needs 4-bit codes and N a multiple of 16")
        n, k = weight.codes.shape
        t, g = n // self.TILE, k // 32
        # codes [n, k] as [tile, channel i, block g, step s, pair half h, input of the pair w]:
        # k = 32 g + 4 s + 2 h + w; byte j = 2 i + w of (tile, g, s) holds h = 0 low, h = 1 high
        q = weight.codes.to(torch.uint8).view(t, self.TILE, g, 8, 2, 2).permute(0, 2, 3, 4, 1, 5)
        self.codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(t, g, 8, 2 * self.TILE).contiguous()
        pairs = torch.stack([weight.scale, weight.minimum], dim=0).view(2, t, self.TILE, g)
        self.scale_min = exact_scale_pairs(pairs.permute(1, 3, 0, 2))  # [tile, g, (scale, minimum), channel]
        self.layer_ops = layer_ops

    @classmethod
    def accepts(cls, weight: BlockQuantized) -> bool:
        return weight.bits == 4 and weight.codes.shape[0] % cls.TILE == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_ops.q4_tiles_linear(x, self.codes, self.scale_min, bf16_out=True)


class Int8TileMatmul:
    """bfloat16 x [M, K] @ W^T with W as GGUF Q8_0 blocks through the C++ ``q8_0_tiles_linear``
    (``csrc/bf16_tiles.h``): the 4-bit tile kernel's arithmetic over 8-bit codes (exact in bfloat16),
    in tiles of 16 output channels, up to 8 rows per unpacked tile. Output in x's dtype."""

    TILE = 16

    def __init__(self, weight: BlockQuantized, layer_ops) -> None:
        if not self.accepts(weight):
            raise ValueError("Int8TileMatmul needs 8-bit codes and N a multiple of 16")
        n, k = weight.codes.shape
        t, g = n // self.TILE, k // 32
        # codes [n, k] as [tile, channel i, block g, step p, input of the pair w]: k = 32 g + 2 p + w,
        # byte j = 2 i + w of (tile, g, p)
        q = weight.codes.view(t, self.TILE, g, 16, 2).permute(0, 2, 3, 1, 4)
        self.codes = q.reshape(t, g, 16, 2 * self.TILE).contiguous()
        self.scales = weight.scale.float().view(t, self.TILE, g).permute(0, 2, 1).contiguous()
        self.layer_ops = layer_ops

    @classmethod
    def accepts(cls, weight: BlockQuantized) -> bool:
        return weight.bits == 8 and weight.codes.shape[0] % cls.TILE == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_ops.q8_0_tiles_linear(x, self.codes, self.scales, bf16_out=True)


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


class Int8ChannelMatmul:
    """x [M, K] @ W^T with W as int8 codes and one scale per output channel (``quantization="int8"``):
    ``w[n, k] = scale[n] * codes[n, k]``, ``scale = absmax / 127`` of the row, codes rounded half to
    even. Small steps run torch's weight-only ``_weight_int8pack_mm`` (codes widened in registers,
    activations stay in their dtype: int8 x int8 dot products, VNNI/AMX-INT8, would need int8
    activations too); larger ones ``dense``: the weight dequantized for that call, then the dense
    GEMM. The scales are kept in float32 and rounded to the activation dtype once per dtype. With
    ``layer_ops`` (the kernel plan's ``int8_kernel="cpp"``: torch's kernel is fast with bf16
    activations only), float32 and float16 rows run our C++ Q8_0 kernel instead (``blocks``, an
    ``Int8BlockMatmul``: float32 maths), the channel's scale repeated on each of its 32-input blocks."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, layer_ops=None) -> None:
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != (codes.shape[0],):
            raise ValueError("Int8ChannelMatmul needs int8 codes [N, K] and float scales [N]")
        self.codes, self.scale = codes.contiguous(), scale.float().contiguous()
        self._scales: dict[torch.dtype, torch.Tensor] = {}
        self.blocks = None
        if layer_ops is not None and codes.shape[1] % 32 == 0:
            block_scales = self.scale[:, None].expand(-1, codes.shape[1] // 32).contiguous()
            self.blocks = Int8BlockMatmul(BlockQuantized(self.codes, block_scales, None), layer_ops)

    def runs_blocks(self, dtype: torch.dtype) -> bool:
        """Whether rows of ``dtype`` run our C++ Q8_0 kernel (else torch's int8 one)."""
        return self.blocks is not None and dtype != torch.bfloat16

    @staticmethod
    def quantize(weight: torch.Tensor, layer_ops=None) -> Int8ChannelMatmul:
        """Per output channel, symmetric: ``scale = absmax / 127`` (float32; 1 for an all-zero row)."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8ChannelMatmul(codes, scale, layer_ops)

    def scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales:
            self._scales[dtype] = self.scale.to(dtype)
        return self._scales[dtype]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] as this kernel computes it in ``dtype``."""
        return self.codes.to(dtype) * self.scales_for(dtype)[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_blocks(x.dtype):
            return self.blocks(x)
        return torch._weight_int8pack_mm(x.contiguous(), self.codes, self.scales_for(x.dtype))

    def dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), bias)


class NativePackedMatmul:
    """x [M, K] @ W^T through oneDNN in the weight's own dtype (no widening): for a single row, where
    reading half the bytes beats float32's faster arithmetic (figures: docs/design.md)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, None)


# KernelPlan.int4_kernel -> the class that runs it (tests check the plan's choice is what runs)
INT4_MATMULS = {"torch": Int4Matmul, "cpp": Int4BlockMatmul, "tiles": Int4TileMatmul}
Q8_0_MATMULS = {"cpp": Int8BlockMatmul, "tiles": Int8TileMatmul}


def quantized_matmul(weight: BlockQuantized, dtype: torch.dtype, layer_ops, int4_kernel: str = "torch",
                     q8_0_kernel: str = "cpp"):
    """The small-batch kernel for these blocks, or None when this machine has none for them.
    ``int4_kernel`` (``KernelPlan.int4_kernel``): ``"cpp"`` for our C++ 4-bit kernel (where the C++
    layer ops built), ``"tiles"`` for our AVX-512 BF16 tile kernel, ``"torch"`` for torch's int4 one
    (also where the chosen one does not apply).
    ``q8_0_kernel`` (``KernelPlan.q8_0_kernel``): ``"cpp"`` (``q8_0_linear``) or ``"tiles"``. The tile
    kernels apply to a bfloat16 model, N a multiple of 16, in a build that has them; else the
    ``cpp`` / ``torch`` kernel runs."""
    tiles = dtype == torch.bfloat16 and hasattr(layer_ops, "has_bf16_tiles") and layer_ops.has_bf16_tiles()
    if weight.bits == 4:
        if int4_kernel == "cpp" and hasattr(layer_ops, "q4_linear"):
            return Int4BlockMatmul(weight, layer_ops)
        if int4_kernel == "tiles" and tiles and Int4TileMatmul.accepts(weight):
            return Int4TileMatmul(weight, layer_ops)
        return Int4Matmul(weight, dtype) if cpu_features.current().int4_matmul else None
    if q8_0_kernel == "tiles" and tiles and Int8TileMatmul.accepts(weight):
        return Int8TileMatmul(weight, layer_ops)
    if hasattr(layer_ops, "q8_0_linear"):
        return Int8BlockMatmul(weight, layer_ops)
    return None


def prepack_for_onednn(weight: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``weight`` [N, K] in oneDNN's blocked layout for ``onednn_linear``, or None where that does
    not apply. bfloat16 on CPU: there ``F.linear`` already runs oneDNN, so the results are
    identical (tested) and only the per-call weight reordering goes away (10-20% of each matmul
    at 1-64 rows, measured in docs/benchmarks.md); float32 weights keep MKL's sgemm, as HF does.
    ``compute_dtype=float32`` packs a bf16/fp16 weight widened to float32 (see ``Linear.prepack``).
    Where oneDNN does not pack that dtype on this CPU (``CpuFeatures.onednn_packs``: bf16 needs
    AVX-512 or AVX-NE-CONVERT) it is not asked to."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if compute_dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        weight = weight.float()
    elif weight.dtype != torch.bfloat16:
        return None
    if not cpu_features.current().onednn_packs(weight.dtype):
        return None
    return _REORDER(weight.detach(), 64)  # 64: the batch it is tuned for


PANEL = 16  # output columns per panel (csrc/panel_gemm.h)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as float32 panels [ceil(N / 16), K, 16] for the C++ ``panel_linear``: panel p
    holds output columns 16p..16p+15 K-major, zero-padded past N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach().float()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


_REORDER = torch.ops.mkldnn._reorder_linear_weight
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
    wide_weight = None       # a plain float32 copy, where oneDNN packs no float32 weight (with packed_bias)
    panels = None            # float32 panels for the C++ panel GEMM (with packed_bias), see prepack
    panel_ops = None         # the C++ layer ops module that runs them
    int8_weight = None       # the only copy of the weight under quantization="int8" (Int8ChannelMatmul)

    def use_quantized(self, kernel, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.small_batch, self.max_rows = kernel, max_rows
        self.small_batch_bias = None if self.bias is None else self.bias.detach()

    def use_int8_weight(self, kernel: Int8ChannelMatmul, max_rows: int) -> None:
        """Keep the weight only as ``kernel``'s int8 codes (the dense Parameter is dropped): steps of
        at most ``max_rows`` rows run its int8 kernel, larger ones its dequantize-then-GEMM path."""
        self.use_quantized(kernel, max_rows)
        self.int8_weight, self.weight = kernel, None

    def prepack(self, compute_dtype: torch.dtype | None = None, panel_ops=None) -> bool:
        """Keep the weight only in oneDNN's layout; True if done. By default only where that gives
        results identical to ``F.linear`` (bfloat16); ``compute_dtype=float32`` computes a bf16/fp16
        layer in float32, for CPUs without native bf16/fp16 GEMMs (``cpu_features.matmul_dtype``):
        the output is then rounded to the model dtype once, as a native kernel's would be. Where
        oneDNN packs no float32 weight (a CPU without AVX2), the float32 copy stays a plain tensor
        (MKL's sgemm), still faster than a GEMM that converts bf16 in its inner loop. With
        ``panel_ops`` (the C++ layer ops, where the kernel plan picks the AVX2 panel GEMM) a widened
        weight is kept as float32 panels for its ``panel_linear`` instead."""
        if self.weight is None:
            return False
        widen = compute_dtype == torch.float32 and self.weight.dtype in (torch.bfloat16, torch.float16)
        if widen and panel_ops is not None:
            self.panels, self.panel_ops = pack_panels(self.weight), panel_ops
            self.packed_bias = None if self.bias is None else self.bias.detach().float()
            self.weight, self.widen = None, torch.float32
            return True
        packed = prepack_for_onednn(self.weight, torch.float32 if widen else None)
        bias = None if self.bias is None else self.bias.detach()
        if packed is None:
            if not widen:
                return False
            self.wide_weight = self.weight.detach().float()
            self.packed_bias = None if bias is None else bias.float()
            self.weight, self.widen = None, torch.float32
            return True
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
        if self.panels is not None:
            return self.panel_ops.panel_linear(x, self.panels, self.packed_bias, self.out_features).to(x.dtype)
        if self.wide_weight is not None:  # after the packed path: no extra check on the common one
            return F.linear(x.to(self.widen), self.wide_weight, self.packed_bias).to(x.dtype)
        if self.int8_weight is not None:
            return self.int8_weight.dense(x, self.small_batch_bias)
        return F.linear(x, self.weight, self.bias)
