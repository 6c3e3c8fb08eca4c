"""What one gloo all-reduce costs between processes on this machine (docs/tensor_parallel.md): the
median of ``--iters`` in-place sums of a [rows, hidden] float32 tensor over N local processes, the
activations a tensor-parallel step sums twice per layer.

    .venv/bin/python scripts/tp_allreduce_cost.py --world 3 --rows 1,8,64 --hidden 576
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from pagedllm.parallel.collectives import Collectives, free_port


def rank_main(rank: int, world: int, port: int, rows: list[int], hidden: int, iters: int, results) -> None:
    torch.set_num_threads(1)
    c = Collectives("127.0.0.1", port, rank, world)
    out = {}
    for n in rows:
        x = torch.randn(n, hidden)
        for _ in range(20):
            c.all_reduce_(x)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            c.all_reduce_(x)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    if rank == 0:
        results.put(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, rows, args.hidden, args.iters, results))
             for r in range(args.world)]
    for p in procs:
        p.start()
    out = results.get(timeout=600)
    for p in procs:
        p.join()
    for n, s in out.items():
        print(f"N={args.world} [{n}, {args.hidden}] float32: {1e6 * s:.0f} us per all-reduce (median of {args.iters})")


if __name__ == "__main__":
    main()
