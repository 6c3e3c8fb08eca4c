"""``pagedllm bench matmul``: the decode step's matmul kernels, per projection of the default model.

For each projection shape of the embedded SmolLM2 (fused qkv, o, fused gate_up, down, LM head)
and each row count (tokens in the step), times in one process: ``F.linear`` on the dense bf16
weight (what HF and the first engine used), the same weight prepacked for oneDNN
(``prepack_for_onednn``, identical results), the weight widened to float32 and prepacked, timed
with the activation's widening and the output's rounding as the engine runs it on a CPU without
native bf16 (``cpu_features.matmul_dtype``), the same float32 weight unpacked (MKL's sgemm: the
path where oneDNN packs no float32), the same float32 weight as panels for our AVX2 GEMM
(``panels_fp32``, ``csrc/panel_gemm.h``: where the C++ layer ops have it), and the weight-only
kernel over the GGUF's own blocks (for the Q4_1 projections torch's int4 kernel, ``gguf_blocks``, and our C++ 4-bit one,
``gguf_blocks_cpp``; the C++ Q8_0 kernel for the LM head), and ``quantization="int8"``'s two paths
(``int8_channel``: torch's weight-only int8 kernel; ``int8_dequant``: the weight dequantized per
call, then the dense GEMM). The per-layer total
shows where the quantized path stops paying (each family's crossovers: ``kernel_plan``). A
packing oneDNN does not do on this CPU (``CpuFeatures.onednn_packs``) is not timed, and the
report says why. Weights are
the real ones, so the quantized kernels see their real block layout. Medians of repeated calls.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.bench.timers import median_ms


def _widened(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    from pagedllm.models.quantized_linear import onednn_linear

    return onednn_linear(x.float(), packed, None).to(x.dtype)


def _plain_widened(x: torch.Tensor, weight32: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight32).to(x.dtype)


def _panels(ops, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    return ops.panel_linear(x, panels, None, n).to(x.dtype)  # widens x inside, as the engine's Linear


def main(args) -> dict:
    from pagedllm import cpu_features
    from pagedllm.models.gguf_quant import BlockQuantized
    from pagedllm.models.layer_ops import get_layer_ops
    from pagedllm.models.loader import load_weights, resolve_model_path
    from pagedllm.models.quantized_linear import (
        Int8ChannelMatmul,
        onednn_linear,
        pack_panels,
        prepack_for_onednn,
        quantized_matmul,
    )

    cpu = cpu_features.current()
    weights = load_weights(resolve_model_path(args.model))
    if not weights.quantized:
        raise SystemExit("bench matmul needs a GGUF model with Q4_0/Q4_1/Q8_0 tensors")
    q, sd, ops = weights.quantized, weights.state_dict, get_layer_ops("cpu")
    p = "model.layers.0."
    groups = {
        "qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        "o": [p + "self_attn.o_proj.weight"],
        "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "down": [p + "mlp.down_proj.weight"],
        "lm_head": ["model.embed_tokens.weight" if "lm_head.weight" not in q else "lm_head.weight"],
    }
    rows_list = [int(r) for r in args.rows.split(",")]
    report = {"rows": rows_list, "cpu": cpu.describe(), "projections": {}, "not_timed": {}}
    if not cpu.onednn_packs(torch.bfloat16):
        report["not_timed"]["prepacked"] = (f"oneDNN packs no bf16 weight on this CPU ({cpu.family}: "
                                            "needs AVX-512 or AVX-NE-CONVERT)")
    if not cpu.onednn_packs(torch.float32):
        report["not_timed"]["prepacked_fp32"] = f"oneDNN packs no float32 weight on this CPU ({cpu.family})"
    cpp = getattr(ops, "ops", None)
    has_tiles = cpp is not None and cpp.has_bf16_tiles()
    if not has_tiles:
        report["not_timed"]["gguf_blocks_tiles"] = "the C++ layer ops have no AVX-512 BF16 tile kernels here"
    has_panels = cpp is not None and cpp.has_panel_linear()
    if not has_panels:
        report["not_timed"]["panels_fp32"] = "the C++ layer ops have no AVX2 panel GEMM here"
    print(f"CPU: {cpu.describe()}")
    for kind, why in report["not_timed"].items():
        print(f"not timed: {kind}: {why}")
    gen = torch.Generator().manual_seed(args.seed)
    for name, parts in groups.items():
        dense = torch.cat([sd[n] for n in parts]).to(torch.bfloat16).contiguous()
        packed = prepack_for_onednn(dense)
        packed32 = prepack_for_onednn(dense, torch.float32)
        dense32 = dense.float()
        panels = pack_panels(dense) if has_panels else None
        blocks = BlockQuantized.cat([q[n] for n in parts])
        kernels = {"gguf_blocks": quantized_matmul(blocks, torch.bfloat16, ops)}  # torch's int4, or our Q8_0
        if blocks.bits == 4 and hasattr(ops, "q4_linear"):
            kernels["gguf_blocks_cpp"] = quantized_matmul(blocks, torch.bfloat16, ops, "cpp")
        if has_tiles:  # our AVX-512 BF16 tile kernels, 4-bit and Q8_0
            kernels["gguf_blocks_tiles"] = quantized_matmul(blocks, torch.bfloat16, ops, "tiles", "tiles")
        int8 = Int8ChannelMatmul.quantize(dense)  # quantization="int8": its kernel, and its path above int8_rows
        kernels["int8_channel"] = int8
        kernels["int8_dequant"] = partial(int8.dense, bias=None)
        per_rows = {}
        for rows in rows_list:
            x = torch.randn(rows, dense.shape[1], generator=gen).bfloat16()
            t = {"dense": median_ms(partial(F.linear, x, dense), args.repeats)}
            if packed is not None:
                t["prepacked"] = median_ms(partial(onednn_linear, x, packed, None), args.repeats)
            t["plain_fp32"] = median_ms(partial(_plain_widened, x, dense32), args.repeats)
            if packed32 is not None:
                t["prepacked_fp32"] = median_ms(partial(_widened, x, packed32), args.repeats)
            if panels is not None:
                t["panels_fp32"] = median_ms(partial(_panels, cpp, x, panels, dense.shape[0]), args.repeats)
            for kind, kernel in kernels.items():
                if kernel is not None:
                    t[kind] = median_ms(partial(kernel, x), args.repeats)
            per_rows[rows] = t
            print(f"{name:<8} {tuple(dense.shape)!s:<14} rows={rows:<4} "
                  + "  ".join(f"{k}={v:.3f}ms" for k, v in t.items()))
        report["projections"][name] = {"shape": list(dense.shape), "ms": per_rows}
    print("per layer (qkv + o + gate_up + down), ms:")
    for rows in rows_list:
        kinds = report["projections"]["qkv"]["ms"][rows].keys()
        totals = {k: sum(report["projections"][g]["ms"][rows][k] for g in ("qkv", "o", "gate_up", "down"))
                  for k in kinds}
        print(f"  rows={rows:<4} " + "  ".join(f"{k}={v:.3f}" for k, v in totals.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench matmul``'s flags."""
    p.add_argument("--model", default=None)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--repeats", type=int, default=50)
