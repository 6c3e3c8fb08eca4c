"""Per-token layer ops: RMSNorm, residual add fused with RMSNorm, SiLU-and-multiply.

``TorchLayerOps`` defines the numerics (HF transformers' order of float32 maths and rounding);
``CpuLayerOps`` runs each op as one call into C++ (``csrc/layer_ops.h``, bound by
``models/csrc/layer_ops_cpu.cpp``), which rounds where torch rounds, so only the order of the RMS
sum differs. At batch 1 a decoder layer is a dozen tiny ops, and their Python dispatch costs more
than their arithmetic: the fused ops cut the calls per layer from ~25 to ~9 (and the C++ decoder
stack, ``decoder_stack``, to none). ``get_layer_ops`` picks C++ on CPU when it builds.

``add_rms_norm(x, residual, ...)`` returns ``(norm(x + residual), x + residual)``; the C++ version
updates ``residual`` in place, so callers must own it (the model's forward does).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.cpu_extension import CppExtension

EXTENSION = CppExtension("pagedllm_layer_ops", Path(__file__).parent / "csrc" / "layer_ops_cpu.cpp",
                         "the C++ layer ops", "using torch ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale in the weight's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        residual = x if residual is None else x + residual
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def row_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its largest value (a NaN the largest), int64 [rows]."""
        return x.max(dim=-1).indices


class CpuLayerOps(TorchLayerOps):
    name = "cpu"

    def __init__(self, module) -> None:
        self.ops = module

    def rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self.ops.rms_norm(x, weight, eps), x
        return self.ops.add_rms_norm_(x, residual, weight, eps), residual

    def silu_mul(self, gate_up):
        return self.ops.silu_mul(gate_up)

    def row_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch's pick in one vectorised pass per row: 0.17 -> 0.03 ms for 8 rows of SmolLM2's 49,152
        logits (docs/design.md); float32 and bfloat16 CPU rows, torch's ``max`` for any other."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.shape[1]:
            return super().row_argmax(x)
        return self.ops.row_argmax(x)

    def q8_0_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self.ops.q8_0_linear(x, codes, scales)

    def q4_linear(self, x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
        return self.ops.q4_linear(x, codes, scale_min)

    def q4_tiles_linear(self, x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor,
                        bf16_out: bool = False) -> torch.Tensor:
        """float32 out, or bfloat16 (rounded in the kernel) with ``bf16_out``."""
        return self.ops.q4_tiles_linear(x, codes, scale_min, bf16_out)

    def q8_0_tiles_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          bf16_out: bool = False) -> torch.Tensor:
        """float32 out, or bfloat16 (rounded in the kernel) with ``bf16_out``."""
        return self.ops.q8_0_tiles_linear(x, codes, scales, bf16_out)

    def has_bf16_tiles(self) -> bool:
        """Whether this build has the AVX-512 BF16 tile kernels (``csrc/bf16_tiles.h``)."""
        return self.ops.has_bf16_tiles()


def get_layer_ops(device: str | torch.device) -> TorchLayerOps:
    """C++ ops on CPU when they build (warns once if not), torch ops elsewhere."""
    if torch.device(device).type == "cpu":
        module = EXTENSION.load()
        if module is not None:
            return CpuLayerOps(module)
    return TorchLayerOps()
