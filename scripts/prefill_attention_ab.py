"""Prefill attention A/B: our C++ kernel against torch's SDPA for fresh bf16 prefills (the AMX path).

    .venv/bin/python scripts/prefill_attention_ab.py ab 0 64 128 512   # prompt tok/s per min-rows setting
    .venv/bin/python scripts/prefill_attention_ab.py profile 0          # op table of one 1x1024 prefill
    .venv/bin/python scripts/prefill_attention_ab.py sdpa               # torch SDPA alone, per layer

``ab``: the embedded SmolLM2 in bf16 (no prefix caching, fresh random prompts, 1 output token), two
rounds over the given ``set_dense_prefill_min_rows`` values in one process (0: our kernel for
every row), prefill 1x128, 1x1024, 32x128, 8x1024. ``profile N``: the torch profiler's op table for
one 1,024-token prefill with min rows N. ``sdpa``: ``scaled_dot_product_attention`` on SmolLM2's
attention shape (9 query heads over 3 KV heads, head dim 64, causal), ms per layer at 128 and 1,024
rows. Figures in docs/benchmarks.md ("AMX") and attention/cpu_kernel.py.
"""

from __future__ import annotations

import random
import sys
import time

import torch


def sdpa() -> None:
    torch.manual_seed(0)
    for rows in (128, 1024):
        q = torch.randn(1, 9, rows, 64).bfloat16()
        k, v = torch.randn(1, 3, rows, 64).bfloat16(), torch.randn(1, 3, rows, 64).bfloat16()
        def attend(q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        for _ in range(3):
            attend()
        start = time.perf_counter()
        for _ in range(20):
            attend()
        print(f"{rows} rows: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms per layer")


def engine_runs(settings: list[int], profile: bool) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.attention.cpu_kernel import load_cpu_kernel

    ops = load_cpu_kernel()
    llm = LLM(dtype="bfloat16", kv_cache_memory="512MiB", enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)

    def run(n: int, length: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(n)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return n * length / (time.perf_counter() - start)

    run(1, 512)  # warm-up
    if profile:
        ops.set_dense_prefill_min_rows(settings[0])
        with torch.profiler.profile() as prof:
            run(1, 1024)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        return
    for rnd in range(2):
        for rows in settings:
            ops.set_dense_prefill_min_rows(rows)
            shapes = " ".join(f"{n}x{length}: {run(n, length):.0f}" for n, length in
                              ((1, 128), (1, 1024), (32, 128), (8, 1024)))
            print(f"round {rnd} min_rows {rows} prompt tok/s {shapes}", flush=True)


if __name__ == "__main__":
    mode, values = sys.argv[1], [int(x) for x in sys.argv[2:]]
    if mode == "sdpa":
        sdpa()
    else:
        engine_runs(values or [0, 128], profile=mode == "profile")
