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


def run(args) -> dict:
    from tqdm import tqdm

    model, device = get_model(args.model), get_device(args.device)
    timing = StepTimeModel(model, device, DTYPE_BYTES[args.dtype], DTYPE_BYTES[args.kv_dtype])
    trace = load_trace(args)
    pool = kv_pool_bytes(device.memory_bytes, model.weight_bytes(timing.dtype_bytes), args.kv_memory,
                         args.memory_utilization)
    bytes_per_block = args.block_size * model.kv_bytes_per_token(timing.kv_dtype_bytes)
    num_blocks = int(pool // bytes_per_block)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs or 256, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens or 8192)
    layouts = ["paged", "contiguous"] if args.layout == "both" else [args.layout]
    report = {"model": model.name, "device": device.name, "requests": len(trace), "kv_pool_bytes": pool,
              "num_blocks": num_blocks, "block_size": args.block_size, "results": {}}
    results: dict[str, SimulationResult] = {}
    for layout in layouts:
        cache = CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks, kv_layout=layout,
                            enable_prefix_caching=layout == "paged" and args.prefix_caching)
        bar = tqdm(total=len(trace), desc=f"simulate {layout}", unit="req", disable=args.no_progress, leave=False)
        t0 = time.perf_counter()
        results[layout] = simulate(trace, timing, cache, sched, num_blocks, progress=bar.update)
        bar.close()
        summary = results[layout].summary()
        summary["wall_s"] = round(time.perf_counter() - t0, 2)
        report["results"][layout] = summary
    print(format_report(report))
    if args.plot:
        plot(results, Path(args.plot), report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


ROWS = [("output tokens/s", "output_tokens_per_s"), ("requests/s", "requests_per_s"),
        ("TTFT p50 / p99 (s)", ("ttft_p50_s", "ttft_p99_s")), ("TPOT p50 / p99 (s)", ("tpot_p50_s", "tpot_p99_s")),
        ("peak KV memory (GiB)", "peak_kv_bytes"), ("fragmentation mean / max", ("mean_fragmentation",
                                                                               "max_fragmentation")),
        ("batch mean / max", ("mean_batch", "max_batch")), ("preemptions", "preemptions"),
        ("prefix-cache hit rate", "prefix_cache_hit_rate"), ("finished / rejected", ("finished", "rejected")),
        ("simulated seconds", "makespan_s"), ("wall seconds", "wall_s")]


def _cell(summary: dict, key) -> str:
    if isinstance(key, tuple):
        return " / ".join(_cell(summary, k) for k in key)
    v = summary.get(key)
    if key == "peak_kv_bytes":
        return f"{v / 2**30:.2f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_report(report: dict) -> str:
    layouts = list(report["results"])
    lines = [f"{report['model']} on {report['device']}: {report['requests']} requests, KV pool "
             f"{report['kv_pool_bytes'] / 2**30:.2f} GiB = {report['num_blocks']} blocks of {report['block_size']}"]
    lines.append(f"{'':<28}" + "".join(f"{name:>24}" for name in layouts))
    for label, key in ROWS:
        lines.append(f"{label:<28}" + "".join(f"{_cell(report['results'][n], key):>24}" for n in layouts))
    return "\n".join(lines)


def plot(results: dict[str, SimulationResult], folder: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, res in results.items():
        t = [s.time for s in res.steps]
        axes[0].plot(t, [s.used_blocks * res.bytes_per_block / 2**30 for s in res.steps], label=name)
        axes[1].plot(t, [s.num_seqs for s in res.steps], label=name)
    axes[0].set_ylabel("KV memory held (GiB)")
    axes[1].set_ylabel("sequences in the step")
    axes[1].set_xlabel("simulated time (s)")
    axes[0].legend()
    fig.suptitle(f"{report['model']} on {report['device']}, {report['requests']} requests")
    fig.tight_layout()
    fig.savefig(folder / "simulate_memory_batch.png", dpi=110)
    plt.close(fig)


def main(args) -> dict:
    if args.calibrate:
        from pagedllm.bench import calibrate

        return calibrate.main(args)
    if not math.isfinite(args.memory_utilization) or not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    return run(args)
