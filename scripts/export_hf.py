"""Write the embedded GGUF model as an HF folder (bf16 safetensors + tokenizer + config), for peers
that cannot read GGUF (vLLM's CPU build). Usage: python scripts/export_hf.py OUT_DIR [--dtype bfloat16]
[--awq GROUP]

``--awq 64``: the projections stored AWQ-quantized instead (AutoAWQ's GEMM packing, rounded to
nearest per group of 64 inputs: SmolLM2's 576 inputs are no whole number of 128-groups), for
timing pagedllm's AWQ path on a real-sized model (docs/design.md).

Uses HF transformers' own GGUF loader (which undoes llama.cpp's Q/K permutation), so the folder is
exactly what `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` sees; pagedllm's parity tests
check that this equals pagedllm's own loading.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.models.awq import pack_columns, round_to_groups
from pagedllm.models.loader import default_model_path


def quantize_projections(out: Path, group: int) -> None:
    """Rewrite ``out``'s safetensors with every ``*_proj.weight`` as AWQ qweight/qzeros/scales."""
    state = load_file(out / "model.safetensors")
    for key in [k for k in state if k.endswith("_proj.weight")]:
        codes, zeros, scales = round_to_groups(state.pop(key), group)
        prefix = key.removesuffix(".weight")
        state |= {f"{prefix}.qweight": pack_columns(codes), f"{prefix}.qzeros": pack_columns(zeros),
                  f"{prefix}.scales": scales}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                     "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--awq", type=int, metavar="GROUP", help="store the projections AWQ-quantized")
    args = parser.parse_args()
    gguf = default_model_path()
    dtype = getattr(torch, args.dtype)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # HF marks GGUF-loaded models as not serializable
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(args.out)
    if args.awq:
        quantize_projections(args.out, args.awq)
    print(f"wrote {args.out} ({args.dtype}{f', AWQ group {args.awq}' if args.awq else ''}) from {gguf.name}")


if __name__ == "__main__":
    main()
