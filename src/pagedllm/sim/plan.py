"""``pagedllm plan``: what to deploy with, for a trace, a model and a device, asked of the simulator.

Five stages, each simulating the trace (paged layout, prefix caching on) and keeping the winner
for the next:

1. **Block size** by the formula (``block_size.sweep``: ``argmin Memory(B)/B + alpha * Overhead(B)``).
2. **KV memory**: the pool as a share of the memory the weights leave (``--memory-shares``, default
   10..90%); the recommendation is the smallest share whose throughput is within
   ``--tolerance`` (2%) of the best share's and that preempts no more than it: memory beyond that
   buys nothing on this trace. The mission's "pre-allocate 20-30% of memory" rule is checked
   against it: the recommended pool as a share of the device's memory, and what pools of 20% and
   30% of the device's memory give on the trace.
3. **Batch limits**: ``max_num_seqs`` x ``max_num_batched_tokens`` (``--max-num-seqs``,
   ``--max-num-batched-tokens``), ranked by output tokens/s, then TTFT p99, then preemptions.
4. **dtype** of the model (``--dtypes``: bfloat16, float16, float32), with its KV cache in the
   same dtype: it changes the weights' bytes too; the step model keeps the device's bf16 peak for
   every dtype, which flatters float32 on GPUs.
5. **KV format** (``--kv-cache-dtypes``, e.g. ``auto,int8,int4``): the same memory holds more
   blocks of a smaller format (its scales counted). The simulator models capacity and bytes
   read, not accuracy: docs/kv_quantization.md has each format's measured loss.

Prints the recommendation and its runners-up (the next configurations of the last ranking) with
simulated throughput, TTFT p99 and preemption rate (preemptions per request), and the options to
pass (``LLM(...)`` / ``pagedllm serve``); ``--json`` writes everything. No torch: seconds to a
minute for a thousand-request trace.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from pagedllm.cli_args import add_shape_presets, add_trace_source
from pagedllm.config import DTYPE_BYTES, KV_CACHE_DTYPES, CacheConfig, SchedulerConfig, kv_element_bytes
from pagedllm.sim.block_size import choose, parse_block_sizes, sweep
from pagedllm.sim.inputs import load_trace
from pagedllm.sim.shapes import LINKS, get_device, get_link, get_model
from pagedllm.sim.simulator import StepTimeModel, simulate

MEMORY_SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class Candidate:
    block_size: int
    memory_share: float
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: str  # the model's
    kv_cache_dtype: str = "auto"  # the KV cache's format (auto: the model's dtype)

    def options(self, pool_bytes: int) -> dict:
        return {"block_size": self.block_size, "kv_cache_memory": f"{pool_bytes // 2**20}MiB",
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype}


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be positive integers, got {text!r}")
    return values


def _shares(text: str) -> list[float]:
    try:
        values = [float(x.strip().rstrip("%")) / 100 for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--memory-shares must be percentages like 20%,30%, got {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise ValueError(f"--memory-shares must be in (0%, 100%], got {text!r}")
    return sorted(set(values))


class Planner:
    """Simulations of one model on ``tensor_parallel_size`` devices of one kind (``model`` is then
    one rank's share, and every step pays its all-reduces over ``link``)."""

    def __init__(self, trace, model, device, max_model_len: int, prefix_caching: bool = True,
                 memory_utilization: float = 0.9, tensor_parallel_size: int = 1, link=None) -> None:
        self.trace, self.model, self.device = trace, model.shard(tensor_parallel_size), device
        self.max_model_len, self.prefix_caching = max_model_len, prefix_caching
        self.memory_utilization = memory_utilization
        self.tensor_parallel_size, self.link = tensor_parallel_size, link
        self.runs = 0

    def usable(self, dtype: str) -> int:
        """Bytes left for KV at ``memory_utilization`` once the weights (in ``dtype``) are loaded."""
        weights = self.model.weight_bytes(DTYPE_BYTES[dtype])
        left = int(self.memory_utilization * self.device.memory_bytes) - weights
        if left <= 0:
            raise ValueError(f"{self.model.name} ({weights / 2**30:.1f} GiB of {dtype} weights) does not fit "
                             f"{self.device.name} ({self.device.memory_bytes / 2**30:.1f} GiB)")
        return left

    def pool_bytes(self, share: float, dtype: str) -> int:
        return int(share * self.usable(dtype))

    def timing(self, dtype: str, kv_cache_dtype: str = "auto") -> StepTimeModel:
        return StepTimeModel(self.model, self.device, DTYPE_BYTES[dtype],
                             kv_element_bytes(kv_cache_dtype, dtype, self.model.head_dim), self.tensor_parallel_size,
                             self.link if self.tensor_parallel_size > 1 else None)

    def sched(self, c: Candidate) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                               max_model_len=self.max_model_len)

    def evaluate(self, c: Candidate) -> dict:
        timing = self.timing(c.dtype, c.kv_cache_dtype)
        pool = self.pool_bytes(c.memory_share, c.dtype)
        num_blocks = int(pool // (c.block_size * self.model.kv_bytes_per_token(timing.kv_dtype_bytes)))
        if num_blocks < 1:
            return {"candidate": c, "pool_bytes": pool, "output_tokens_per_s": 0.0, "ttft_p99_s": None,
                    "preemption_rate": None, "finished": 0, "rejected": len(self.trace)}
        cache = CacheConfig(block_size=c.block_size, num_kv_blocks=num_blocks,
                            enable_prefix_caching=self.prefix_caching)
        self.runs += 1
        s = simulate(self.trace, timing, cache, self.sched(c), num_blocks).summary()
        return {"candidate": c, "pool_bytes": pool, "output_tokens_per_s": s["output_tokens_per_s"],
                "ttft_p99_s": s["ttft_p99_s"], "preemption_rate": round(s["preemptions"] / len(self.trace), 4),
                "finished": s["finished"], "rejected": s["rejected"], "mean_fragmentation": s["mean_fragmentation"],
                "peak_kv_bytes": s["peak_kv_bytes"]}


def rank_key(r: dict):
    """Higher throughput first, then fewer rejections, lower TTFT p99, fewer preemptions."""
    return (-r["output_tokens_per_s"], r["rejected"], r["ttft_p99_s"] if r["ttft_p99_s"] is not None else 1e30,
            r["preemption_rate"] if r["preemption_rate"] is not None else 1e30)


def smallest_sufficient(results: list[dict], tolerance: float) -> dict:
    """The smallest memory share within ``tolerance`` of the best throughput, preempting and
    rejecting no more than the best does."""
    best = min(results, key=rank_key)
    for r in sorted(results, key=lambda r: r["candidate"].memory_share):
        if (r["output_tokens_per_s"] >= (1 - tolerance) * best["output_tokens_per_s"]
                and r["rejected"] <= best["rejected"]
                and (r["preemption_rate"] or 0) <= (best["preemption_rate"] or 0)):
            return r
    return best


def choose_tensor_parallel(trace, model, device, sizes, start: Candidate, link_name: str | None,
                           max_model_len: int, prefix_caching: bool, memory_utilization: float) -> tuple[Planner, list]:
    """Stage 0: each size N that divides the model's heads, at the starting candidate. N whose weights
    do not fit a device are skipped; the recommendation is the size with the most output tokens/s per
    device (a GPU-hour's worth), the smaller on a tie within 2%. Returns its planner and every row."""
    rows, planners = [], {}
    for n in sizes:
        try:
            link = get_link(link_name or device.link) if n > 1 else None
            planner = Planner(trace, model, device, max_model_len, prefix_caching, memory_utilization, n, link)
            r = planner.evaluate(start)
        except ValueError as e:  # does not divide the heads, or the weights do not fit
            rows.append({"tensor_parallel_size": n, "skipped": str(e)})
            continue
        planners[n] = planner
        rows.append({"tensor_parallel_size": n, "output_tokens_per_s": r["output_tokens_per_s"],
                     "per_device": r["output_tokens_per_s"] / n, "ttft_p99_s": r["ttft_p99_s"],
                     "pool_bytes_per_device": r["pool_bytes"], "preemption_rate": r["preemption_rate"]})
    fitting = [r for r in rows if "skipped" not in r]
    if not fitting:
        raise ValueError(f"{model.name} fits {device.name} at none of the sizes {list(sizes)}: "
                         + "; ".join(r["skipped"] for r in rows))
    best = max(r["per_device"] for r in fitting)
    chosen = min((r for r in fitting if r["per_device"] >= 0.98 * best), key=lambda r: r["tensor_parallel_size"])
    for r in rows:
        r["chosen"] = r is chosen
    return planners[chosen["tensor_parallel_size"]], rows


def plan(planner: Planner, block_sizes, alpha: float, shares, seqs, batched, dtypes, tolerance: float,
         start: Candidate, progress=None, kv_cache_dtypes=("auto",)) -> dict:
    tick = progress or (lambda n: None)
    # 1. block size by the formula, at the starting limits and memory
    timing = planner.timing(start.dtype)
    points = sweep(planner.trace, timing, planner.pool_bytes(start.memory_share, start.dtype), planner.sched(start),
                   block_sizes, alpha, planner.prefix_caching)
    tick(1)
    c = replace(start, block_size=choose(points))
    # 2. KV memory share
    memory = [planner.evaluate(replace(c, memory_share=share)) for share in shares]
    tick(1)
    chosen_memory = smallest_sufficient(memory, tolerance)
    c = chosen_memory["candidate"]
    # 3. batch limits
    limits = sorted((planner.evaluate(replace(c, max_num_seqs=n, max_num_batched_tokens=t))
                     for n in seqs for t in batched), key=rank_key)
    tick(1)
    c = limits[0]["candidate"]
    # 4. dtype (of the KV cache, and so of the model)
    by_dtype = [planner.evaluate(replace(c, dtype=d)) if d != c.dtype else limits[0] for d in dtypes]
    tick(1)
    # 5. KV format, at the best dtype so far
    c = min(by_dtype, key=rank_key)["candidate"]
    by_kv = [planner.evaluate(replace(c, kv_cache_dtype=k)) for k in kv_cache_dtypes if k != c.kv_cache_dtype]
    tick(1)
    final = sorted({id(r): r for r in by_kv + by_dtype + limits}.values(), key=rank_key)
    best = final[0]["candidate"]
    device_memory, usable = planner.device.memory_bytes, planner.usable(best.dtype)
    rule = {f"{int(100 * s)}%": planner.evaluate(replace(best, memory_share=min(1.0, s * device_memory / usable)))
            for s in (0.2, 0.3)}  # the rule's share is of the device's memory
    return {"block_sweep": points, "memory": memory, "memory_choice": chosen_memory, "limits": limits,
            "dtypes": by_dtype, "kv_cache_dtypes": by_kv, "recommended": final[0], "runners_up": final[1:3],
            "memory_rule": rule}


def _row(r: dict) -> str:
    c = r["candidate"]
    ttft = "-" if r["ttft_p99_s"] is None else f"{1000 * r['ttft_p99_s']:.0f} ms"
    return (f"B={c.block_size:<4} KV {100 * c.memory_share:>3.0f}% ({r['pool_bytes'] / 2**30:6.2f} GiB) "
            f"seqs {c.max_num_seqs:<4} tokens {c.max_num_batched_tokens:<6} {c.dtype:<9} "
            f"KV {c.kv_cache_dtype:<8} -> "
            f"{r['output_tokens_per_s']:>9.1f} out tok/s, TTFT p99 {ttft:>9}, "
            f"preemptions/request {r['preemption_rate']}, rejected {r['rejected']}")


def _tp_row(r: dict) -> str:
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    chosen = " <- chosen" if r["chosen"] else ""
    return f"{r['output_tokens_per_s']:.0f} tok/s, {r['per_device']:.0f} per device{chosen}"


def _jsonable(obj):
    if isinstance(obj, Candidate):
        return obj.__dict__
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def main(args) -> dict:
    from tqdm import tqdm

    model, device = get_model(args.model), get_device(args.device)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPE_BYTES for d in dtypes):
        raise ValueError(f"--dtypes must be among {', '.join(DTYPE_BYTES)}, got {args.dtypes!r}")
    kv_cache_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    if not kv_cache_dtypes or any(d not in KV_CACHE_DTYPES for d in kv_cache_dtypes):
        raise ValueError(f"--kv-cache-dtypes must be among {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {args.kv_cache_dtypes!r}")
    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance must be in [0, 1), got {args.tolerance}")
    trace = load_trace(args)
    seqs = _ints(args.max_num_seqs, "--max-num-seqs")
    batched = _ints(args.max_num_batched_tokens, "--max-num-batched-tokens")
    shares = _shares(args.memory_shares)
    start = Candidate(16, shares[-1], max(seqs), max(batched), dtypes[0], kv_cache_dtypes[0])
    sizes = _ints(args.tensor_parallel_sizes, "--tensor-parallel-sizes")
    planner, tp_rows = choose_tensor_parallel(trace, model, device, sizes, start, args.link, args.max_model_len,
                                              args.prefix_caching, args.memory_utilization)
    if len(sizes) > 1:
        print("tensor parallel size (output tok/s per device at the starting options): " + "; ".join(
            f"N={r['tensor_parallel_size']}: " + _tp_row(r) for r in tp_rows))
    with tqdm(total=5, desc="plan", disable=args.no_progress, leave=False) as bar:
        result = plan(planner, parse_block_sizes(args.block_sizes), args.alpha, shares, seqs, batched,
                      dtypes, args.tolerance, start, bar.update, kv_cache_dtypes)
    rec = result["recommended"]
    dtype = rec["candidate"].dtype
    n = planner.tensor_parallel_size
    where = device.name if n == 1 else f"{n} x {device.name} (per device below)"
    print(f"{model.name} on {where}, {len(trace)} requests ({args.trace or args.workload}); {dtype} weights "
          f"{planner.model.weight_bytes(DTYPE_BYTES[dtype]) / 2**30:.1f} GiB, "
          f"{planner.usable(dtype) / 2**30:.1f} GiB left at "
          f"{args.memory_utilization:.0%} utilization; {planner.runs} simulations")
    print("recommended: " + _row(rec))
    for i, r in enumerate(result["runners_up"], 1):
        print(f"runner-up {i}: " + _row(r))
    opts = {**rec["candidate"].options(rec["pool_bytes"]), "tensor_parallel_size": planner.tensor_parallel_size}
    print("options: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in opts.items()))
    print(f"block size by the formula (alpha {args.alpha}): B_opt = {rec['candidate'].block_size}")
    print("KV memory (share of what the weights leave): " + ", ".join(
        f"{100 * r['candidate'].memory_share:.0f}%: {r['output_tokens_per_s']:.0f} tok/s, "
        f"{r['preemption_rate']} preempt/req" for r in result["memory"]))
    of_device = rec["pool_bytes"] / device.memory_bytes
    rule = result["memory_rule"]
    verdict = "holds" if of_device <= 0.3 else "does not hold"
    print(f"the mission's rule (pre-allocate 20-30% of memory) {verdict}: this trace needs "
          f"{rec['pool_bytes'] / 2**30:.1f} GiB = {of_device:.0%} of the device's memory "
          f"(20%: {rule['20%']['output_tokens_per_s']:.0f} tok/s, {rule['20%']['preemption_rate']} preempt/req; "
          f"30%: {rule['30%']['output_tokens_per_s']:.0f} tok/s, {rule['30%']['preemption_rate']} preempt/req)")
    report = _jsonable({"model": model.name, "device": device.name, "requests": len(trace),
                        "kv_share_of_device_memory": round(of_device, 4),
                        "trace": args.trace or args.workload, "options": opts, "tensor_parallel": tp_rows, **result,
                        "simulations": planner.runs})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm plan``'s flags."""
    add_trace_source(p)
    add_shape_presets(p)
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="model dtypes to consider (the KV cache in the same dtype, unless --kv-cache-dtypes)")
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="KV formats to consider, e.g. auto,int8,int4 (auto: the model's dtype)")
    p.add_argument("--block-sizes", default="8,16,32,64,128")
    p.add_argument("--tensor-parallel-sizes", default="1",
                   help="devices to split the model over, e.g. 1,2,4,8: the size with the most output tokens/s "
                        "per device is recommended (sizes that do not divide the heads or fit are skipped)")
    p.add_argument("--link", default=None, choices=sorted(LINKS),
                   help="the interconnect for the all-reduces (default: NVLink for the SXM presets, else pcie4)")
    p.add_argument("--alpha", type=float, default=0.3, help="the block-size formula's weight of Overhead(B)")
    p.add_argument("--memory-shares", default="10%,20%,30%,50%,70%,90%",
                   help="KV pool sizes to try, as shares of the memory the weights leave")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="share of the device's memory for weights + KV (vLLM's gpu_memory_utilization)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="the smallest KV memory within this share of the best throughput is recommended")
    p.add_argument("--max-num-seqs", default="64,128,256")
    p.add_argument("--max-num-batched-tokens", default="2048,4096,8192")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", default=None, help="also write the plan to this file")
    p.add_argument("--no-progress", action="store_true")
