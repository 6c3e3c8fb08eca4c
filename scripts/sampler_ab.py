"""Decode step time with sampled (temperature 1.0) requests: the exponential race with its noise from
``exponential_`` (the former draw) against the same race with ``-log(uniform_)`` noise
(``pagedllm.engine.sampler.draw``), alternating in one process, medians of 3.

    .venv/bin/python scripts/sampler_ab.py [BATCH ...]          (default: 1 32)
    .venv/bin/python scripts/sampler_ab.py --draw [BATCH ...]   the draw alone, on [BATCH, 49152] probabilities
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pagedllm.engine.sampler as sampler
from pagedllm import LLM, SamplingParams

CURRENT = sampler.draw


def exponential_noise(probs: torch.Tensor, generators) -> list[int]:
    """The former draw: argmax(p / E), E from ``exponential_``."""
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1).tolist()


def ms_per_step(engine, batch: int, draw, steps: int = 30) -> float:
    sampler.draw = draw
    for i in range(batch):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", list(range(100 + i, 228 + i)),
                           SamplingParams(temperature=1.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def draw_ms(batches: list[int], repeats: int = 100) -> None:
    """Milliseconds per draw over SmolLM2's vocabulary, the two noises alternating call by call."""
    for batch in batches:
        probs = torch.softmax(torch.randn(batch, 49152), -1)
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        times = {"exponential_": [], "-log(uniform_)": []}
        for _ in range(repeats):
            for name, fn in (("exponential_", exponential_noise), ("-log(uniform_)", CURRENT)):
                t0 = time.perf_counter()
                fn(probs, gens)
                times[name].append(time.perf_counter() - t0)
        old, new = (1e3 * statistics.median(v) for v in times.values())
        print(f"batch {batch}: ms per draw, noise from exponential_ {old:.2f}, from -log(uniform_) {new:.2f}")


def main() -> None:
    if sys.argv[1:2] == ["--draw"]:
        draw_ms([int(b) for b in sys.argv[2:]] or [1, 32])
        return
    batches = [int(b) for b in sys.argv[1:]] or [1, 32]
    engine = LLM(dtype="bfloat16").engine
    ms_per_step(engine, 2, CURRENT, 4)  # warm-up
    for batch in batches:
        times = {"exponential_": [], "-log(uniform_)": []}
        for _ in range(3):
            times["exponential_"].append(ms_per_step(engine, batch, exponential_noise))
            times["-log(uniform_)"].append(ms_per_step(engine, batch, CURRENT))
        old, new = (statistics.median(v) for v in times.values())
        print(f"batch {batch}: ms per decode step, noise from exponential_ {old:.1f}, from -log(uniform_) {new:.1f} "
              f"-> {old / new:.2f}x")


if __name__ == "__main__":
    main()
