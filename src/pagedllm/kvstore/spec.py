"""KVSpec and LayerKV: what one KV block holds, and one layer's K/V tensors (with their scales).

``KVSpec`` is the KV format: element dtype, the KV heads held here (all of the model's, or one
tensor-parallel rank's share), head size, block size, layers, and the scale layout. It alone says
how many bytes a block costs (``bytes_per_block``: K and V of every layer, scales included), so
the pool's block count follows the format. ``LayerKV`` is one layer's tensors in that format:

- ``k``, ``v``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``; a token's slot
  ``block_id * block_size + offset`` indexes the flattened first two dimensions;
- ``k_scale``, ``v_scale`` (``scale_layout="per_block_head"``): float32 ``[num_blocks,
  num_kv_heads]``, one scale per block and KV head; None where the format has none.

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

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVSpec:
    """The KV format of one engine's pool (validated when built: a bad value raises naming it)."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_layers: int
    scale_layout: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        for name in ("num_kv_heads", "head_dim", "block_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, got {value!r}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"KVSpec.scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")

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
    def block_shape(self) -> tuple[int, int, int]:
        """One block of K (or V): ``(block_size, num_kv_heads, head_dim)``."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        """One block's scales of K (or V), or None without scales."""
        return (self.num_kv_heads,) if self.scale_layout == "per_block_head" else None

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K and V of one block in one layer, their scales included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scales = math.prod(self.scale_shape) * SCALE_DTYPE.itemsize if self.has_scales else 0
        return 2 * (math.prod(self.block_shape) * elem + scales)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer, scales included: what the pool is sized with."""
        return self.num_layers * self.bytes_per_block_per_layer


@dataclass(frozen=True, eq=False)
class LayerKV:
    """One layer's K/V tensors (and their scales, where the format has them)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    tensors: tuple[torch.Tensor, ...] = field(init=False, repr=False)  # every tensor, block ids first

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("LayerKV: K and V both have scales or neither has")
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype:
            raise ValueError(f"LayerKV: K {tuple(self.k.shape)} {self.k.dtype} and V {tuple(self.v.shape)} "
                             f"{self.v.dtype} differ")
        scales = () if self.k_scale is None else (self.k_scale, self.v_scale)
        object.__setattr__(self, "tensors", (self.k, self.v, *scales))

    @classmethod
    def allocate(cls, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False) -> LayerKV:
        """Zeroed tensors of ``num_blocks`` blocks in ``spec``'s format."""
        def zeros(shape, dtype):
            return torch.zeros((num_blocks, *shape), dtype=dtype, device=device, pin_memory=pin_memory)

        scales = (zeros(spec.scale_shape, SCALE_DTYPE), zeros(spec.scale_shape, SCALE_DTYPE)) if spec.has_scales \
            else (None, None)
        return cls(zeros(spec.block_shape, spec.dtype), zeros(spec.block_shape, spec.dtype), *scales)

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
