#!/usr/bin/env bash
# llama.cpp's OpenAI server (llama-cpp-python's llama_cpp.server) on the embedded GGUF, the second
# peer `pagedllm bench serve` measures against. Needs `make peers` first (it builds llama-cpp-python
# for this CPU). Usage: bash scripts/peer_llamacpp.sh [PORT] [extra llama_cpp.server args...]
# Its best setting here rather than its defaults, none of which changes what it generates: all
# cores for decode and prefill (its default is half the cores for decode), flash attention on
# (faster here), no logits for every prompt token (the server's default computes them), and
# requests queued rather than interrupted by the next one (its default cuts a running stream off
# when another request arrives). It serves one request at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:-8002}"
shift $(( $# > 0 ? 1 : 0 ))
venv=.venv-llamacpp
if [ ! -x "$venv/bin/python" ]; then
  echo "peer_llamacpp.sh: $venv is missing; run \`make peers\` first" >&2
  exit 2
fi
gguf="$(.venv/bin/python -c 'from pagedllm.models.loader import default_model_path; print(default_model_path())')"
cores="$(nproc)"
exec "$venv/bin/python" -m llama_cpp.server --model "$gguf" --model_alias smollm --host 127.0.0.1 --port "$port" \
  --n_threads "$cores" --n_threads_batch "$cores" --n_ctx 4096 --flash_attn true --logits_all false \
  --interrupt_requests false "$@"
