"""Write the embedded GGUF model as an HF folder (bf16 safetensors + tokenizer + config), for peers
that cannot read GGUF (vLLM's CPU build). Usage: python scripts/export_hf.py OUT_DIR [--dtype bfloat16]

Uses HF transformers' own GGUF loader (which undoes llama.cpp's Q/K permutation), so the folder is
exactly what `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` sees; pagedllm's parity tests
check that this equals pagedllm's own loading.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.models.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
    print(f"wrote {args.out} ({args.dtype}) from {gguf.name}")


if __name__ == "__main__":
    main()
