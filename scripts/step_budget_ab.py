"""The step token budget (``max_num_batched_tokens``) A/B: one engine per budget in one process,
the embedded SmolLM2 in bf16, the same fresh random prompts for each, budgets alternating within
each round. Decode x8/x32/x64 (128-token prompts, 128 greedy tokens, output tok/s end to end) and
prefill 1x1024, 32x128, 8x1024 (1 output token, prompt tok/s). Figures in models/kernel_plan.py.

    .venv/bin/python scripts/step_budget_ab.py 1024,2048,4096 [ROUNDS]   (default 2 rounds)
    .venv/bin/python scripts/step_budget_ab.py profile BUDGET            (op table of one 8x1024 prefill)
"""

from __future__ import annotations

import random
import sys
import time

from pagedllm import LLM, SamplingParams

WORKLOADS = [("decode x8", 8, 128, 128), ("decode x32", 32, 128, 128), ("decode x64", 64, 128, 128),
             ("prefill 1x1024", 1, 1024, 1), ("prefill 32x128", 32, 128, 1), ("prefill 8x1024", 8, 1024, 1)]


def profile(budget: int) -> None:
    """torch.profiler's op table of one 8x1024 prefill in steps of ``budget`` tokens (the GEMMs'
    ms per 1,024 rows: ``mkldnn::_linear_pointwise`` total / calls x 4 per layer-row-chunk)."""
    import torch

    llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=budget, enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)

    def run() -> None:
        llm.generate([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(1024)]} for _ in range(8)],
                     params, use_tqdm=False)

    run()  # warm-up
    with torch.profiler.profile() as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def main() -> None:
    if sys.argv[1] == "profile":
        return profile(int(sys.argv[2]))
    budgets = [int(b) for b in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    llms = {b: LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=b) for b in budgets}
    for llm in llms.values():  # warm-up
        llm.generate([{"prompt_token_ids": [5] * 64}] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    rng = random.Random(0)
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, n, prompt_len, out_len in WORKLOADS:
            prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(prompt_len)]} for _ in range(n)]
            params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            for budget, llm in llms.items():  # each engine has its own prefix cache: none is hit
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates.setdefault((name, budget), []).append(n * (out_len if out_len > 1 else prompt_len)
                                                            / (time.perf_counter() - start))
    for name, *_ in WORKLOADS:
        print(f"{name}: " + " / ".join(f"{b}: {', '.join(f'{r:.0f}' for r in rates[name, b])}" for b in budgets))


if __name__ == "__main__":
    main()
