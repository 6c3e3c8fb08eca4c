"""KVSpec and LayerKV: what one KV block holds, and one layer's K/V tensors (with their scales).

``KVSpec`` is the KV format: element dtype, the KV heads held here (all of the model's, or one
tensor-parallel rank's share), head size, block size, layers, and the scale layout. It alone says
how many bytes a block costs (``bytes_per_block``: K and V of every layer, scales included), so
the pool's block count follows the format. ``LayerKV`` is one layer's tensors in that format:

- ``k``, ``v``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``; a token's slot
  ``block_id * block_size + offset`` indexes the flattened first two dimensions;
- ``k_scale``, ``v_scale``: ``scale_layout="per_token_head"`` (the quantized formats of
  ``kvstore/quant.py``, ``quant`` naming which): bfloat16 ``[num_blocks, block_size, num_kv_heads]``,
  one scale per token row (computed on write, or the layer's ``static_scales`` where the
  ``kv_cache_scales`` option fixes them); ``"per_block_head"``: float32 ``[num_blocks, num_kv_heads]``; None where
  the format has none. A packed format (``int4``) stores ``head_dim // 2`` bytes per row.

Everything that moves blocks (the storage's copy-on-write, the host tier's swaps) moves every
tensor of ``LayerKV.tensors`` with the same block ids, so a format with scales needs no change
there; every attention backend and the C++ decoder stack take a ``LayerKV`` and refuse a format
they do not read (``AttentionBackend.check_kv_spec``). A new KV format is a new spec and kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedllm.config import KV_SCALE_LAYOUTS as SCALE_LAYOUTS
from pagedllm.config import ModelConfig
from pagedllm.kvstore.quant import FLOAT_FORMATS, QUANTIZED_FORMATS, KVCodec
from pagedllm.kvstore.quant import SCALE_DTYPE as QUANT_SCALE_DTYPE

SCALE_DTYPES = {"per_block_head": torch.float32, "per_token_head": QUANT_SCALE_DTYPE}
SCALE_DTYPE = SCALE_DTYPES["per_block_head"]


@dataclass(frozen=True)
class KVSpec:
    """The KV format of one engine's pool (validated when built: a bad value raises naming it)."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_layers: int
    scale_layout: str = "none"
    quant: str = "none"  # a quantized format of kvstore/quant.py (its codec), or none: values stored as dtype

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        for name in ("num_kv_heads", "head_dim", "block_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, got {value!r}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"KVSpec.scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        if self.quant != "none":
            codec = KVCodec(self.quant, self.head_dim)  # raises on an unknown format or an odd head size
            if self.dtype != codec.dtype or self.scale_layout != "per_token_head":
                raise ValueError(f"KVSpec: {self.quant} KV is stored as {codec.dtype} with per_token_head scales, "
                                 f"not {self.dtype} with {self.scale_layout}")

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, dtype: torch.dtype, scale_layout: str = "none",
                  num_kv_heads: int | None = None) -> KVSpec:
        """The spec for ``model``'s layers and head size (``num_kv_heads``: the heads held here,
        all of the model's by default)."""
        return cls(dtype, num_kv_heads or model.num_kv_heads, model.head_dim, block_size, model.num_layers,
                   scale_layout)

    @property
    def has_scales(self) -> bool:
        return self.scale_layout != "none"

    @property
    def codec(self) -> KVCodec | None:
        """How rows are encoded and decoded (a quantized format), or None (values stored as ``dtype``)."""
        return None if self.quant == "none" else KVCodec(self.quant, self.head_dim)

    @property
    def kv_cache_dtype(self) -> str:
        """The format's name as the ``kv_cache_dtype`` option spells it."""
        if self.quant != "none":
            return self.quant
        return next((name for name, dtype in FLOAT_FORMATS.items() if dtype == self.dtype), str(self.dtype))

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of K (or V): ``(block_size, num_kv_heads, head_dim)`` (half the head size packed)."""
        dim = self.codec.code_dim if self.quant != "none" else self.head_dim
        return (self.block_size, self.num_kv_heads, dim)

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        """One block's scales of K (or V), or None without scales."""
        if self.scale_layout == "per_token_head":
            return (self.block_size, self.num_kv_heads)
        return (self.num_kv_heads,) if self.scale_layout == "per_block_head" else None

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return SCALE_DTYPES.get(self.scale_layout)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K and V of one block in one layer, their scales included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scales = math.prod(self.scale_shape) * self.scale_dtype.itemsize if self.has_scales else 0
        return 2 * (math.prod(self.block_shape) * elem + scales)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer, scales included: what the pool is sized with."""
        return self.num_layers * self.bytes_per_block_per_layer


def kv_spec_for(model: ModelConfig, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype,
                num_kv_heads: int | None = None) -> KVSpec:
    """The spec of a ``kv_cache_dtype`` option: ``auto`` (the model's dtype), a float dtype, or a
    quantized format (``kvstore/quant.py``: int8, fp8_e4m3, fp8_e5m2, int4)."""
    if kv_cache_dtype == "auto":
        return KVSpec.for_model(model, block_size, model_dtype, num_kv_heads=num_kv_heads)
    if kv_cache_dtype in FLOAT_FORMATS:
        return KVSpec.for_model(model, block_size, FLOAT_FORMATS[kv_cache_dtype], num_kv_heads=num_kv_heads)
    if kv_cache_dtype not in QUANTIZED_FORMATS:
        raise ValueError(f"kv_cache_dtype must be auto, one of {tuple(FLOAT_FORMATS)} or of {QUANTIZED_FORMATS}, "
                         f"got {kv_cache_dtype!r}")
    codec = KVCodec(kv_cache_dtype, model.head_dim)
    return KVSpec(codec.dtype, num_kv_heads or model.num_kv_heads, model.head_dim, block_size, model.num_layers,
                  "per_token_head", kv_cache_dtype)


def as_movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as something block copies can index (torch's CPU index_copy_ has no fp8 kernel:
    an fp8 tensor is moved as its bytes)."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor


@dataclass(frozen=True, eq=False)
class LayerKV:
    """One layer's K/V tensors (and their scales, where the format has them)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    codec: KVCodec | None = None  # how the stored codes decode (a quantized format), or None
    # kv_cache_scales (kvstore/static_scales.py): float32 [2, kv_heads], K's row then V's, used
    # instead of scales computed on write; None: computed. Not indexed by block: never moved.
    static_scales: torch.Tensor | None = None
    tensors: tuple[torch.Tensor, ...] = field(init=False, repr=False)  # every tensor, block ids first
    # what the C++ kernels take: ``tensors``, then the static scales where there are some
    kernel_tensors: tuple[torch.Tensor, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("LayerKV: K and V both have scales or neither has")
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype:
            raise ValueError(f"LayerKV: K {tuple(self.k.shape)} {self.k.dtype} and V {tuple(self.v.shape)} "
                             f"{self.v.dtype} differ")
        if (self.codec is not None) != (self.k_scale is not None and self.k_scale.dim() == 3):
            raise ValueError("LayerKV: a quantized format has per-token scales, and only it")
        if self.static_scales is not None:
            heads = self.k.shape[2]
            if self.codec is None:
                raise ValueError("LayerKV: static scales are for a quantized KV format (int8, fp8, int4)")
            if self.static_scales.shape != (2, heads) or self.static_scales.dtype != torch.float32:
                raise ValueError(f"LayerKV: static scales must be float32 [2, {heads}], got "
                                 f"{self.static_scales.dtype} {tuple(self.static_scales.shape)}")
        scales = () if self.k_scale is None else (self.k_scale, self.v_scale)
        object.__setattr__(self, "tensors", (self.k, self.v, *scales))
        static = () if self.static_scales is None else (self.static_scales.contiguous(),)
        object.__setattr__(self, "kernel_tensors", (*self.tensors, *static))

    @classmethod
    def allocate(cls, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False, static_scales: torch.Tensor | None = None) -> LayerKV:
        """Zeroed tensors of ``num_blocks`` blocks in ``spec``'s format (``static_scales``: see the field)."""
        def zeros(shape, dtype):
            return torch.zeros((num_blocks, *shape), dtype=dtype, device=device, pin_memory=pin_memory)

        scales = (zeros(spec.scale_shape, spec.scale_dtype), zeros(spec.scale_shape, spec.scale_dtype)) \
            if spec.has_scales \
            else (None, None)
        static = None if static_scales is None else static_scales.to(device=device, dtype=torch.float32)
        return cls(zeros(spec.block_shape, spec.dtype), zeros(spec.block_shape, spec.dtype), *scales, spec.codec,
                   static)

    @property
    def has_scales(self) -> bool:
        return self.k_scale is not None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
