"""``pagedllm bench attention``: paged-attention backends against SDPA over a contiguous cache.

For each (batch, context, block size, dtype): decode attention (one query per sequence) with
SmolLM2's head layout (9 query heads, 3 KV heads, head dim 64) over a cache of random K/V.
The contiguous baseline keeps each sequence's K/V in one dense [batch, kv_heads, context, dim]
tensor and calls ``scaled_dot_product_attention`` (GQA); the paged backends read the same K/V
scattered over shuffled blocks through block tables. Times are medians of repeated calls in one
process; the report gives each backend's time as a ratio to the contiguous SDPA.

``--block-order shuffled,adjacent``: merging's effect on the kernel: the same decode over shuffled
blocks and over each sequence's blocks in one physical run, timed in alternation, with the ratio.

``--kv-cache-dtypes int8,int4,...``: the decode also over the same K/V stored in each quantized
format (``kvstore/quant.py``), each backend's time beside its time over the float cache
(``<backend>_<format>_over_float``): the fused-dequant kernels against the bf16/float32 ones.

``--prefill``: instead, causal prefill of ``context`` new tokens per sequence (every position a
query; no cached prefix), against SDPA with ``is_causal=True``, with each kernel's rate in GFLOP/s
(4 * heads * head_dim * L(L+1)/2 per sequence: QK^T and PV over the causal triangle).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.attention.backends import get_backend
from pagedllm.attention.random_case import HEAD_DIM, HEADS
from pagedllm.attention.random_case import random_paged_case as case
from pagedllm.attention.reference import write_kv
from pagedllm.kvstore.quant import KVCodec
from pagedllm.kvstore.spec import KVSpec, LayerKV

# a quantized output's largest difference from the float cache's, as a share of its largest value
QUANTIZED_TOLERANCE = {"int8": 0.03, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2, "int4": 0.35}


def quantized_copy(kv: LayerKV, name: str) -> LayerKV:
    """The same K/V (every slot) encoded in the quantized format ``name``."""
    nb, bs, kh, d = kv.k.shape
    codec = KVCodec(name, d)
    out = LayerKV.allocate(KVSpec(codec.dtype, kh, d, bs, 1, "per_token_head", name), nb, kv.k.device)
    write_kv(out, kv.k.view(-1, kh, d), kv.v.view(-1, kh, d), torch.arange(nb * bs, device=kv.k.device))
    return out


def _time(fn, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_prefill(batches, contexts, blocks, dtypes, backends, repeats: int, seed: int = 0,
                device: str = "cpu", order: str = "shuffled") -> list[dict]:
    """Causal prefill attention: each backend against SDPA(is_causal), times and GFLOP/s."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, ctx, block, dtype_name in itertools.product(batches, contexts, blocks, dtypes):
        dtype = getattr(torch, dtype_name)
        q, kv, meta, qd, kd, vd = case(batch, ctx, block, dtype, gen, device, prefill=True, order=order)
        flops = batch * 4 * HEADS * HEAD_DIM * ctx * (ctx + 1) / 2

        def sdpa(qd=qd, kd=kd, vd=vd):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

        t_sdpa = _time(sdpa, repeats)
        expected = sdpa().transpose(1, 2).reshape(batch * ctx, HEADS, HEAD_DIM)
        row = {"mode": "prefill", "batch": batch, "context": ctx, "block_size": block, "dtype": dtype_name,
               "block_order": order,
               "sdpa_contiguous_ms": round(t_sdpa * 1000, 3), "sdpa_gflops": round(flops / t_sdpa / 1e9, 1)}
        for name in backends:
            backend = get_backend(name, device, HEAD_DIM)
            out = backend.forward(q, kv, meta)
            torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
            t = _time(lambda b=backend, q=q, kv=kv, meta=meta: b.forward(q, kv, meta), repeats)
            row[f"{name}_ms"] = round(t * 1000, 3)
            row[f"{name}_gflops"] = round(flops / t / 1e9, 1)
            row[f"{name}_over_sdpa"] = round(t / t_sdpa, 2)
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def run(batches, contexts, blocks, dtypes, backends, repeats: int, seed: int = 0, device: str = "cpu",
        order: str = "shuffled", kv_formats: tuple[str, ...] = ()) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, ctx, block, dtype_name in itertools.product(batches, contexts, blocks, dtypes):
        dtype = getattr(torch, dtype_name)
        q, kv, meta, qd, kd, vd = case(batch, ctx, block, dtype, gen, device, order=order)  # qd: [b, h, 1, d]
        sdpa = _time(lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True),
                     repeats)
        row = {"batch": batch, "context": ctx, "block_size": block, "dtype": dtype_name, "block_order": order,
               "sdpa_contiguous_ms": round(sdpa * 1000, 3)}
        ref_out = None
        for name in backends:
            backend = get_backend(name, device, HEAD_DIM)
            out = backend.forward(q, kv, meta)
            if ref_out is None:
                ref_out = F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True).squeeze(2)
            torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
            t = _time(lambda b=backend, q=q, kv=kv, meta=meta: b.forward(q, kv, meta), repeats)
            row[f"{name}_ms"] = round(t * 1000, 3)
            row[f"{name}_over_sdpa"] = round(t / sdpa, 2)
            for fmt in kv_formats:
                quantized = quantized_copy(kv, fmt)
                got = backend.forward(q, quantized, meta).float()
                error = float((got - out.float()).abs().max() / out.float().abs().max())
                if error > QUANTIZED_TOLERANCE[fmt]:
                    raise AssertionError(f"{name} over {fmt} KV is off by {error:.3f} of the float output")
                tq = _time(lambda b=backend, q=q, kv=quantized, meta=meta: b.forward(q, kv, meta), repeats)
                row[f"{name}_{fmt}_ms"] = round(tq * 1000, 3)
                row[f"{name}_{fmt}_over_float"] = round(tq / t, 2)
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def run_block_orders(batches, contexts, blocks, dtypes, repeats: int, seed: int = 0, device: str = "cpu",
                     backend_name: str = "cpu") -> list[dict]:
    """Merging, measured: decode over shuffled blocks against the same shapes over adjacent ones (each
    sequence's blocks one physical run, in order), timed in alternation call by call (A, B, A,
    B...) so that drift on a shared machine falls on both; medians and their ratio."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    backend = get_backend(backend_name, device, HEAD_DIM)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for batch, ctx, block, dtype_name in itertools.product(batches, contexts, blocks, dtypes):
        dtype = getattr(torch, dtype_name)
        cases = {order: case(batch, ctx, block, dtype, gen, device, order=order) for order in ("shuffled", "adjacent")}
        times: dict[str, list[float]] = {order: [] for order in cases}
        for _ in range(repeats + 1):
            for order, (q, kv, meta, *_) in cases.items():
                t0 = time.perf_counter()
                backend.forward(q, kv, meta)
                sync()
                times[order].append(time.perf_counter() - t0)
        med = {order: statistics.median(t[1:]) for order, t in times.items()}  # the first call warms up
        row = {"batch": batch, "context": ctx, "block_size": block, "dtype": dtype_name, "backend": backend_name,
               "shuffled_ms": round(1000 * med["shuffled"], 3), "adjacent_ms": round(1000 * med["adjacent"], 3),
               "adjacent_over_shuffled": round(med["adjacent"] / med["shuffled"], 3)}
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def plot(rows: list[dict], backends, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    block = 16 if any(r["block_size"] == 16 for r in rows) else rows[0]["block_size"]
    for name in backends:
        for batch in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if r["batch"] == batch and r["block_size"] == block
                   and r["dtype"] == rows[0]["dtype"] and r["block_order"] == rows[0]["block_order"]]
            ax.plot([r["context"] for r in sel], [r[f"{name}_over_sdpa"] for r in sel], "o-",
                    label=f"{name}, batch {batch}")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time / contiguous SDPA")
    ax.set_title(f"Paged decode attention, block {block}, {rows[0]['dtype']}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> list[dict]:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    backends = args.backends.split(",")
    measure = run_prefill if args.prefill else run
    orders = [o.strip() for o in args.block_order.split(",")]
    if sorted(orders) == ["adjacent", "shuffled"] and not args.prefill:  # merging: paired, alternating
        rows = run_block_orders(ints(args.batch), ints(args.context), ints(args.block_size), args.dtype.split(","),
                                args.repeats, args.seed, args.device, backends[0])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
        return rows
    rows = []
    for order in orders:
        extra = {} if args.prefill else {"kv_formats": tuple(f for f in args.kv_cache_dtypes.split(",") if f)}
        rows += measure(ints(args.batch), ints(args.context), ints(args.block_size), args.dtype.split(","), backends,
                        args.repeats, args.seed, args.device, order.strip(), **extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    if args.plot and not args.prefill:
        plot(rows, backends, args.plot)
    return rows


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench attention``'s flags."""
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--context", default="128,512,2048,4096")
    p.add_argument("--block-size", default="16")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", default="cpu,reference")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--plot", default=None)
    p.add_argument("--block-order", default="shuffled",
                   help="shuffled (a pool after churn), adjacent (merged runs), or both: timed in alternation")
    p.add_argument("--kv-cache-dtypes", default="",
                   help="decode also over the K/V stored in these quantized formats (int8, fp8_e4m3, fp8_e5m2, int4)")
    p.add_argument("--prefill", action="store_true",
                   help="causal prefill of --context tokens per sequence instead of decode (GFLOP/s)")
