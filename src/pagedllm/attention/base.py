"""The interface every attention backend implements (reference, cpu, triton).

A backend reads and writes one layer's KV as a ``LayerKV`` (``kvstore/spec.py``): K, V and,
where the KV format has them, their scales. ``scale_layouts`` says which formats a backend reads;
the engine asks ``check_kv_spec`` before it allocates the pool, so a format a backend cannot
read is refused when the engine is built, never met in a step.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.errors import ConfigError
from pagedllm.kvstore.spec import KVSpec, LayerKV


class AttentionBackend:
    """``write_kv`` stores a step's new K/V rows through the slot mapping; ``forward`` attends
    through the block tables; ``store_and_attend`` does both (fused where a backend can)."""

    name = "base"
    fuses_rope = False  # True: ``rope_store_attend`` takes the raw qkv rows and applies RoPE itself
    scale_layouts = ("none",)  # the KVSpec scale layouts this backend reads
    quant_formats: tuple[str, ...] = ()  # the quantized KV formats (kvstore/quant.py) it reads

    def check_kv_spec(self, spec: KVSpec, model_dtype: torch.dtype) -> None:
        """Raise ``ConfigError`` naming what this backend cannot read in ``spec``."""
        if spec.quant != "none":
            if spec.quant not in self.quant_formats:
                reads = ", ".join(self.quant_formats) or "none"
                raise ConfigError(f"the {self.name} attention backend reads no kv_cache_dtype={spec.quant} KV "
                                  f"(the quantized formats it reads: {reads}); the reference backend reads every one")
            return
        if spec.scale_layout not in self.scale_layouts:
            raise ConfigError(f"the {self.name} attention backend reads no KV with scale layout "
                              f"{spec.scale_layout!r} (it reads {', '.join(self.scale_layouts)})")
        if spec.dtype != model_dtype:
            raise ConfigError(f"the {self.name} attention backend reads KV in the model's dtype ({model_dtype}), "
                              f"not {spec.dtype} (kv_cache_dtype); the reference backend reads any")

    def write_kv(self, kv: LayerKV, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def forward(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def store_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV,
                         meta: AttentionMetadata) -> torch.Tensor:
        self.write_kv(kv, key, value, meta)
        return self.forward(query, kv, meta)
