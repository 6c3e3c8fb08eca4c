"""How far the C++ kernel's bf16 causal prefill attention lands from the exact (float64) result, beside
the bf16 rounding of the exact output alone and torch's SDPA in bf16.

    .venv/bin/python scripts/prefill_attention_error.py

Random bf16 Q/K/V (2 sequences x 1,024 tokens, SmolLM2's 9 query over 3 KV heads, head dim 64, blocks
of 16 shuffled over the pool), the kernel reading them through the block tables. Run a build of
another commit with ``PYTHONPATH`` pointing to a copy of its ``src`` and its own ``PAGEDLLM_CACHE_DIR``.
Figures in docs/benchmarks.md ("AVX-512 BF16, session 30").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backends import get_backend
from pagedllm.attention.random_case import HEAD_DIM, HEADS
from pagedllm.attention.random_case import random_paged_case as case

BATCH, CONTEXT = 2, 1024


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q, kv, meta, qd, kd, vd = case(BATCH, CONTEXT, 16, torch.bfloat16, gen, "cpu", prefill=True, order="shuffled")

    def rows(out: torch.Tensor) -> torch.Tensor:  # [batch, heads, tokens, dim] -> the kernel's [tokens, heads, dim]
        return out.transpose(1, 2).reshape(BATCH * CONTEXT, HEADS, HEAD_DIM).double()

    exact = rows(F.scaled_dot_product_attention(qd.double(), kd.double(), vd.double(), is_causal=True,
                                                enable_gqa=True))
    results = {
        "C++ kernel": get_backend("cpu", "cpu", HEAD_DIM).forward(q, kv, meta).double(),
        "the exact output rounded to bf16": exact.bfloat16().double(),
        "torch SDPA in bf16": rows(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)),
    }
    for name, out in results.items():
        err = (out - exact).abs()
        print(f"{name}: mean abs error {err.mean():.3e}, max {err.max():.3e}")


if __name__ == "__main__":
    main()
