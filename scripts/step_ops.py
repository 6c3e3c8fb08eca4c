"""torch.profiler's op table for 8 greedy decode steps at batch BATCH (128-token prompts), with the
C++ decoder stack (``auto``) or the Python layer loop (``python``): e.g. how many dtype conversions
(``aten::copy_``) a step makes.

    .venv/bin/python scripts/step_ops.py [BATCH] [auto|python]   (default: 64 auto)
"""

from __future__ import annotations

import sys

from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    engine = LLM(dtype="bfloat16").engine
    engine.runner.model.finalize(engine.runner.backend, sys.argv[2] if len(sys.argv) > 2 else "auto")
    for i in range(batch):
        engine.add_request(str(i), list(range(100 + i, 228 + i)),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(6):  # the prefill, then a few decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(8):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
