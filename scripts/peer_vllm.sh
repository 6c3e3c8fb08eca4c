#!/usr/bin/env bash
# vLLM's own CPU build serving the embedded model (as an HF folder), the peer `pagedllm bench serve`
# measures against. Needs `make peers` first. Usage: bash scripts/peer_vllm.sh [PORT] [extra vllm args...]
# Its first start compiles the model with torch inductor (about 100 s here); later starts reuse the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:-8001}"
shift $(( $# > 0 ? 1 : 0 ))
venv=.venv-peers
model=.peers/SmolLM2-135M-Instruct
if [ ! -x "$venv/bin/python" ] || [ ! -f "$model/config.json" ]; then
  echo "peer_vllm.sh: $venv or $model is missing; run \`make peers\` first" >&2
  exit 2
fi
iomp="$(find "$venv" -name libiomp5.so | head -n 1)"
export LD_PRELOAD="$iomp"                          # vLLM's CPU build expects Intel's OpenMP preloaded
export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1   # no network calls
# `python -m ...api_server`: its `vllm` command looks for a distribution named `vllm` and fails
exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name smollm \
  --host 127.0.0.1 --port "$port" --dtype bfloat16 "$@"
