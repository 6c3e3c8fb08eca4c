"""The C++ layer ops against the torch ops that define their numerics, timed in one process
(medians of 10 calls): SiLU-and-multiply on [rows, 3072] gate/up rows, residual add + RMSNorm on
[rows, 576], in bf16 and float32 (SmolLM2's widths).

    .venv/bin/python scripts/layer_ops_time.py [ROWS ...]   (default: 1 64 1024)
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from pagedllm import cpu_features
from pagedllm.bench.timers import median_ms
from pagedllm.models.layer_ops import TorchLayerOps, get_layer_ops


def add_norm(ops, x, residual, weight):
    return ops.add_rms_norm(x, residual.clone(), weight, 1e-5)  # the C++ op updates its residual in place


def main(rows_list: list[int]) -> None:
    ops, reference = get_layer_ops("cpu"), TorchLayerOps()
    print(f"CPU {cpu_features.current().describe()}; layer ops: {ops.name}")
    for dtype in (torch.bfloat16, torch.float32):
        for rows in rows_list:
            gate_up = torch.randn(rows, 3072).to(dtype)
            x, residual, weight = (torch.randn(*shape).to(dtype) for shape in ((rows, 576), (rows, 576), (576,)))
            silu = (median_ms(partial(ops.silu_mul, gate_up), 10), median_ms(partial(reference.silu_mul, gate_up), 10))
            norm = (median_ms(partial(add_norm, ops, x, residual, weight), 10),
                    median_ms(partial(add_norm, reference, x, residual, weight), 10))
            print(f"{str(dtype):<15} rows={rows:<5} silu_mul ours {silu[0]:.3f} ms, torch {silu[1]:.3f} ms; "
                  f"add_rms_norm ours {norm[0]:.3f} ms, torch {norm[1]:.3f} ms")


if __name__ == "__main__":
    main([int(r) for r in sys.argv[1:]] or [1, 64, 1024])
