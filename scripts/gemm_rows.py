"""oneDNN's bf16 GEMM on the oneDNN-packed weight (what the engine's dense projections run), in
TF/s per row count, for SmolLM2's projection shapes: where on this CPU the rate changes with the
number of rows (on AMX, some shapes run at half speed below ~2,048 rows: models/kernel_plan.py).

    .venv/bin/python scripts/gemm_rows.py [ROUNDS]   (default 2)
"""

from __future__ import annotations

import sys

import torch

from pagedllm.bench.timers import median_ms

SHAPES = {"down (K 1536, N 576)": (1536, 576), "qkv (K 576, N 960)": (576, 960), "gate_up (K 576, N 3072)": (576, 3072)}
ROWS = (512, 768, 1000, 1024, 1040, 1280, 2048, 4096)


def main() -> None:
    torch.manual_seed(0)
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for name, (k, n) in SHAPES.items():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), None)
            rates = []
            for m in ROWS:
                x = torch.randn(m, k).bfloat16()
                ms = median_ms(lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                                             [], ""), 30)
                rates.append(f"{m}: {2 * m * k * n / ms / 1e9:.2f}")
            print(f"round {rnd} {name} TF/s by rows: {'  '.join(rates)}", flush=True)


if __name__ == "__main__":
    main()
