"""Decode steps under different small-step crossovers, A/B in one process: one engine per crossover
pair (the plan's ``int4_rows`` and ``q8_0_rows`` replaced), each with BATCH requests of 128-token
prompts (greedy, the embedded SmolLM2 in bf16), then 10-step decode chunks alternating between the
engines, so the machine's drift falls on all of them alike. Prints each one's median ms per step
over CHUNKS chunks, and the chunks.

    .venv/bin/python scripts/crossover_ab.py BATCH ROWS[,ROWS...] [CHUNKS]
    (ROWS: "R" for both crossovers, or "R4:R8" for int4_rows:q8_0_rows; CHUNKS default 10)

e.g. `scripts/crossover_ab.py 48 16,48` (docs/design.md, "The kernel plan").
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from decode_step_time import warm_up  # this folder's script: steps until every request has a token

import pagedllm.engine.builder as engine_module
from pagedllm import LLM, SamplingParams

STEPS_PER_CHUNK = 10


def engine_with(rows: str, batch: int, chunks: int):
    int4_rows, q8_0_rows = (int(r) for r in (rows.split(":") * 2)[:2])
    plan_kernels = engine_module.plan_kernels
    engine_module.plan_kernels = lambda cpu, dtype: dataclasses.replace(
        plan_kernels(cpu, dtype), int4_rows=int4_rows, q8_0_rows=q8_0_rows)
    try:
        engine = LLM(dtype="bfloat16").engine
    finally:
        engine_module.plan_kernels = plan_kernels
    params = SamplingParams(temperature=0, max_tokens=STEPS_PER_CHUNK * chunks + 10, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), list(range(100 + i, 228 + i)), params)
    warm_up(engine, batch)
    return engine


def main() -> None:
    batch, variants = int(sys.argv[1]), sys.argv[2].split(",")
    chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    engines = {rows: engine_with(rows, batch, chunks) for rows in variants}
    times: dict[str, list[float]] = {rows: [] for rows in variants}
    for _ in range(chunks):
        for rows, engine in engines.items():
            start = time.perf_counter()
            for _ in range(STEPS_PER_CHUNK):
                engine.step()
            times[rows].append((time.perf_counter() - start) / STEPS_PER_CHUNK * 1e3)
    for rows in variants:
        print(f"batch {batch}, crossovers {rows}: median {statistics.median(times[rows]):.2f} ms per step; chunks "
              + " ".join(f"{t:.1f}" for t in times[rows]))


if __name__ == "__main__":
    main()
