"""``pagedllm simulate``: a trace replayed for a model shape on a device, paged and contiguous KV side by side.

The KV pool is what the device's memory holds after the weights: ``--kv-memory`` bytes if given
(or a share of the memory left, "25%"), else ``--memory-utilization`` of the device less the
weights (vLLM's ``gpu_memory_utilization``, 0.9). Both layouts get the same pool; the contiguous
one reserves ``max_model_len`` per request, as systems before PagedAttention did. Prints one
table (throughput, TTFT/TPOT, memory, fragmentation, batch, preemptions, hit rate), optionally
PNG plots of memory and batch over time, and a JSON report.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pagedllm.bench.mission import CLAIMED_SETUP, cost_per_m_tokens, format_table
from pagedllm.bench.shapes import DTYPE_BYTES, get_device, get_model
from pagedllm.bench.simulator import SimulationResult, StepTimeModel, simulate
from pagedllm.bench.traces import make_trace, read_trace
from pagedllm.config import CacheConfig, SchedulerConfig, parse_memory_budget


def kv_pool_bytes(device_memory: int, weight_bytes: int, kv_memory: str | None, utilization: float) -> int:
    """Bytes for KV blocks: ``kv_memory`` ("8GiB", "25%" of what the weights leave), else
    ``utilization`` x memory - weights. Raises when nothing is left."""
    left = device_memory - weight_bytes
    budget = None if kv_memory is None else parse_memory_budget(kv_memory)  # the engine's own parser
    if budget is None:
        pool = int(utilization * device_memory) - weight_bytes
    elif isinstance(budget, str):  # "25%"
        pool = int(float(budget[:-1]) / 100 * left)
    else:
        pool = int(budget)
        if pool > left:
            raise ValueError(f"--kv-memory {kv_memory} does not fit: the weights leave {left / 2**30:.1f} GiB")
    if pool <= 0:
        raise ValueError(f"no memory left for the KV cache: the weights take {weight_bytes / 2**30:.1f} GiB "
                         f"of {device_memory / 2**30:.1f} GiB")
    return pool


def load_trace(args):
    if args.trace:
        return read_trace(args.trace)
    return make_trace(args.workload, args.num_requests, float(args.rate), args.seed)


def setup(args) -> tuple[StepTimeModel, list, int, SchedulerConfig]:
    """(step-time model, trace, KV pool bytes, scheduler config) from the command's arguments."""
    model, device = get_model(args.model), get_device(args.device)
    timing = StepTimeModel(model, device, DTYPE_BYTES[args.dtype], DTYPE_BYTES[args.kv_dtype])
    pool = kv_pool_bytes(device.memory_bytes, model.weight_bytes(timing.dtype_bytes), args.kv_memory,
                         args.memory_utilization)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs or 256, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens or 8192)
    return timing, load_trace(args), pool, sched


def run(args) -> dict:
    from tqdm import tqdm

    timing, trace, pool, sched = setup(args)
    model, device = timing.model, timing.device
    bytes_per_block = args.block_size * model.kv_bytes_per_token(timing.kv_dtype_bytes)
    num_blocks = int(pool // bytes_per_block)
    layouts = ["contiguous", "paged"] if args.layout == "both" else [args.layout]
    price = device.price_per_hour if args.price_per_hour is None else args.price_per_hour
    report = {"model": model.name, "device": device.name, "requests": len(trace), "kv_pool_bytes": pool,
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
    reserve of large blocks (``bench/placement.py``)."""
    from pagedllm.bench.placement import compare_placements

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


def format_report(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']}: {report['requests']} requests, KV pool "
             f"{report['kv_pool_bytes'] / 2**30:.2f} GiB = {report['num_blocks']} blocks of {report['block_size']}, "
             f"max_model_len {report['max_model_len']}, ${report['price_per_hour']}/machine-hour"]
    lines.append(format_table(report["results"], claims=report["claims"]))
    for label, key in (("simulated seconds", "makespan_s"), ("wall seconds", "wall_s")):
        lines.append(f"{label:<34}" + "  ".join(f"{name}: {r[key]}" for name, r in report["results"].items()))
    if report["claims"]:
        lines.append(f"(claimed: the mission's figures for {CLAIMED_SETUP})")
    return "\n".join(lines)


def plot_timeline(results: dict[str, SimulationResult], path: Path, title: str, xlabel: str) -> None:
    """One PNG, three panels over time for each run: KV memory held, sequences in the step, and
    fragmentation. Shared by ``simulate --plot`` and ``bench compare --plot``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = max((s.used_blocks * r.bytes_per_block for r in results.values() for s in r.steps), default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for name, res in results.items():
        t = [s.time for s in res.steps]
        per_token = res.bytes_per_block / res.block_size
        axes[0].plot(t, [s.used_blocks * (s.block_size or res.block_size) * per_token / scale for s in res.steps],
                     label=name)
        axes[1].plot(t, [s.num_seqs for s in res.steps], label=name)
        axes[2].plot(t, [100 * s.fragmentation for s in res.steps], label=name)
    for ax, label in zip(axes, (f"KV memory held ({unit})", "sequences in the step", "fragmentation (%)"),
                         strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].set_xlabel(xlabel)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: dict[str, SimulationResult], folder: Path, report: dict) -> None:
    plot_timeline(results, folder / "simulate_memory_batch.png",
                  f"{report['model']} on {report['device']}, {report['requests']} requests", "simulated time (s)")


def main(args) -> dict:
    if args.calibrate:
        from pagedllm.bench import calibrate

        return calibrate.main(args)
    if args.sweep_block_size:
        from pagedllm.bench import block_size

        return block_size.main(args)
    if args.placements:
        return run_placements(args)
    if not math.isfinite(args.memory_utilization) or not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    return run(args)
