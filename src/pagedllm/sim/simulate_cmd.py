"""``pagedllm simulate``: a trace replayed for a model shape on a device, paged and contiguous KV side by side.

The KV pool is what the device's memory holds after the weights: ``--kv-memory`` bytes if given
(or a share of the memory left, "25%"), else ``--memory-utilization`` of the device less the
weights (vLLM's ``gpu_memory_utilization``, 0.9). Both layouts get the same pool; the contiguous
one reserves ``max_model_len`` per request, as systems before PagedAttention did. Prints one
table (throughput, TTFT/TPOT, memory, fragmentation, batch, preemptions, hit rate), optionally
PNG plots of memory and batch over time, and a JSON report.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from pagedllm.cli_args import add_shape_presets, add_trace_source
from pagedllm.config import KV_CACHE_DTYPES, CacheConfig, check_block_size
from pagedllm.sim.inputs import add_tensor_parallel_args, setup
from pagedllm.sim.mission import CLAIMED_SETUP, cost_per_m_tokens, format_table
from pagedllm.sim.simulator import SimulationResult, simulate
from pagedllm.sim.timeline import plot_timeline


def run(args) -> dict:
    from tqdm import tqdm

    timing, trace, pool, sched = setup(args)
    model, device = timing.model, timing.device
    bytes_per_block = args.block_size * model.kv_bytes_per_token(timing.kv_dtype_bytes)
    num_blocks = int(pool // bytes_per_block)
    layouts = ["contiguous", "paged"] if args.layout == "both" else [args.layout]
    price = device.price_per_hour if args.price_per_hour is None else args.price_per_hour
    n = timing.tensor_parallel_size
    report = {"model": model.name, "device": device.name, "requests": len(trace), "kv_pool_bytes": pool,
              "tensor_parallel": None if n == 1 else tensor_parallel_report(timing, pool),
              "kv_cache_dtype": args.kv_cache_dtype,
              "num_blocks": num_blocks, "block_size": args.block_size, "max_model_len": args.max_model_len,
              "contiguous_reservation": args.contiguous_reservation,
              "price_per_hour": price, "claims": (args.model, args.device) == ("llama-2-13b", "a100-80gb"),
              "results": {}}
    results: dict[str, SimulationResult] = {}
    for layout in layouts:
        cache = CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks, kv_layout=layout,
                            enable_prefix_caching=layout == "paged" and args.prefix_caching,
                            contiguous_reservation=args.contiguous_reservation)
        bar = tqdm(total=len(trace), desc=f"simulate {layout}", unit="req", disable=args.no_progress, leave=False)
        t0 = time.perf_counter()
        results[layout] = simulate(trace, timing, cache, sched, num_blocks, progress=bar.update)
        bar.close()
        summary = results[layout].summary()
        summary["wall_s"] = round(time.perf_counter() - t0, 2)
        summary["cost_per_m_tokens"] = cost_per_m_tokens(price, summary["output_tokens_per_s"])
        report["results"][layout] = summary
    print(format_report(report))
    if args.plot:
        plot(results, Path(args.plot), report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def run_placements(args) -> dict:
    """``--placements``: the trace (paged) with the policy's placement, merging adjacent blocks, and a
    reserve of large blocks (``sim/placement.py``)."""
    from pagedllm.sim.placement import compare_placements

    timing, trace, pool, sched = setup(args)
    num_blocks = int(pool // (args.block_size * timing.model.kv_bytes_per_token(timing.kv_dtype_bytes)))
    cache = CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks, enable_prefix_caching=args.prefix_caching)
    results = compare_placements(trace, timing, cache, sched, num_blocks, reserve_share=args.reserve_share,
                                 run_blocks=args.run_blocks, threshold_blocks=args.threshold_blocks)
    report = {"model": timing.model.name, "device": timing.device.name, "requests": len(trace),
              "num_blocks": num_blocks, "block_size": args.block_size, "prefix_caching": args.prefix_caching,
              "reserve": {"share": args.reserve_share, "run_blocks": args.run_blocks,
                          "threshold_blocks": args.threshold_blocks}, "results": results}
    print(f"{timing.model.name} on {timing.device.name}: {len(trace)} requests, {num_blocks} blocks of "
          f"{args.block_size}, prefix caching {'on' if args.prefix_caching else 'off'}; reserve: "
          f"{args.reserve_share:.0%} in runs of {args.run_blocks} for sequences past {args.threshold_blocks} blocks")
    print(f"{'placement':<10}{'blocks/run':>11}{'out tok/s':>11}{'TTFT p99 s':>11}{'frag':>8}{'batch':>7}"
          f"{'preempt':>8}{'hit rate':>9}")
    for name, r in results.items():
        print(f"{name:<10}{r['blocks_per_run']:>11.2f}{r['output_tokens_per_s']:>11.1f}{r['ttft_p99_s'] or 0:>11.3f}"
              f"{100 * r['mean_fragmentation']:>7.2f}%{r['mean_batch']:>7.1f}{r['preemptions']:>8}"
              f"{100 * r['prefix_cache_hit_rate']:>8.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def tensor_parallel_report(timing, pool: int) -> dict:
    """Per rank under tensor parallelism: its weights and KV pool, and what a step's all-reduces cost
    (a decode step of 1 and 64 sequences, a 2,048-token prefill chunk) next to the whole step."""
    from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput

    def step(tokens_each: int, seqs: int, context: int) -> SchedulerOutput:
        return SchedulerOutput(chunks=[ScheduledChunk(str(i), [7] * tokens_each, context, [], sample=True)
                                       for i in range(seqs)])

    shapes = {"decode, 1 sequence at 1,024": step(1, 1, 1024), "decode, 64 sequences at 1,024": step(1, 64, 1024),
              "prefill, 2,048 tokens": step(2048, 1, 0)}
    return {"size": timing.tensor_parallel_size, "link": timing.link.name,
            "weights_per_rank_bytes": timing.model.weight_bytes(timing.dtype_bytes), "kv_pool_per_rank_bytes": pool,
            "kv_bytes_per_token_per_rank": timing.model.kv_bytes_per_token(timing.kv_dtype_bytes),
            "steps": {name: {"step_ms": round(1000 * timing.step_seconds(out), 3),
                             "allreduce_ms": round(1000 * timing.allreduce_seconds(out.num_batched_tokens), 3)}
                      for name, out in shapes.items()}}


def format_report(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']}: {report['requests']} requests, KV pool "
             f"{report['kv_pool_bytes'] / 2**30:.2f} GiB = {report['num_blocks']} blocks of {report['block_size']}, "
             f"max_model_len {report['max_model_len']}, ${report['price_per_hour']}/machine-hour"]
    tp = report.get("tensor_parallel")
    if tp:
        steps = "; ".join(f"{name} {s['allreduce_ms']} of {s['step_ms']} ms" for name, s in tp["steps"].items())
        lines.append(f"tensor parallel over {tp['size']} devices ({tp['link']}): per device "
                     f"{tp['weights_per_rank_bytes'] / 2**30:.1f} GiB of weights and "
                     f"{tp['kv_pool_per_rank_bytes'] / 2**30:.1f} GiB of KV "
                     f"({tp['kv_bytes_per_token_per_rank'] / 1024:.0f} KiB per token); all-reduces per step: {steps}")
    lines.append(format_table(report["results"], claims=report["claims"]))
    for label, key in (("simulated seconds", "makespan_s"), ("wall seconds", "wall_s")):
        lines.append(f"{label:<34}" + "  ".join(f"{name}: {r[key]}" for name, r in report["results"].items()))
    if report["claims"]:
        lines.append(f"(claimed: the mission's figures for {CLAIMED_SETUP})")
    return "\n".join(lines)


def plot(results: dict[str, SimulationResult], folder: Path, report: dict) -> None:
    plot_timeline(results, folder / "simulate_memory_batch.png",
                  f"{report['model']} on {report['device']}, {report['requests']} requests", "simulated time (s)")


def main(args) -> dict:
    check_block_size(args.block_size)  # the engine's rule and message, before any arithmetic on it
    if args.calibrate:
        from pagedllm.sim import calibrate

        return calibrate.main(args)
    if args.sweep_block_size:
        from pagedllm.sim import block_size

        return block_size.main(args)
    if args.placements:
        return run_placements(args)
    if not math.isfinite(args.memory_utilization) or not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    return run(args)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm simulate``'s flags: the trace, the shapes, the pool, and each mode's group."""
    add_trace_source(p)
    add_shape_presets(p)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_cache_dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's format (auto: --dtype's); a quantized one's scales counted")
    p.add_argument("--kv-memory", default=None, help="KV pool: bytes ('8GiB') or a share of what the weights "
                                                    "leave ('25%%'); default: --memory-utilization")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="share of the device's memory for weights + KV (vLLM's gpu_memory_utilization)")
    p.add_argument("--block-size", type=int, default=16)
    add_tensor_parallel_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (--calibrate: the engine's 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default 8192 (--calibrate: the engine's 1024)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--layout", default="both", choices=["both", "paged", "contiguous"])
    p.add_argument("--contiguous-reservation", default="max_model_len", choices=["max_model_len", "request"],
                   help="what a contiguous request reserves: max_model_len, or its own prompt + output length")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching for the paged layout")
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="dollars per machine-hour for the cost row (default: the device preset's)")
    p.add_argument("--plot", default=None, help="a folder for PNG plots")
    p.add_argument("--json", default=None, help="also write the report to this file")
    p.add_argument("--no-progress", action="store_true")
    cal = p.add_argument_group("calibration (--calibrate: fit this CPU's step-time model to the real engine)")
    cal.add_argument("--calibrate", action="store_true")
    cal.add_argument("--engine-model", default=None, help="the model the engine runs (default: the embedded one)")
    cal.add_argument("--calibration-workload", default="alpaca", choices=["sharegpt", "alpaca", "chat", "code"])
    cal.add_argument("--calibration-requests", type=int, default=48)
    cal.add_argument("--validate", default="sharegpt,code", help="held-out workloads, comma-separated")
    sw = p.add_argument_group("block size (--sweep-block-size: B_opt = argmin Memory(B)/B + alpha * Overhead(B))")
    sw.add_argument("--sweep-block-size", action="store_true")
    sw.add_argument("--block-sizes", default="8,16,32,64,128")
    sw.add_argument("--alpha", type=float, default=0.3, help="weight of Overhead(B) (the mission's 0.2-0.5)")
    sw.add_argument("--kernel-times", action="store_true",
                    help="measure the C++ decode kernel at each B for Overhead(B) (smollm2-135m on this-cpu)")
    sw.add_argument("--check-engine", action="store_true",
                    help="run the real engine at B_opt and its neighbours (smollm2-135m on this-cpu, --kv-memory)")
    sw.add_argument("--check-requests", type=int, default=32, help="the first N requests of the trace, at once")
    sw.add_argument("--adaptive", action="store_true",
                    help="also replay the trace with the dynamic block-size policy against each fixed B")
    sw.add_argument("--start-block-size", type=int, default=16, help="the dynamic policy's first B")
    pg = p.add_argument_group("placement (--placements: merging adjacent blocks, a reserve of large blocks)")
    pg.add_argument("--placements", action="store_true")
    pg.add_argument("--reserve-share", type=float, default=0.25, help="share of the pool held in large blocks")
    pg.add_argument("--run-blocks", type=int, default=4, help="blocks per large block (2-4)")
    pg.add_argument("--threshold-blocks", type=int, default=8,
                    help="a sequence holding this many blocks takes large ones")
