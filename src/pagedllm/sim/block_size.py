"""Block size by formula: ``pagedllm simulate --sweep-block-size``.

For each block size B (``--block-sizes``, default 8..128) the trace is replayed by the simulator
(paged layout, the same KV pool bytes, so fewer blocks as B grows) and the mission's rule picks

    B_opt = argmin_B  Memory(B) / B  +  alpha * Overhead(B)        (alpha 0.2-0.5, ``--alpha``)

with the terms defined so that both are shares of the run's cost (docs/simulator.md):

- ``Memory(B)``: the mean number of unfilled KV slots per held block over the run's steps (each
  sequence's partly filled last block; 0..B-1 per block). ``Memory(B) / B`` is then the share of
  the KV memory held that holds no token: the fragmentation every other report shows.
- ``Overhead(B)``: block-management and kernel time per token, as a share of the step time per
  token at that B: ``(control(B) + d * (kernel(B) - min_B kernel)) / token_time(B)``. ``control(B)``:
  the wall time of the engine's own control plane (scheduler, block tables, allocator, prefix
  cache: the simulator runs exactly that Python; its ``schedule()`` and ``update()`` calls are
  timed) per token processed, measured here. ``kernel(B)``: the decode attention time per token
  with blocks of B, measured on this machine with the C++ kernel (``--kernel-times``; SmolLM2 on
  this CPU only: the kernel is this machine's); ``d`` the share of processed tokens that are
  decoded (prefill tokens do not run the decode kernel). ``token_time(B)``: the step-time
  model's busy seconds per token.

Block-table entries per token (one allocator call and one free per entry) are reported beside
them. ``--check-engine`` then runs the real engine at B_opt and its neighbours on the same trace
(SmolLM2 on this CPU), so the choice is checked against measured throughput, not only the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pagedllm.config import CacheConfig
from pagedllm.sim.simulator import simulate

BLOCK_SIZES = (8, 16, 32, 64, 128)
KERNEL_BATCH = 32  # sequences per decode step when timing the kernel


def parse_block_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--block-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 8 or b > 128 or b & (b - 1) for b in sizes):
        raise ValueError(f"--block-sizes must be powers of two in 8..128, got {text!r}")
    return sizes


def objective(point: dict, alpha: float) -> float:
    return point["memory"] / point["block_size"] + alpha * point["overhead"]


def sweep(trace, timing, pool_bytes: int, sched, block_sizes, alpha: float, prefix_caching: bool = True,
          kernel_s_per_token: dict[int, float] | None = None, progress=None) -> list[dict]:
    """One simulated run per block size; the formula's terms and the run's summary for each."""
    points = []
    for b in block_sizes:
        num_blocks = int(pool_bytes // (b * timing.model.kv_bytes_per_token(timing.kv_dtype_bytes)))
        cache = CacheConfig(block_size=b, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching)
        res = simulate(trace, timing, cache, sched, num_blocks)
        control = res.control_s
        s = res.summary()
        tokens = sum(step.num_tokens for step in res.steps)
        busy = sum(step.seconds for step in res.steps)
        done = [r for r in res.requests if r.status == "length"]
        decode_share = sum(r.output_len - 1 for r in done) / tokens  # tokens that run the decode kernel
        entries = sum(math.ceil((r.prompt_len + r.output_len) / b) for r in done)
        points.append({
            "block_size": b, "num_blocks": num_blocks, "memory": s["mean_fragmentation"] * b,
            "memory_share": s["mean_fragmentation"], "control_s_per_token": control / tokens,
            "token_s": busy / tokens, "table_entries_per_token": round(entries / max(1, sum(
                r.prompt_len + r.output_len for r in done)), 4),
            "kernel_s_per_token": None if kernel_s_per_token is None else kernel_s_per_token[b],
            "decode_share": round(decode_share, 4),
            "output_tokens_per_s": s["output_tokens_per_s"], "ttft_p99_s": s["ttft_p99_s"],
            "preemptions": s["preemptions"], "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
            "max_batch": s["max_batch"], "finished": s["finished"], "rejected": s["rejected"],
        })
        if progress is not None:
            progress(1)
    kernel_floor = min((p["kernel_s_per_token"] for p in points if p["kernel_s_per_token"] is not None), default=0.0)
    for p in points:
        extra = 0.0 if p["kernel_s_per_token"] is None else (p["kernel_s_per_token"] - kernel_floor) * p["decode_share"]
        p["overhead"] = round((p["control_s_per_token"] + extra) / p["token_s"], 6)
        p["objective"] = round(objective(p, alpha), 6)
    return points


def choose(points: list[dict]) -> int:
    return min(points, key=lambda p: (p["objective"], p["block_size"]))["block_size"]


def measure_kernel(block_sizes, context: int, repeats: int = 20) -> dict[int, float]:
    """Seconds of decode attention per decoded token for SmolLM2 (every layer), batch ``KERNEL_BATCH``
    at ``context`` tokens, with the C++ kernel, per block size: medians of ``repeats`` calls, the
    block sizes taking turns call by call so that drift on a shared machine falls on all of them."""
    import statistics
    import time

    import torch

    from pagedllm.attention.backends import get_backend
    from pagedllm.attention.random_case import random_paged_case
    from pagedllm.sim.shapes import MODELS

    layers = MODELS["smollm2-135m"].num_layers
    backend = get_backend("cpu", "cpu", 64)
    gen = torch.Generator().manual_seed(0)
    cases = {b: random_paged_case(KERNEL_BATCH, context, b, torch.bfloat16, gen, "cpu")[:3] for b in block_sizes}
    times: dict[int, list[float]] = {b: [] for b in block_sizes}
    for _ in range(repeats + 1):
        for b, (q, kv, meta) in cases.items():
            t0 = time.perf_counter()
            backend.forward(q, kv, meta)
            times[b].append(time.perf_counter() - t0)
    return {b: statistics.median(t[1:]) * layers / KERNEL_BATCH for b, t in times.items()}


def check_engine(args, trace, block_sizes: list[int], pool_bytes: int) -> list[dict]:
    """The real engine (paged, prefix caching as in the sweep) at each of ``block_sizes`` on ``trace``,
    all at once, with the sweep's pool bytes: measured output tokens/s and fragmentation."""
    from pagedllm import LLM
    from pagedllm.sim.engine_replay import replay

    rows = []
    for b in block_sizes:
        llm = LLM(model=args.engine_model, dtype=args.dtype, block_size=b, kv_cache_memory=pool_bytes,
                  enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs or 256, max_num_batched_tokens=args.max_num_batched_tokens or 8192)
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], use_tqdm=False)  # warm-up
        s = replay(llm.engine, trace, 0.0).summary()
        rows.append({"block_size": b, "output_tokens_per_s": s["output_tokens_per_s"],
                     "mean_fragmentation": s["mean_fragmentation"], "max_batch": s["max_batch"],
                     "prefix_cache_hit_rate": s["prefix_cache_hit_rate"], "finished": s["finished"]})
        del llm
    return rows


class DynamicBlockSize:
    """The dynamic block-size policy: whenever the pool is empty and at least ``min_new`` more
    requests have finished since the last plan, B is re-chosen by the formula from the lengths of
    the last ``window`` finished requests (replayed at once by ``sweep``, with the same pool bytes);
    a different B rebuilds the pool (``simulate(replan=...)``)."""

    def __init__(self, timing, pool_bytes: int, sched, sizes, alpha: float, prefix_caching: bool = True,
                 window: int = 256, min_new: int = 64) -> None:
        self.timing, self.pool_bytes, self.sched, self.sizes = timing, pool_bytes, sched, list(sizes)
        self.alpha, self.prefix_caching, self.window, self.min_new = alpha, prefix_caching, window, min_new
        self.planned_at = 0

    def cache_config(self, block_size: int) -> CacheConfig:
        per_block = block_size * self.timing.model.kv_bytes_per_token(self.timing.kv_dtype_bytes)
        return CacheConfig(block_size=block_size, num_kv_blocks=int(self.pool_bytes // per_block),
                           enable_prefix_caching=self.prefix_caching)

    def __call__(self, finished) -> CacheConfig | None:
        if len(finished) - self.planned_at < self.min_new:
            return None
        self.planned_at = len(finished)
        from pagedllm.workloads.traces import TraceRequest

        observed = [TraceRequest(arrival=0.0, prompt_len=r.prompt_len, output_len=r.output_len)
                    for r in finished[-self.window:]]
        points = sweep(observed, self.timing, self.pool_bytes, self.sched, self.sizes, self.alpha, self.prefix_caching)
        return self.cache_config(choose(points))


def compare_dynamic(trace, timing, pool_bytes: int, sched, sizes, alpha: float, start: int,
                    prefix_caching: bool = True) -> dict:
    """The trace at every fixed B, and with the dynamic policy starting from ``start``."""
    policy = DynamicBlockSize(timing, pool_bytes, sched, sizes, alpha, prefix_caching)
    out = {}
    for b in sizes:
        cache = policy.cache_config(b)
        out[f"fixed {b}"] = simulate(trace, timing, cache, sched, cache.num_kv_blocks).summary()
    cache = policy.cache_config(start)
    res = simulate(trace, timing, cache, sched, cache.num_kv_blocks, replan=policy)
    out[f"dynamic from {start}"] = {**res.summary(), "replans": res.replans}
    return out


def neighbours(chosen: int, sizes: list[int]) -> list[int]:
    i = sizes.index(chosen)
    return sizes[max(0, i - 1):i + 2]


def format_points(points: list[dict], alpha: float, chosen: int) -> str:
    lines = [f"{'B':>4} {'blocks':>8} {'Memory(B)':>10} {'Memory/B':>9} {'ctrl us/tok':>11} {'kern us/tok':>11} "
             f"{'Overhead':>9} {'objective':>10} {'entries/tok':>11} {'out tok/s':>10} {'TTFT p99':>9} "
             f"{'hit rate':>8} {'preempt':>7}"]
    for p in points:
        kernel = "-" if p["kernel_s_per_token"] is None else f"{1e6 * p['kernel_s_per_token']:.1f}"
        mark = "  <- B_opt" if p["block_size"] == chosen else ""
        lines.append(f"{p['block_size']:>4} {p['num_blocks']:>8} {p['memory']:>10.2f} {100 * p['memory_share']:>8.2f}% "
                     f"{1e6 * p['control_s_per_token']:>11.2f} {kernel:>11} {100 * p['overhead']:>8.3f}% "
                     f"{100 * p['objective']:>9.3f}% {p['table_entries_per_token']:>11.4f} "
                     f"{p['output_tokens_per_s']:>10.1f} {p['ttft_p99_s'] or 0:>9.3f} "
                     f"{100 * p['prefix_cache_hit_rate']:>7.1f}% {p['preemptions']:>7}{mark}")
    lines.append(f"B_opt = argmin Memory(B)/B + {alpha} * Overhead(B) = {chosen}")
    return "\n".join(lines)


def plot(points: list[dict], alpha: float, chosen: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [p["block_size"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(b, [100 * p["memory_share"] for p in points], "o-", label="Memory(B)/B (unfilled share)")
    ax.plot(b, [100 * alpha * p["overhead"] for p in points], "s-", label=f"{alpha} x Overhead(B)")
    ax.plot(b, [100 * p["objective"] for p in points], "k^-", label="objective")
    ax.axvline(chosen, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("% of KV memory / of step time")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> dict:
    from tqdm import tqdm

    from pagedllm.sim.inputs import setup

    if not 0 < args.alpha <= 10:
        raise ValueError(f"--alpha must be in (0, 10], got {args.alpha}")
    sizes = parse_block_sizes(args.block_sizes)
    on_this_cpu = (args.model, args.device) == ("smollm2-135m", "this-cpu")
    if (args.kernel_times or args.check_engine) and not on_this_cpu:
        raise ValueError("--kernel-times and --check-engine measure this machine: use them with "
                         "--model smollm2-135m --device this-cpu")
    if args.check_engine and args.kv_memory is None:
        raise ValueError("--check-engine needs --kv-memory (the pool the engine allocates, e.g. 384MiB)")
    timing, trace, pool, sched = setup(args)
    mean_len = sum((r.prompt_len or 0) + r.output_len for r in trace) / len(trace)
    kernel = measure_kernel(sizes, max(16, round(mean_len))) if args.kernel_times else None
    with tqdm(total=len(sizes), desc="sweep block size", disable=args.no_progress, leave=False) as bar:
        points = sweep(trace, timing, pool, sched, sizes, args.alpha, args.prefix_caching, kernel, bar.update)
    chosen = choose(points)
    report = {"model": timing.model.name, "device": timing.device.name, "requests": len(trace),
              "trace": args.trace or args.workload, "kv_pool_bytes": pool, "alpha": args.alpha,
              "mean_sequence_len": round(mean_len, 1), "points": points, "block_size_opt": chosen,
              "by_alpha": {str(a): choose([{**p, "objective": objective(p, a)} for p in points])
                           for a in (0.2, 0.3, 0.4, 0.5)}}
    print(f"{timing.model.name} on {timing.device.name}: {len(trace)} requests of {report['trace']} (mean "
          f"prompt + output {mean_len:.0f} tokens), KV pool {pool / 2**30:.2f} GiB")
    print(format_points(points, args.alpha, chosen))
    print("B_opt for alpha 0.2 / 0.3 / 0.4 / 0.5: " + " / ".join(str(v) for v in report["by_alpha"].values()))
    if args.check_engine:
        check = trace[:args.check_requests]
        report["engine_check"] = check_engine(args, check, neighbours(chosen, sizes), pool)
        print(f"engine check, {len(check)} requests at once:")
        for r in report["engine_check"]:
            print(f"  B={r['block_size']:>3}: {r['output_tokens_per_s']:.1f} output tok/s, fragmentation "
                  f"{100 * r['mean_fragmentation']:.2f}%, hit rate {100 * r['prefix_cache_hit_rate']:.1f}%, "
                  f"max batch {r['max_batch']}")
    if args.adaptive:
        report["dynamic"] = compare_dynamic(trace, timing, pool, sched, sizes, args.alpha, args.start_block_size,
                                            args.prefix_caching)
        print("dynamic block size (re-planned when the pool is empty) against each fixed B:")
        for name, r in report["dynamic"].items():
            extra = f", re-plans (s, B): {[(round(t, 1), b) for t, b in r['replans']]}" if "replans" in r else ""
            print(f"  {name:>16}: {r['output_tokens_per_s']:.1f} out tok/s, TTFT p99 {r['ttft_p99_s']} s, "
                  f"fragmentation {100 * r['mean_fragmentation']:.2f}%, peak KV {r['peak_kv_bytes'] / 2**30:.2f} GiB, "
                  f"preemptions {r['preemptions']}{extra}")
    if args.plot:
        plot(points, args.alpha, chosen, Path(args.plot) / "block_size_sweep.png",
             f"{timing.model.name} on {timing.device.name}, {report['trace']}: B_opt = {chosen}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report
