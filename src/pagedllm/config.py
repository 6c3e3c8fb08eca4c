"""Frozen configuration objects. Building one does no I/O; a bad value raises naming its field.

``ModelConfig`` describes the network (filled by ``models.loader``); ``CacheConfig`` the KV pool;
``SchedulerConfig`` the batching limits; ``EngineConfig`` ties them together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 128
QUANTIZATIONS = ("auto", "none", "gguf")
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
    "k": 1024, "m": 1024**2, "g": 1024**3,
}


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """Parse ``512MiB`` / ``1.5GB`` / ``1048576`` into a positive byte count."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{name} must look like '512MiB', '2GB' or a byte count, got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{name} must be a byte count or a string like '512MiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``none``, ``linear`` or ``llama3`` (Llama 3.1 style)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3"):
            raise ValueError(f"rope_scaling.kind must be none, linear or llama3, got {self.kind!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: block size, and its size as bytes or as a block count."""

    block_size: int = 16
    kv_cache_memory: int | str = "512MiB"
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    kv_layout: str = "paged"
    contiguous_reservation: str = "max_model_len"
    swap_space: int | str = "256MiB"  # host tier for preemption_mode="swap"

    def __post_init__(self) -> None:
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.contiguous_reservation not in ("max_model_len", "request"):
            raise ValueError("contiguous_reservation must be 'max_model_len' or 'request', "
                             f"got {self.contiguous_reservation!r}")
        from pagedllm.kvcache.eviction import POLICIES

        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, got {self.eviction_policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or not (
                MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE):
            raise ValueError(
                f"block_size must be an integer in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
                isinstance(self.num_kv_blocks, bool) or not isinstance(self.num_kv_blocks, int)
                or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        parse_bytes(self.kv_cache_memory)
        parse_bytes(self.swap_space, "swap_space")

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``Engine`` needs besides the loaded weights."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    quantization: str = "none"   # resolved: "none" or "gguf" (see Engine.from_options for "auto")

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES[1:]:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES[1:]}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS[1:]:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]}, got {self.quantization!r}")
