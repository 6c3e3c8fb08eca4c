"""End-to-end output tok/s of engine configurations, alternating in one process: fresh random
128-token prompts per call (no prefix cache serves them), 128 greedy tokens, prefill included.

    .venv/bin/python scripts/dtype_ab.py [CONFIGS] [BATCHES] [ROUNDS]
    (default: bfloat16:gguf,float32:none  1,8,32  2)

CONFIGS are dtype:quantization pairs. Prints each run, then the medians per configuration and
batch as JSON. ``dtype="auto"`` picks bfloat16 on x86 CPUs with AVX2 or more because of these
figures (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from pagedllm import LLM, SamplingParams, cpu_features


def main(argv: list[str]) -> None:
    configs = [tuple(c.split(":")) for c in (argv[0] if argv else "bfloat16:gguf,float32:none").split(",")]
    batches = [int(b) for b in (argv[1] if len(argv) > 1 else "1,8,32").split(",")]
    rounds = int(argv[2]) if len(argv) > 2 else 2
    print(f"CPU {cpu_features.current().describe()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    llms = {c: LLM(dtype=c[0], quantization=c[1], kv_cache_memory="1GiB", enable_prefix_caching=False)
            for c in configs}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for c in configs:
            for b in batches:
                prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=gen).tolist()}
                           for _ in range(b)]
                t0 = time.perf_counter()
                outs = llms[c].generate(prompts, params, use_tqdm=False)
                rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
                results.setdefault(f"{c[0]}:{c[1]} x{b}", []).append(round(rate, 1))
                print(f"round {r}: {c[0]}:{c[1]} x{b}: {rate:.1f} tok/s", flush=True)
    print(json.dumps({k: statistics.median(v) for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
