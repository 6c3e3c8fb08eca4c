"""Two builds of the C++ layer ops in one process, called in turn on the same tensors (A B, B A, ...),
so the machine's drift (10-40% between runs here) lands on both: median ms of each and B / A, for
SiLU-and-multiply, residual add + RMSNorm and the BF16 tile kernels of the embedded SmolLM2 (the
4-bit gate/up projection and the Q8_0 LM head), at each row count.

    .venv/bin/python scripts/layer_ops_build_ab.py A.so B.so [ROWS ...]   (default rows: 8 32 64)

A build of another commit: ``git worktree add /tmp/a REV`` and ``PYTHONPATH=/tmp/a/src .venv/bin/python
-m pagedllm.extensions --build``, which compiles into ``~/.cache/pagedllm/kernels/HASH/
pagedllm_layer_ops_HASH.so`` (the build.ninja beside it names the source folder); this checkout's
installed build is ``src/pagedllm/models/_layer_ops_cpu.*.so``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedllm import LLM


def load(path: str):
    """The extension module in ``path`` (its init function is named after the file's stem)."""
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(rows: int, head, gate_up) -> dict:
    """The timed calls at ``rows`` rows, each taking a build."""
    x, residual = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    weight, gate_up_rows = torch.randn(576).bfloat16(), torch.randn(rows, 3072).bfloat16()
    return {
        "silu_mul": lambda m: m.silu_mul(gate_up_rows),
        "add_rms_norm": lambda m: m.add_rms_norm_(x, residual, weight, 1e-5),
        "q4 tiles gate_up": lambda m: m.q4_tiles_linear(x, gate_up.codes, gate_up.scale_min, bf16_out=True),
        "q8_0 tiles head": lambda m: m.q8_0_tiles_linear(x, head.codes, head.scales, bf16_out=True),
    }


def main(a_path: str, b_path: str, rows_list: list[int], calls: int = 60) -> None:
    builds = (load(a_path), load(b_path))
    model = LLM(dtype="bfloat16").engine.runner.model
    head, gate_up = model.lm_head.small_batch, model.layers[0].mlp.gate_up_proj.small_batch
    if not (hasattr(head, "codes") and hasattr(gate_up, "codes") and all(m.has_bf16_tiles() for m in builds)):
        sys.exit("no BF16 tile kernels here: this script times an AVX-512 BF16 CPU")
    for rows in rows_list:
        for case, call in cases(rows, head, gate_up).items():
            times: tuple[list[float], list[float]] = ([], [])
            for m in builds:
                call(m)
            for i in range(calls):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    start = time.perf_counter()
                    call(builds[side])
                    times[side].append(time.perf_counter() - start)
            a, b = (statistics.median(t) * 1e3 for t in times)
            print(f"rows {rows:4d}  {case:17s} A {a:.4f} ms  B {b:.4f} ms  B / A {b / a:.3f}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], [int(r) for r in sys.argv[3:]] or [8, 32, 64])
