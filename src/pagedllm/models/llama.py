"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM2, Mistral, Qwen2).

GQA, RoPE (theta + scaling), optional q/k/v bias (Qwen2), tied embeddings. The forward pass
takes a flat batch of tokens (no padding) plus ``AttentionMetadata``; each layer writes its new
K/V through the slot mapping and attends through the block tables, via the attention backend.
Weights arrive as an HF-named state dict (``load_hf_state_dict``) and are fused here
(q/k/v into one projection, gate/up into one).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.kvstore.storage import KVCacheStorage
from pagedllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, rotary: RotaryEmbedding, k_cache, v_cache, meta, backend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if backend.fuses_rope:
            out = backend.rope_store_attend(qkv, rotary.cos, rotary.sin, positions, k_cache, v_cache, meta,
                                            self.num_heads)
            return self.o_proj(out.reshape(t, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = backend.store_and_attend(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rotary, k_cache, v_cache, meta, backend):
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary, k_cache, v_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype,
                                      device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCacheStorage, backend) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch, after the final norm."""
        x = self.embed_tokens(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, kv.k_caches, kv.v_caches, strict=True):
            x = layer(x, positions, self.rotary, k_cache, v_cache, meta, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (``model.layers.N.self_attn.q_proj.weight`` ...), fusing as we go."""
        cfg = self.config
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        own: dict[str, torch.Tensor] = {"embed_tokens.weight": w.pop("embed_tokens.weight"),
                                        "norm.weight": w.pop("norm.weight")}
        if self.lm_head is not None:
            own["lm_head.weight"] = w.pop("lm_head.weight", None)
            if own["lm_head.weight"] is None:
                own["lm_head.weight"] = own["embed_tokens.weight"]
        else:
            w.pop("lm_head.weight", None)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            own[a + "qkv_proj.weight"] = torch.cat(
                [w.pop(a + "q_proj.weight"), w.pop(a + "k_proj.weight"), w.pop(a + "v_proj.weight")])
            if cfg.attention_bias:
                own[a + "qkv_proj.bias"] = torch.cat(
                    [w.pop(a + "q_proj.bias"), w.pop(a + "k_proj.bias"), w.pop(a + "v_proj.bias")])
            own[a + "o_proj.weight"] = w.pop(a + "o_proj.weight")
            own[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
            own[p + "mlp.down_proj.weight"] = w.pop(p + "mlp.down_proj.weight")
            own[p + "input_layernorm.weight"] = w.pop(p + "input_layernorm.weight")
            own[p + "post_attention_layernorm.weight"] = w.pop(p + "post_attention_layernorm.weight")
        leftovers = [k for k in w if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise KeyError(f"unexpected weights: {leftovers[:5]}")
        device = self.rotary.cos.device
        own = {k: v.to(device=device, dtype=self.dtype).contiguous() for k, v in own.items()}
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise KeyError(f"weights missing {missing[:5]}, unexpected {unexpected[:5]}")
