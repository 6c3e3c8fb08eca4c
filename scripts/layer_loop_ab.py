"""Decode step time with the layers run by the C++ decoder stack (``layer_loop = "auto"``) against the
Python loop (``"python"``), alternating in one process on the same engine, medians of ROUNDS runs.
Greedy, 128-token prompts, 40 decode steps per run; also checks that both produce the same tokens.
With ``--prefill NxL ...``: N fresh prompts of L tokens, max_tokens 1, prompt tokens/s (prefix
caching off, so every run computes every prompt).

    .venv/bin/python scripts/layer_loop_ab.py [BATCH ...]              (default: 1 8)
    .venv/bin/python scripts/layer_loop_ab.py --prefill 32x128 4x2048
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

ROUNDS = 5


def run(engine, batch: int, loop: str, steps: int = 40) -> tuple[float, list[list[int]]]:
    """Milliseconds per decode step, and each request's tokens."""
    engine.runner.model.finalize(engine.runner.backend, loop)
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


def prefill_tok_s(llm: LLM, n: int, length: int, loop: str, seed: int) -> float:
    llm.engine.runner.model.finalize(llm.engine.runner.backend, loop)
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (length,), generator=gen).tolist()} for _ in range(n)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return n * length / (time.perf_counter() - t0)


def prefill_main(shapes: list[str]) -> None:
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    prefill_tok_s(llm, 2, 64, "auto", 0)  # warm-up
    for shape in shapes:
        n, length = (int(x) for x in shape.split("x"))
        rates: dict[str, list[float]] = {"python": [], "auto": []}
        for r in range(3):
            for loop in rates:
                rates[loop].append(prefill_tok_s(llm, n, length, loop, seed=r))
        py, cpp = (statistics.median(v) for v in rates.values())
        print(f"prefill {shape}: prompt tok/s, Python layer loop {py:.1f}, C++ decoder stack {cpp:.1f} "
              f"-> {cpp / py:.3f}x "
              f"(runs: python {[round(x, 1) for x in rates['python']]}, C++ {[round(x, 1) for x in rates['auto']]})")


def main() -> None:
    if sys.argv[1:2] == ["--prefill"]:
        prefill_main(sys.argv[2:] or ["32x128", "4x2048"])
        return
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
