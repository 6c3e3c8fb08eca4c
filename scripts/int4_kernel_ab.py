"""`pagedllm bench step` with the 4-bit kernel or its crossover forced, for A/B runs of the kernel plan.

    .venv/bin/python scripts/int4_kernel_ab.py KERNEL ROWS BATCH [Q8_ROWS [Q8_KERNEL]]
    (KERNEL: cpp, torch or tiles; ROWS: int4_rows; Q8_ROWS: q8_0_rows, default the plan's;
    Q8_KERNEL: cpp or tiles, default the plan's)

e.g. `for k in torch cpp; do .venv/bin/python scripts/int4_kernel_ab.py $k 16 8; done` (alternate,
repeat); on AVX-512 BF16 `... torch 8 8 8 cpp` against `... tiles 8 8 8 tiles`.
Runs `bench step --batch BATCH --context 192 --steps 40 --dtype bfloat16` with this CPU's
plan but ``int4_kernel`` and ``int4_rows`` replaced (docs/benchmarks.md, "AVX2 only").
DTYPE=float32 / float16 runs that dtype instead; QUANTIZATION=int8 with INT8_KERNEL=torch or cpp
forces quantization="int8"'s kernel (KERNEL and ROWS then still replace the unused 4-bit ones),
e.g. the session-31 figures (docs/design.md): `DTYPE=float32 QUANTIZATION=gguf ... torch 8 8 8` against
`... cpp 32 8 32`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pagedllm.engine.builder as engine_module
from pagedllm.cli import main

kernel, rows, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
q8 = {"q8_0_rows": int(sys.argv[4])} if len(sys.argv) > 4 else {}
if len(sys.argv) > 5:
    q8["q8_0_kernel"] = sys.argv[5]
if os.environ.get("INT8_KERNEL"):
    q8["int8_kernel"] = os.environ["INT8_KERNEL"]
dtype = os.environ.get("DTYPE", "bfloat16")
quantization = ["--quantization", os.environ["QUANTIZATION"]] if os.environ.get("QUANTIZATION") else []
plan_kernels = engine_module.plan_kernels
engine_module.plan_kernels = lambda cpu, dtype: dataclasses.replace(plan_kernels(cpu, dtype), int4_kernel=kernel,
                                                                     int4_rows=rows, **q8)
sys.exit(main(["bench", "step", "--batch", batch, "--context", "192", "--steps", "40", "--dtype", dtype,
               *quantization]))
