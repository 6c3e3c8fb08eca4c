"""Greedy pick timing: ``torch.argmax(dim=-1)`` against ``max(dim=-1).indices`` (what
``engine/sampler.py row_argmax`` uses without the C++ layer ops; both take the first index of a tie)
and our C++ ``row_argmax`` (``csrc/layer_ops.h``, the sampler's pick on CPU since session 33),
alternating in one process, over SmolLM2-sized float32 logits.
Usage: python scripts/argmax_ab.py [ROWS ...] (default 1 8 64).
``ATEN_CPU_CAPABILITY=avx2`` (or ``avx512``) times the kernels torch would run on that CPU family."""

from __future__ import annotations

import sys
import time

import torch

from pagedllm.models.layer_ops import get_layer_ops

VOCAB = 49_152  # SmolLM2's
CALLS, ROUNDS = 100, 3


def per_call_ms(fn) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    ops = get_layer_ops(torch.device("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for rows in [int(r) for r in sys.argv[1:]] or [1, 8, 64]:
        x = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
        assert x.argmax(dim=-1).tolist() == x.max(dim=-1).indices.tolist() == ops.row_argmax(x).tolist()
        times = {"argmax": [], "max": [], "ours": []}
        for _ in range(ROUNDS):
            times["argmax"].append(per_call_ms(lambda x=x: x.argmax(dim=-1).tolist()))
            times["max"].append(per_call_ms(lambda x=x: x.max(dim=-1).indices.tolist()))
            times["ours"].append(per_call_ms(lambda x=x: ops.row_argmax(x).tolist()))
        print(f"{rows:3d} rows: argmax " + " / ".join(f"{t:.3f}" for t in times["argmax"])
              + " ms; max().indices " + " / ".join(f"{t:.3f}" for t in times["max"])
              + " ms; ours " + " / ".join(f"{t:.3f}" for t in times["ours"]) + " ms")


if __name__ == "__main__":
    main()
