"""Where greedy outputs part: our engine in four configurations and llama.cpp, on the same prompts.

    .venv/bin/python scripts/greedy_agreement.py [PROMPTS] [TOKENS]   (default 4 prompts, 64 tokens)

Random 128-token prompts (seed 7), greedy, EOS ignored: bf16 with the GGUF kernels and our C++
4-bit kernel, the same with torch's int4 kernel, bf16 dense weights and float32 dense weights,
then llama.cpp on the same GGUF (``make peers``; skipped without it). Prints, for each pair, the
first position where each prompt's outputs differ (TOKENS: equal throughout).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pagedllm.engine.engine as engine_module
from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import default_model_path

CONFIGS = (("bf16 cpp", "bfloat16", "gguf", "cpp"), ("bf16 torch", "bfloat16", "gguf", "torch"),
           ("bf16 dense", "bfloat16", "none", "torch"), ("fp32 dense", "float32", "none", "torch"))
LLAMACPP = Path(".venv-llamacpp/bin/python")
WORKER = Path(__file__).parent.parent / "src/pagedllm/bench/peer_scripts/llamacpp_worker.py"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str]) -> None:
    n, tokens = (int(argv[0]) if argv else 4), (int(argv[1]) if len(argv) > 1 else 64)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    plan_kernels, outs = engine_module.plan_kernels, {}
    for name, dtype, quantization, kernel in CONFIGS:
        engine_module.plan_kernels = lambda cpu, dt, k=kernel: dataclasses.replace(plan_kernels(cpu, dt), int4_kernel=k)
        llm = LLM(dtype=dtype, quantization=quantization, kv_cache_memory="256MiB", enable_prefix_caching=False)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[name] = [list(o.outputs[0].token_ids) for o in results]
    engine_module.plan_kernels = plan_kernels
    if LLAMACPP.exists():
        proc = subprocess.Popen([str(LLAMACPP), str(WORKER), str(default_model_path()), "1", "256", "2"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        proc.stdout.readline()
        for p in prompts:
            proc.stdin.write(json.dumps({"prompts": [p], "max_tokens": [tokens]}) + "\n")
            proc.stdin.flush()
            outs.setdefault("llama.cpp", []).append(json.loads(proc.stdout.readline())["token_ids"][0])
        proc.stdin.close()
        proc.wait()
    else:
        print(f"llama.cpp skipped: {LLAMACPP} not found (make peers)")
    for a in outs:
        print(f"{a:>11}: " + "  ".join(f"{b}={[first_difference(x, y) for x, y in zip(outs[a], outs[b], strict=True)]}"
                                       for b in outs if b != a))


if __name__ == "__main__":
    main(sys.argv[1:])
