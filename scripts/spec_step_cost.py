"""The cost of a verification step by its rows: what ``engine/speculative/drafter.py``'s
``STEP_COST`` table holds (docs/speculative.md).

One request at a context of ``--context`` tokens verifies 0..N-1 guesses (a chunk of N rows laid
out as decode rows, as the engine runs it), the model's forward pass and the logits of every row
timed; the median of ``--repeats`` runs, relative to one row. Also batch 2 and 4, to see where
guessing stops paying. Run: ``python scripts/spec_step_cost.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.engine.builder import build_engine
from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    engine = build_engine(num_kv_blocks=1024, max_model_len=2048)
    runner = engine.runner
    per_seq = -(-(args.context + args.max_rows) // engine.config.cache.block_size)
    print(engine.kernels_line())
    for batch in (int(b) for b in args.batches.split(",")):
        times = []
        for rows in range(1, args.max_rows + 1):
            out = SchedulerOutput()
            for b in range(batch):
                blocks = [(b * per_seq + i) % 1024 for i in range(per_seq)]
                guesses = [5] * (rows - 1)
                out.chunks.append(ScheduledChunk(str(b), [5, *guesses], args.context, blocks, True,
                                                 draft_token_ids=guesses))
            samples = []
            with torch.inference_mode():
                for i in range(args.repeats + 2):
                    t0 = time.perf_counter()
                    _, hidden, _ = runner.run_model(out)
                    runner.model.compute_logits(hidden)
                    if i >= 2:
                        samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
        base = times[0]
        print(f"batch {batch}: 1 row per request {1e3 * base:.1f} ms; rows per request 1..{args.max_rows} relative: "
              + ", ".join(f"{t / base:.2f}" for t in times))


if __name__ == "__main__":
    main()
