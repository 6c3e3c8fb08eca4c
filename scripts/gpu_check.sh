#!/usr/bin/env bash
# GPU checks in one go, on an NVIDIA GPU machine with no network: the Triton kernels compiled for
# real (not interpreted), the engine on CUDA against HF transformers (tiny random checkpoints,
# tests/gpu), and a small paged-attention benchmark grid. Takes a few minutes (budget: under 5).
#
# It runs with the machine's own python3 (torch, triton, transformers, tokenizers, safetensors,
# numpy, pytest, ...) and src/ on PYTHONPATH; nothing is installed from the network. What that
# python lacks (gguf, pydantic and pydantic's own dependencies, a newer typing_extensions among
# them) comes along as wheels built here by
# `make gpu-wheels` into .gpu-wheels/, which this script unpacks into .gpu-site/.
#
# Through the session's device tool, which copies the working tree but git-ignored paths only
# when they are named in `carry`:
#   make gpu-wheels                                   # here, once (needs the network)
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=360)
# Results go to $OUT when it is set (the device tool brings that folder back), else to the folder
# given as $1, else gpu_results/. The exit status is the tests' (the benchmark runs regardless).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${1:-${OUT:-gpu_results}}"
python="${PYTHON:-python3}"
mkdir -p "$out"

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || { cat "$out/nvidia-smi.txt"; echo "no usable NVIDIA GPU here"; exit 1; }
head -n 15 "$out/nvidia-smi.txt"

# The packages this python lacks, from the wheels carried along (pip cannot reach an index here).
rm -rf .gpu-site
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  if "$python" -m pip --version > /dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --disable-pip-version-check --target .gpu-site .gpu-wheels/*.whl
  else  # no pip: a wheel is a zip file laid out as site-packages
    for wheel in .gpu-wheels/*.whl; do "$python" -m zipfile -e "$wheel" .gpu-site; done
  fi
else
  echo "WARNING: no .gpu-wheels/ (run 'make gpu-wheels' and carry .gpu-wheels): gguf and pydantic stay missing"
fi

export PYTHONPATH="$root/src:$root/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET                       # compiled Triton kernels, not the CPU interpreter
export PAGEDLLM_CACHE_DIR="${PAGEDLLM_CACHE_DIR:-$root/.cache-gpu}"

"$python" - <<'EOF' 2>&1 | tee "$out/versions.txt"
import importlib
import torch, triton, transformers
print("python", __import__("sys").version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__, "|", torch.cuda.get_device_name())
for name in ("gguf", "pydantic"):  # brought as wheels; pagedllm.config needs pydantic
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", ""), "from", module.__file__)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(name, "does not import:", type(e).__name__, e)
EOF

tests_status=0
timeout 200 "$python" -m pytest -q -p no:cacheprovider tests/unit/test_triton_kernel.py tests/gpu 2>&1 \
  | tee "$out/tests.txt" || tests_status=$?

# A small grid (8 cases, well under a minute): decode attention, Triton vs the torch reference vs
# SDPA over a contiguous cache. No --plot: matplotlib is not on this machine (plot it elsewhere
# from attention.json).
timeout 90 "$python" -m pagedllm.cli bench attention --device cuda --backends triton,reference \
  --dtype bfloat16,float16 --batch 1,32 --context 512,4096 --block-size 16 --repeats 10 \
  --json "$out/attention.json" 2>&1 | tee "$out/attention.txt" || echo "attention benchmark failed: status $?"

echo "GPU check done: results in $out, tests exit status $tests_status"
exit "$tests_status"
