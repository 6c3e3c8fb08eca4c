"""How weights split over tensor-parallel ranks: every rank's slices put back together give the
whole weight, GGUF blocks slice on their 32-value groups exactly as their dequantized floats do,
and sizes that do not divide the model are refused naming the numbers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import ConfigError
from pagedllm.models.gguf_quant import BlockQuantized
from pagedllm.models.loader import LoadedWeights
from pagedllm.parallel.shard import check_tensor_parallel, shard_blocks, shard_config, shard_weights

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=6, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=64, attention_bias=True)
SHAPES = {  # HF name -> [out, in]
    "model.layers.0.self_attn.q_proj.weight": (192, 64), "model.layers.0.self_attn.k_proj.weight": (64, 64),
    "model.layers.0.self_attn.v_proj.weight": (64, 64), "model.layers.0.self_attn.o_proj.weight": (64, 192),
    "model.layers.0.mlp.gate_proj.weight": (192, 64), "model.layers.0.mlp.up_proj.weight": (192, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 192),
}


def weights() -> LoadedWeights:
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(*shape, generator=gen) for name, shape in SHAPES.items()}
    for x in "qkv":
        rows = SHAPES[f"model.layers.0.self_attn.{x}_proj.weight"][0]
        state[f"model.layers.0.self_attn.{x}_proj.bias"] = torch.randn(rows, generator=gen)
    state["model.embed_tokens.weight"] = torch.randn(100, 64, generator=gen)
    state["model.layers.0.input_layernorm.weight"] = torch.rand(64, generator=gen)
    quantized = {name: BlockQuantized(torch.randint(0, 16, shape, dtype=torch.uint8, generator=gen),
                                      torch.rand(shape[0], shape[1] // 32, generator=gen),
                                      torch.randn(shape[0], shape[1] // 32, generator=gen))
                 for name, shape in SHAPES.items()}
    return LoadedWeights(CFG, state, Path("x.gguf"), is_gguf=True, quantized=quantized)


@pytest.mark.parametrize("world", [2])
def test_the_ranks_slices_put_together_are_the_whole_weights(world):
    whole = weights()
    shards = [shard_weights(whole, r, world) for r in range(world)]
    assert shards[0].config == shard_config(CFG, world)
    assert (shards[0].config.num_heads, shards[0].config.num_kv_heads, shards[0].config.intermediate_size) == (3, 1, 96)
    for name, tensor in whole.state_dict.items():
        parts = [s.state_dict[name] for s in shards]
        if any(p in name for p in ("o_proj", "down_proj")):
            assert torch.equal(torch.cat(parts, dim=1), tensor)  # row-parallel: columns split
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat(parts, dim=0), tensor)  # column-parallel (biases too): rows split
            assert parts[0].shape[0] == tensor.shape[0] // world
        else:
            assert all(p is tensor for p in parts)  # replicated
    for name, blocks in whole.quantized.items():  # the blocks slice as their dequantized floats do
        for r, shard in enumerate(shards):
            expected = shard_weights(LoadedWeights(CFG, {name: blocks.dequantize()}, Path("x"), False), r, world)
            assert torch.equal(shard.quantized[name].dequantize(), expected.state_dict[name])


def test_a_column_slice_that_would_split_a_group_keeps_no_blocks():
    blocks = weights().quantized["model.layers.0.self_attn.o_proj.weight"]  # 192 columns: 3 ranks of 64 fit
    assert shard_blocks("model.layers.0.self_attn.o_proj.weight", blocks, CFG, 1, 3) is not None
    narrow = dataclasses.replace(CFG, head_dim=16)
    small = BlockQuantized(blocks.codes[:, :96], blocks.scale[:, :3], blocks.minimum[:, :3])  # 96 / 2 = 48 columns
    assert shard_blocks("model.layers.0.self_attn.o_proj.weight", small, narrow, 0, 2) is None
    assert shard_blocks("model.layers.0.self_attn.q_proj.weight", small, narrow, 0, 2) is not None  # rows: always


def test_sizes_that_do_not_divide_the_model_are_refused_naming_the_numbers(monkeypatch):
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    check_tensor_parallel(smol, 3, "cpu")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 must divide the model's query heads \(9\); the "
                                          r"model has 9 query heads and 3 KV heads: tensor_parallel_size 1 or 3 work"):
        check_tensor_parallel(smol, 2, "cpu")
    with pytest.raises(ConfigError, match=r"KV heads \(2\)"):
        check_tensor_parallel(CFG, 3, "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 exceeds the GPUs here \(2\)"):
        check_tensor_parallel(smol, 3, "cuda")
    with pytest.raises(ConfigError, match="NCCL"):
        check_tensor_parallel(CFG, 2, "cuda")
