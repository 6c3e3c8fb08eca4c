"""Time a 2,048-token prefill of the embedded SmolLM2 (bf16 weights) with each KV format, alternated.

    .venv/bin/python scripts/prefill_kv_formats.py [FORMAT ...]     # default: bfloat16 int8, twice each

One prompt of random token ids, ``max_tokens=1``, prefix caching off; a warm-up call per engine,
then the mean of 3 calls (each prompt shifted by one token). Prints ms per prefill.
"""

from __future__ import annotations

import sys
import time

import torch

from pagedllm import LLM, SamplingParams


def main(formats: list[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = torch.randint(100, 40000, (2051,), generator=torch.Generator().manual_seed(0)).tolist()
    for kv in formats:
        llm = LLM(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory="256MiB", enable_prefix_caching=False)
        llm.generate([{"prompt_token_ids": ids[:2048]}], params, use_tqdm=False)
        t0 = time.perf_counter()
        for i in range(3):
            llm.generate([{"prompt_token_ids": ids[i + 1:i + 2049]}], params, use_tqdm=False)
        print(f"{kv}: {(time.perf_counter() - t0) / 3 * 1000:.0f} ms per 2,048-token prefill", flush=True)
        del llm


if __name__ == "__main__":
    main(sys.argv[1:] or ["bfloat16", "int8", "bfloat16", "int8"])
