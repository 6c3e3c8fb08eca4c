"""How a Llama-family model splits over ``world_size`` ranks (Megatron-style tensor parallelism).

Rank ``r`` holds query heads ``r * H/N ...`` and KV heads ``r * KH/N ...`` (its ``KVSpec`` has
``KH/N`` heads: each rank's pool stores only its heads, under the same block ids), and the MLP's
intermediate channels ``r * I/N ...``. Column-parallel (rows of the weight sliced): ``q_proj``,
``k_proj``, ``v_proj`` (each sliced on its own, before the model fuses them), ``gate_proj``,
``up_proj``, and the q/k/v biases. Row-parallel (columns sliced; the partial outputs summed by an
all-reduce): ``o_proj`` and ``down_proj``. Embeddings, norms and the LM head are replicated (the
vocabulary of the models here is small next to the layers; rank 0 alone computes logits).
GGUF/AWQ block-quantized weights (32 values a group) are sliced the same way, columns only on a
group boundary; a shard that would split a group keeps no blocks (its dequantized float weight
serves, and the start-up log says so).

The local model is the same network with ``shard_config``'s shape, so every layer, kernel and
attention backend runs unchanged on a shard.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import ConfigError
from pagedllm.models.gguf_quant import BLOCK, BlockQuantized
from pagedllm.models.loader import LoadedWeights

log = logging.getLogger(__name__)


def check_tensor_parallel(cfg: ModelConfig, world_size: int, device: str) -> None:
    """``ConfigError`` naming the numbers unless ``world_size`` divides the model's query heads, KV
    heads and MLP width (and, on CUDA, there are that many GPUs); a warning when it exceeds the CPU
    cores (the ranks then share cores)."""
    if world_size == 1:
        return
    for what, n in (("query heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % world_size:
            raise ConfigError(f"tensor_parallel_size={world_size} must divide the model's {what} ({n}); the model "
                              f"has {cfg.num_heads} query heads and {cfg.num_kv_heads} KV heads: "
                              f"{_divisors(cfg)} work")
    if device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise ConfigError(f"tensor_parallel_size={world_size} exceeds the GPUs here ({gpus})")
        raise ConfigError("tensor_parallel_size > 1 runs on CPU (gloo) so far: CUDA needs NCCL and one device per "
                          "rank, not built yet (docs/tensor_parallel.md)")
    elif world_size > (os.cpu_count() or 1):
        log.warning("tensor_parallel_size=%d exceeds the %d CPU cores here: the ranks share cores", world_size,
                    os.cpu_count() or 1)


def _divisors(cfg: ModelConfig) -> str:
    ok = [n for n in range(1, cfg.num_kv_heads + 1)
          if not (cfg.num_heads % n or cfg.num_kv_heads % n or cfg.intermediate_size % n)]
    return "tensor_parallel_size " + " or ".join(map(str, ok))


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape of one rank's share of the model."""
    if world_size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size)


def _rule(name: str) -> tuple[str, str] | None:
    """(which size the slice counts in, "rows" or "cols") for a weight that is split, else None."""
    for part, rule in ((".self_attn.q_proj.", ("q", "rows")), (".self_attn.k_proj.", ("kv", "rows")),
                       (".self_attn.v_proj.", ("kv", "rows")), (".self_attn.o_proj.", ("q", "cols")),
                       (".mlp.gate_proj.", ("mlp", "rows")), (".mlp.up_proj.", ("mlp", "rows")),
                       (".mlp.down_proj.", ("mlp", "cols"))):
        if part in name:
            return rule
    return None


def _span(cfg: ModelConfig, which: str, rank: int, world_size: int) -> tuple[int, int]:
    width = {"q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim,
             "mlp": cfg.intermediate_size}[which] // world_size
    return rank * width, (rank + 1) * width


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the HF-named weight ``name`` (the whole tensor where it is replicated)."""
    rule = _rule(name)
    if rule is None or world_size == 1:
        return tensor
    lo, hi = _span(cfg, rule[0], rank, world_size)
    if rule[1] == "rows" or tensor.dim() == 1:  # a bias belongs to a column-parallel projection
        return tensor[lo:hi].contiguous()
    return tensor[:, lo:hi].contiguous()


def shard_blocks(name: str, blocks: BlockQuantized, cfg: ModelConfig, rank: int,
                 world_size: int) -> BlockQuantized | None:
    """The blocks of ``name`` for rank ``rank``; None where a column slice would split a 32-value group."""
    rule = _rule(name)
    if rule is None or world_size == 1:
        return blocks
    lo, hi = _span(cfg, rule[0], rank, world_size)
    if rule[1] == "rows":
        return blocks.map_rows(lambda t: t[lo:hi].contiguous())
    if lo % BLOCK or hi % BLOCK:
        return None
    minimum = None if blocks.minimum is None else blocks.minimum[:, lo // BLOCK:hi // BLOCK].contiguous()
    return BlockQuantized(blocks.codes[:, lo:hi].contiguous(), blocks.scale[:, lo // BLOCK:hi // BLOCK].contiguous(),
                          minimum)


def shard_weights(weights: LoadedWeights, rank: int, world_size: int) -> LoadedWeights:
    """Rank ``rank``'s weights (its ``config`` the shard's, ``shard_config``)."""
    if world_size == 1:
        return weights
    cfg = weights.config
    state = {k: shard_tensor(k, v, cfg, rank, world_size) for k, v in weights.state_dict.items()}
    quantized, split = {}, []
    for name, blocks in weights.quantized.items():
        part = shard_blocks(name, blocks, cfg, rank, world_size)
        if part is None:
            split.append(name)
        else:
            quantized[name] = part
    if split and rank == 0:
        log.warning("tensor parallel: %d block-quantized weights would split a %d-value group (e.g. %s): their "
                    "float weights serve", len(split), BLOCK, split[0])
    return dataclasses.replace(weights, config=shard_config(cfg, world_size), state_dict=state, quantized=quantized)
