"""Decode step time with the layers run by the C++ decoder stack (``layer_loop = "auto"``) against the
Python loop (``"python"``), alternating in one process on the same engine, medians of ROUNDS runs.
Greedy, 128-token prompts, 40 decode steps per run; also checks that both produce the same tokens.

    .venv/bin/python scripts/layer_loop_ab.py [BATCH ...]   (default: 1 8)
"""

from __future__ import annotations

import statistics
import sys
import time

from pagedllm import LLM, SamplingParams

ROUNDS = 5


def run(engine, batch: int, loop: str, steps: int = 40) -> tuple[float, list[list[int]]]:
    """Milliseconds per decode step, and each request's tokens."""
    engine.runner.model.layer_loop = loop
    ids = [f"{loop}-{time.perf_counter_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(100 + i, 228 + i)),
                           SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for out in engine.step():  # the prefill (and first tokens)
        tokens[out.request_id] = list(out.outputs[0].token_ids)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        n += 1
    return (time.perf_counter() - t0) / n * 1e3, [tokens[r] for r in ids]


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [1, 8]
    engine = LLM(dtype="bfloat16").engine
    if engine.runner.model.decoder_stack(engine.runner.backend) is None:
        sys.exit("the C++ decoder stack does not apply here (no C++ layer ops or attention): nothing to compare")
    run(engine, 2, "auto", 4)  # warm-up
    run(engine, 2, "python", 4)
    for batch in batches:
        times: dict[str, list[float]] = {"python": [], "auto": []}
        outputs = {}
        for _ in range(ROUNDS):
            for loop in times:
                ms, outputs[loop] = run(engine, batch, loop)
                times[loop].append(ms)
        py, cpp = (statistics.median(v) for v in times.values())
        same = "same tokens" if outputs["python"] == outputs["auto"] else "TOKENS DIFFER"
        print(f"batch {batch}: ms per decode step, Python layer loop {py:.2f}, C++ decoder stack {cpp:.2f} "
              f"-> {py / cpp:.3f}x ({same}; runs: python {[round(t, 2) for t in times['python']]}, "
              f"C++ {[round(t, 2) for t in times['auto']]})")


if __name__ == "__main__":
    main()
