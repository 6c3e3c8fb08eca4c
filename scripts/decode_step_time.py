"""Decode step time at batch BATCH (128-token prompts, greedy, the embedded SmolLM2 in bf16), timed
without a profiler: CHUNKS chunks of 20 steps after the prefill (until every request has a token)
and 4 warm-up steps; prints the median and the fastest chunk's ms per step (the median to quote:
this machine's speed drifts).
A/B two builds by running each in turn, a build other than the installed one from a copy of its
``src`` with ``PYTHONPATH`` pointing to it and its own ``PAGEDLLM_CACHE_DIR``.

    .venv/bin/python scripts/decode_step_time.py [BATCH] [CHUNKS]   (default 8 8)
"""

from __future__ import annotations

import statistics
import sys
import time

from pagedllm import LLM, SamplingParams


def warm_up(engine, batch: int) -> None:
    """Steps until every request has its first token (the prefill takes batch x 128 / step budget
    steps: 8 at batch 64), then 4 decode steps."""
    for _ in range(batch * 128):  # bounded: a step prefills one token at least
        if len(engine.step()) >= batch:
            break
    for _ in range(4):
        engine.step()


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    engine = LLM(dtype="bfloat16").engine
    params = SamplingParams(temperature=0, max_tokens=20 * chunks + 10, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), list(range(100 + i, 228 + i)), params)
    warm_up(engine, batch)
    times = []
    for _ in range(chunks):
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        times.append((time.perf_counter() - start) / 20 * 1e3)
    print(f"batch {batch}: median {statistics.median(times):.2f}, fastest {min(times):.2f} ms per decode step")


if __name__ == "__main__":
    main()
