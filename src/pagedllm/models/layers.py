"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP.

Numerics follow HF transformers (RMSNorm in float32 then cast; RoPE cos/sin computed in float32
and cast to the activation dtype) so greedy outputs match it token for token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.config import RopeScaling
from pagedllm.models.layer_ops import rms_norm
from pagedllm.models.quantized_linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    arange = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
    inv_freq = 1.0 / (theta ** (arange / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position (rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        freqs = torch.arange(max_positions, dtype=torch.float, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, KH, D] -> rotated (new tensors)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    _projections = None  # (gate_up_proj, down_proj) as a plain tuple: no nn.Module.__getattr__ per step

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``ops.silu_mul`` (``layer_ops``) splits the fused gate/up rows."""
        projections = self._projections
        if projections is None:  # a GatedMLP used alone; in a model, finalize binds them
            projections = self._projections = (self.gate_up_proj, self.down_proj)
        gate_up, down = projections
        return down.forward(ops.silu_mul(gate_up.forward(x)))
