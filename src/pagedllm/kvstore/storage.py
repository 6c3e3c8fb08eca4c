"""KVCacheStorage: every layer's K/V (``LayerKV``) in one ``KVSpec``, allocated once.

Sizing converts a memory budget into a block count with the spec's ``bytes_per_block`` (K and V
of every layer, scales included), so a format with more bytes per block holds fewer blocks in the
same ``kv_cache_memory``. Block copies (copy-on-write after a fork) move every tensor of every
layer's ``LayerKV`` with the same block ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pagedllm.config import CacheConfig
from pagedllm.errors import ConfigError, OutOfKVMemory
from pagedllm.kvstore.spec import KVSpec, LayerKV, as_movable
from pagedllm.kvstore.static_scales import StaticKVScales


def num_blocks_for(spec: KVSpec, cache: CacheConfig, device: str = "cpu") -> int:
    """Blocks in the pool: ``num_kv_blocks`` if given, else what ``kv_cache_memory`` holds."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = spec.bytes_per_block
    memory, what = kv_pool_bytes(cache.kv_cache_memory, device)
    n = memory // per_block
    if n < 1:
        raise OutOfKVMemory(f"kv_cache_memory={what} holds no KV block: one block of "
                            f"{spec.block_size} tokens needs {per_block} bytes for this model and KV format")
    return n


def free_device_memory(device: str | torch.device) -> int:
    """Bytes free on ``device`` now: the GPU's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_pool_bytes(kv_cache_memory, device: str | torch.device) -> tuple[int, str]:
    """(bytes, how to name them in an error) for a ``kv_cache_memory`` of bytes or a share ("25%")
    of the device's free memory when the engine is built (after the weights are loaded)."""
    if isinstance(kv_cache_memory, str):
        share = float(kv_cache_memory.strip().rstrip("%")) / 100
        free = free_device_memory(device)
        return int(share * free), f"{kv_cache_memory.strip()} of {free / 2**30:.2f} GiB free"
    return int(kv_cache_memory), kv_cache_memory.human_readable(decimal=False)


def static_kv_scales(cache: CacheConfig, spec: KVSpec, rank: int = 0, world_size: int = 1) -> StaticKVScales | None:
    """The ``kv_cache_scales`` option read for ``spec``'s layers and KV heads, or None (scales
    computed on write); a ``ConfigError`` naming what is wrong, or that ``spec`` is not quantized.
    Under tensor parallelism ``spec`` holds rank ``rank``'s heads of the model's ``world_size`` times
    as many: the option is read for the model's heads, and the rank's share kept."""
    if cache.kv_cache_scales is None:
        return None
    if spec.quant == "none":
        raise ConfigError(f"kv_cache_scales: static scales are for the quantized KV formats (int8, fp8_e4m3, "
                          f"fp8_e5m2, int4), not kv_cache_dtype={spec.kv_cache_dtype}")
    try:
        scales = StaticKVScales.parse(cache.kv_cache_scales, spec.num_layers, spec.num_kv_heads * world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return scales.heads(rank * spec.num_kv_heads, spec.num_kv_heads) if world_size > 1 else scales


@dataclass
class KVCacheStorage:
    """Pre-allocated K/V of every layer, one ``LayerKV`` each, in the format ``spec``."""

    spec: KVSpec
    layers: list[LayerKV]
    layer_tensors: list[tuple[torch.Tensor, ...]] = field(init=False, repr=False)  # for the C++ decoder stack

    def __post_init__(self) -> None:
        if len(self.layers) != self.spec.num_layers:
            raise ValueError(f"KVCacheStorage: {len(self.layers)} layers for a spec of {self.spec.num_layers}")
        self.layer_tensors = [layer.kernel_tensors for layer in self.layers]

    @classmethod
    def allocate(cls, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu",
                 static_scales: StaticKVScales | None = None) -> KVCacheStorage:
        """Zeroed layers; ``static_scales`` (the ``kv_cache_scales`` option) fixes each layer's scales."""
        return cls(spec, [LayerKV.allocate(spec, num_blocks, device,
                                           static_scales=None if static_scales is None else static_scales.layer(i))
                          for i in range(spec.num_layers)])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every tensor of every layer: copy-on-write after a fork."""
        device = self.layers[0].k.device
        src = torch.tensor([c[0] for c in copies], device=device)
        dst = torch.tensor([c[1] for c in copies], device=device)
        for layer in self.layers:
            for tensor in map(as_movable, layer.tensors):
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
