"""The 4-bit weight kernels by activation dtype, hot, on SmolLM2's gate_up (K 576, N 3,072) and
down (K 1,536, N 576) shapes with random Q4_1-like blocks: torch's int4 kernel with float32 and
with bf16 rows, our C++ ``q4_linear`` with float32 rows and the dense float32 GEMM; median ms of 30
calls. Why the kernel plan gives float32/float16 rows our kernel on AVX-512 (docs/design.md,
"Figures behind the code's choices"; ``pagedllm bench matmul`` times bf16 rows only).

    .venv/bin/python scripts/activation_dtype_matmuls.py [ROWS ...]   (default: 1 8)
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.nn.functional as F

from pagedllm.bench.timers import median_ms
from pagedllm.models.gguf_quant import BlockQuantized
from pagedllm.models.layer_ops import get_layer_ops
from pagedllm.models.quantized_linear import Int4BlockMatmul, Int4Matmul


def main() -> None:
    rows_list = [int(r) for r in sys.argv[1:]] or [1, 8]
    torch.manual_seed(0)
    ops = get_layer_ops(torch.device("cpu"))
    for n, k in ((3072, 576), (576, 1536)):
        weight = BlockQuantized(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                                (torch.rand(n, k // 32) * 0.01).half().float(),
                                (-torch.rand(n, k // 32) * 0.05).half().float())
        dense = weight.dequantize().float()
        kernels = {"torch int4, float32 rows": (Int4Matmul(weight, torch.float32), torch.float32),
                   "torch int4, bf16 rows": (Int4Matmul(weight, torch.bfloat16), torch.bfloat16),
                   "our q4_linear, float32 rows": (Int4BlockMatmul(weight, ops), torch.float32),
                   "dense float32": (partial(F.linear, weight=dense), torch.float32)}
        for rows in rows_list:
            x = torch.randn(rows, k)
            times = {name: median_ms(partial(kernel, x.to(dtype)), 30) for name, (kernel, dtype) in kernels.items()}
            print(f"N {n} K {k} rows {rows}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in times.items()))


if __name__ == "__main__":
    main()
