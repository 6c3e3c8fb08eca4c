"""The installed C++ paged-attention kernel alone on one decode layer (SmolLM2's shape: 9 query
heads over 3 KV heads, head dim 64, bf16, blocks of 16): median ms per call.

    S=64 CTX=192 .venv/bin/python scripts/decode_attention_time.py
    ADJ=1: adjacent blocks (default: shuffled over the pool); T1=1: one thread;
    L=30: a cache per layer for L layers, called in turn (the engine's case: L layers' K/V do not
    fit in L3 and stream from DRAM; default 1, one layer's cache, hot)

Figures in docs/benchmarks.md ("AMX, session 13"); the variants timed there (no P V, no
reduction, a two-pass softmax) were edits of paged_attention_cpu.cpp built with
PAGEDLLM_CACHE_DIR set (docs/benchmarks.md says how).
"""

from __future__ import annotations

import os
import random
import time

import torch

from pagedllm.attention.cpu_kernel import load_cpu_kernel


def main() -> None:
    ops = load_cpu_kernel()
    torch.manual_seed(0)
    random.seed(0)
    if os.environ.get("T1"):
        torch.set_num_threads(1)
    seqs, ctx, block, kv_heads, heads, dim = int(os.environ.get("S", 64)), int(os.environ.get("CTX", 192)), 16, 3, 9, 64
    per_seq = (ctx + block - 1) // block
    num_blocks = seqs * per_seq + 8
    layers = int(os.environ.get("L", 1))
    caches = [(torch.randn(num_blocks, block, kv_heads, dim).bfloat16(),
               torch.randn(num_blocks, block, kv_heads, dim).bfloat16()) for _ in range(layers)]
    order = list(range(num_blocks))
    if not os.environ.get("ADJ"):
        random.shuffle(order)
    tables = torch.tensor([order[s * per_seq:(s + 1) * per_seq] for s in range(seqs)], dtype=torch.long)
    query = torch.randn(seqs, heads, dim).bfloat16()
    starts = torch.arange(seqs + 1, dtype=torch.long)
    lens = torch.full((seqs,), ctx, dtype=torch.long)

    def call(layer: int):
        k_cache, v_cache = caches[layer]
        return ops.paged_attention(query, [k_cache, v_cache], starts, lens, tables, dim ** -0.5)

    for i in range(max(20, layers)):
        call(i % layers)
    times = []
    for i in range(max(200, 5 * layers)):
        start = time.perf_counter()
        call(i % layers)
        times.append(time.perf_counter() - start)
    times.sort()
    mid, p10 = times[len(times) // 2], times[len(times) // 10]
    print(f"S={seqs} CTX={ctx} L={layers}: {mid * 1e3:.3f} ms per layer (p10 {p10 * 1e3:.3f})")


if __name__ == "__main__":
    main()
