"""KV formats (``kv_cache_dtype``): how K/V rows become stored codes and back.

A format stores each K/V row (one token, one KV head, ``head_dim`` values) on its own, so a
stored value never depends on a block's write history: the same token's K is the same bytes
whether it was written by a whole prompt, a chunk of it, a copy-on-write, a swap or the prefix
cache. The formats:

- ``float32`` / ``bfloat16`` / ``float16``: the values cast, no scale;
- ``int8``: symmetric per token and KV head, ``scale = absmax / 127`` (bfloat16), codes
  ``round(x / scale)`` in -127..127;
- ``fp8_e4m3`` / ``fp8_e5m2``: per token and KV head, ``scale = absmax / fp8_max`` (448 and 57,344),
  codes ``(x / scale)`` cast to the fp8 type (round to nearest even). A scale is computed on every
  write: vLLM's fp8 KV with its default scale of 1.0 silently loses accuracy (its docs say so);
- ``int4``: the row first rotated by a fixed orthogonal matrix (``rotation``: the normalised
  Hadamard transform where ``head_dim`` is a power of two), then symmetric per token and KV head,
  ``scale = absmax / 7``, each ``x / scale`` coded as its nearest of 15 levels in -7..7
  (``INT4_LEVELS``: not evenly spaced) and stored as the level's index 1..15 (8: zero), two
  nibbles per byte (element ``2i`` in the low nibble). Q is rotated alike, so ``q'.k' = q.k`` in
  exact arithmetic; the output of attention over rotated V is rotated back (``unrotate``). The
  rotation spreads a row's outliers over all its elements, which 4 bits need (llama.cpp's q4_0
  KV measured 6.4648 perplexity without one, 6.3243 with, 6.3123 at f16: its PR 21551).

Scales are bfloat16 (2 bytes per row: an int8 row of 64 values costs 66 bytes, not 68 with
float32, 1.94x the rows of bf16 instead of 1.88x). Not float16: ``absmax / 57344`` (fp8_e5m2) is
below float16's normal range for any row under 3.5, and a subnormal scale loses its precision.
The rows are encoded with the rounded scale, so its 8 bits cost nothing but a clamp: a scale
rounded down by up to 2^-9 lets ``x / scale`` exceed ``qmax`` by as much, clamped to ``qmax``.
``KVCodec`` is the one place that says how, in torch; the C++ and Triton kernels encode and decode
the same bytes the same way (tests compare them). The Hadamard rotation runs as the fast
Walsh-Hadamard butterflies (``fwht``), in the order the C++ store kernel runs them, so both store
the same bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.bfloat16

# int4's levels (a value is ``INT4_LEVELS[nibble] * scale``; nibble 8 is 0, nibble 0 is never
# written): a Lloyd-Max grid for what a rotated row divided by its absmax looks like, Gaussian
# values over their largest of 64, ends fixed at +-7, rounded to 4 decimals (``python
# scripts/int4_variants.py --levels`` prints them). Against evenly spaced codes -7..7 it lowers
# the error of the rows int4 stores, at the same bytes (docs/kv_quantization.md, "Why int4 is
# what it is"). The C++ (``csrc/kv_codec.h``, ``paged_attention_cpu.cpp``) and Triton kernels
# hold the same literals (a test compares them). A value's nibble is 8 plus or minus the number
# of ``INT4_THRESHOLDS`` (the midpoints between neighbouring levels) that ``|x / scale|`` exceeds.
INT4_POINTS = (0.7292, 1.4789, 2.2712, 3.1374, 4.1274, 5.3385, 7.0)
INT4_THRESHOLDS = (0.3646, 1.10405, 1.87505, 2.7043, 3.6324, 4.73295, 6.16925)
INT4_LEVELS = (-8.0, *(-p for p in reversed(INT4_POINTS)), 0.0, *INT4_POINTS)

# name -> (stored element dtype, qmax: the code range's largest magnitude, rotated, packed nibbles)
_FORMATS = {
    "int8": (torch.int8, 127.0, False, False),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, False, False),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, False, False),
    "int4": (torch.uint8, 7.0, True, True),
}
QUANTIZED_FORMATS = tuple(_FORMATS)
# Perplexity lost against float32 KV at 4,096 tokens of context, measured by ``pagedllm bench
# accuracy`` on SmolLM2-135M-Instruct (docs/kv_quantization.md has the command, the machine and the
# other figures). A format over ``WARN_PPL_LOSS_PCT`` is named in a warning when an engine is built.
MEASURED_PPL_LOSS_PCT = {"bfloat16": 0.004, "float16": 0.001, "int8": 0.06, "fp8_e4m3": 1.36, "fp8_e5m2": 4.72,
                         "int4": 7.55}
WARN_PPL_LOSS_PCT = 2.0


@functools.lru_cache(maxsize=8)
def _int4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(INT4_THRESHOLDS, INT4_LEVELS) as float32 tensors on ``device``, made once per device (the
    reference backend encodes and decodes every layer's rows every step)."""
    return (torch.tensor(INT4_THRESHOLDS, dtype=torch.float32, device=device),
            torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device))


def accuracy_warning(kv_cache_dtype: str) -> str | None:
    """What to say at start-up about a format that measured over ``WARN_PPL_LOSS_PCT``, or None."""
    loss = MEASURED_PPL_LOSS_PCT.get(kv_cache_dtype)
    if loss is None or loss <= WARN_PPL_LOSS_PCT:
        return None
    return (f"kv_cache_dtype={kv_cache_dtype} measured +{loss:g}% perplexity against float32 KV at 4,096 tokens "
            f"(SmolLM2-135M; docs/kv_quantization.md): expect less accurate outputs; int8 measured "
            f"+{MEASURED_PPL_LOSS_PCT['int8']:g}%")
FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def rotation(head_dim: int) -> torch.Tensor:
    """A fixed orthogonal ``[head_dim, head_dim]`` float32 matrix ``R`` (``R @ R.T == I``): the
    normalised Hadamard matrix (Sylvester's construction, symmetric) for a power of two, else a
    seeded random orthogonal one. Rows are rotated as ``x @ R`` and back as ``y @ R.T``."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` for the normalised Hadamard matrix ``H`` (last dimension a power of two), by the
    butterflies ``(a, b) -> (a + b, a - b)`` at strides 1, 2, 4, ... then one multiply by
    ``1 / sqrt(n)``: the float32 operations of the C++ store kernel's ``fwht``, in its order."""
    n = x.shape[-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, n)
        h *= 2
    return (y * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)).view(x.shape)


@dataclass(frozen=True)
class KVCodec:
    """Encode ``[T, kv_heads, head_dim]`` rows to (codes, scales ``[T, kv_heads]``) and back."""

    name: str
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in _FORMATS:
            raise ValueError(f"KVCodec: no quantized KV format {self.name!r} (formats: {QUANTIZED_FORMATS})")
        if self.packed and self.head_dim % 2:
            raise ValueError(f"KVCodec: {self.name} packs two values per byte: head_dim {self.head_dim} is odd")

    @property
    def dtype(self) -> torch.dtype:
        return _FORMATS[self.name][0]

    @property
    def qmax(self) -> float:
        return _FORMATS[self.name][1]

    @property
    def rotated(self) -> bool:
        return _FORMATS[self.name][2]

    @property
    def packed(self) -> bool:
        return _FORMATS[self.name][3]

    @property
    def code_dim(self) -> int:
        """Stored elements per row: ``head_dim``, or half of it packed two per byte."""
        return self.head_dim // 2 if self.packed else self.head_dim

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` in float32 where the format rotates, else ``x`` unchanged."""
        if not self.rotated:
            return x
        if self.head_dim & (self.head_dim - 1) == 0:
            return fwht(x.float())
        return x.float() @ rotation(self.head_dim).to(x.device)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """``y @ R.T`` (the inverse of ``rotate``), in ``y``'s dtype; ``y`` unchanged without rotation."""
        if not self.rotated:
            return y
        if self.head_dim & (self.head_dim - 1) == 0:  # the normalised Hadamard matrix is its own inverse
            return fwht(y.float()).to(y.dtype)
        return (y.float() @ rotation(self.head_dim).to(y.device).T).to(y.dtype)

    def encode(self, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[..., head_dim]`` (already rotated, for a rotated format) -> (codes, scales).
        ``static_scale`` (``kvstore/static_scales.py``: one per KV head, broadcast over the rows'
        leading dimensions) replaces the computed ``absmax / qmax``; values beyond it saturate."""
        xf = x.float()
        if static_scale is None:
            scale = (xf.abs().amax(dim=-1) / self.qmax).to(SCALE_DTYPE)
        else:
            scale = static_scale.to(SCALE_DTYPE).expand(xf.shape[:-1]).contiguous()
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).unsqueeze(-1)
        y = xf * inv
        if self.dtype.is_floating_point:  # fp8: the cast rounds to nearest even and saturates here
            return y.clamp(-self.qmax, self.qmax).to(self.dtype), scale
        if not self.packed:
            return torch.round(y).clamp(-self.qmax, self.qmax).to(self.dtype), scale
        magnitude = torch.bucketize(y.abs(), _int4_tables(y.device)[0])  # how many thresholds |y| exceeds
        u = torch.where(y < 0, 8 - magnitude, 8 + magnitude).to(torch.uint8)
        return u[..., 0::2] | (u[..., 1::2] << 4), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(codes ``[..., code_dim]``, scales ``[...]``) -> float32 rows ``[..., head_dim]``."""
        if self.packed:
            nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
            values = _int4_tables(codes.device)[1][nibbles.long()]
        else:
            values = codes.float()
        return values * scale.float().unsqueeze(-1)


def codec_for(kv_cache_dtype: str, head_dim: int) -> KVCodec | None:
    """The codec of a quantized format, or None for a float one."""
    return KVCodec(kv_cache_dtype, head_dim) if kv_cache_dtype in _FORMATS else None
