"""Batch-N greedy decode steps for SECONDS seconds on the embedded model, for a sampling profiler
(`perf record -p PID`, or `scripts/glue_share.sh`, which runs this). Prints "ready PID" when the
prefill is done (every request has its first token: at batch 64 that takes 8 steps of 1,024
tokens) and decoding starts, then steps until time is up.

    .venv/bin/python scripts/decode_loop.py [BATCH] [SECONDS] [auto|python]
"""

from __future__ import annotations

import os
import sys
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
    engine = LLM(dtype="bfloat16").engine
    engine.runner.model.finalize(engine.runner.backend, sys.argv[3] if len(sys.argv) > 3 else "auto")

    def fill() -> None:
        for i in range(batch):
            engine.add_request(f"{time.perf_counter_ns()}-{i}", list(range(100 + i, 228 + i)),
                               SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(batch * 128):  # the prefill: until every request has its first token
            if len(engine.step()) >= batch:
                break

    fill()
    print(f"ready {os.getpid()}", flush=True)
    end, steps = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        if not engine.has_unfinished():
            fill()
        engine.step()
        steps += 1
    print(f"{steps} steps", flush=True)


if __name__ == "__main__":
    main()
