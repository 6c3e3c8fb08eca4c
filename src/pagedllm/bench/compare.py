"""``pagedllm bench compare``: paged vs contiguous KV on the real model, at one KV budget, in one report.

One trace (``--trace``, or a generated ``--workload``) replayed through the real engine three
times, with the same model, options and KV memory budget:

- ``contiguous``: the pre-PagedAttention baseline; every request reserves ``max_model_len`` slots
  up front (its default is the model's context length, as the systems before vLLM reserved);
- ``paged``: blocks on demand, prefix caching off (what paging alone gives);
- ``paged + prefix caching``: blocks on demand and shared prefixes reused.

Each run is measured on the wall clock (``engine_replay.replay``: arrivals at the trace's times x
``--time-scale``); the report has, per run, the longest sequence the pool admits, fragmentation
(reserved-but-unfilled KV slots, mean and max over steps), peak KV memory, the most concurrent
sequences, output tokens/s and requests/s, TTFT and TPOT p50/p99, preemptions, prefix-cache hit
rate, and cost per million output tokens at ``--price-per-hour``; printed in the mission's row
order beside the mission's claimed figures (``mission.py``), with PNG plots of KV memory,
batch and fragmentation over time (``--plot DIR``) and a JSON report (``--json``).

``--kv-cache-dtype int8,bfloat16,...``: every run once per KV format (``kvstore/quant.py``), at the
same budget: a smaller format holds more blocks, so more sequences run at once; each run reports
its blocks per GiB and its KV format.

The runs go one after another, so machine drift between them enters the ratios; the report
names the CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

from pagedllm.cli_args import add_trace_source
from pagedllm.machine import machine_info
from pagedllm.sim.engine_replay import replay
from pagedllm.sim.inputs import load_trace
from pagedllm.sim.mission import CLAIMED_SETUP, cost_per_m_tokens, format_table
from pagedllm.sim.simulator import SimulationResult
from pagedllm.workloads.traces import summary

CONFIGS = {  # name: (kv_layout, enable_prefix_caching)
    "contiguous": ("contiguous", False),
    "paged": ("paged", False),
    "paged + prefix caching": ("paged", True),
}
WARMUP_PROMPT = list(range(3, 67))  # ids below the traces' (>= 100): never a prefix-cache hit for them


def run_config(args, trace, layout: str, caching: bool, desc: str,
               kv_cache_dtype: str = "auto") -> tuple[dict, SimulationResult]:
    from tqdm import tqdm

    from pagedllm import LLM, SamplingParams

    options = dict(model=args.model, dtype=args.dtype, block_size=args.block_size,
                   kv_cache_memory=args.kv_cache_memory, quantization=args.quantization, kv_layout=layout,
                   enable_prefix_caching=caching, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(**{k: v for k, v in options.items() if v is not None})
    engine = llm.engine
    llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    per_block = engine.runner.kv.nbytes / engine.kv_manager.num_blocks
    with tqdm(total=len(trace), desc=desc, unit="req", disable=args.no_progress, leave=False) as bar:
        result = replay(engine, trace, args.time_scale, progress=bar.update, bytes_per_block=per_block)
    out = result.summary()
    out["cost_per_m_tokens"] = cost_per_m_tokens(args.price_per_hour, out["output_tokens_per_s"])
    out.update(num_blocks=engine.kv_manager.num_blocks, block_size=engine.config.cache.block_size,
               kv_pool_bytes=engine.kv_manager.num_blocks * per_block,
               max_model_len=engine.config.scheduler.max_model_len, errors=sorted(set(result.kv["errors"].values())),
               kv_cache_dtype=engine.kv_spec.kv_cache_dtype, blocks_per_gib=round(2**30 / per_block))
    del llm, engine
    gc.collect()
    return out, result


def run(args) -> dict:
    trace = load_trace(args)
    names = [n.strip() for n in args.configs.split(",")]
    for n in names:
        if n not in CONFIGS:
            raise ValueError(f"--configs: unknown run {n!r} (choose from {', '.join(CONFIGS)})")
    if not math.isfinite(args.price_per_hour) or args.price_per_hour < 0:
        raise ValueError(f"--price-per-hour must be a non-negative number, got {args.price_per_hour}")
    report = {"machine": machine_info(), "trace": {"source": args.trace or args.workload, **summary(trace)},
              "time_scale": args.time_scale, "kv_cache_memory": str(args.kv_cache_memory),
              "price_per_hour": args.price_per_hour, "claims": CLAIMED_SETUP, "results": {}}
    results: dict[str, SimulationResult] = {}
    kv_dtypes = [d.strip() for d in args.kv_cache_dtype.split(",")]
    for kv_dtype in kv_dtypes:
        for name in names:
            layout, caching = CONFIGS[name]
            key = name if len(kv_dtypes) == 1 else f"{name}, {kv_dtype} KV"
            report["results"][key], results[key] = run_config(args, trace, layout, caching, key, kv_dtype)
    print(format_report(report))
    if args.plot:
        plot(results, Path(args.plot), report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict, markdown: bool = False) -> str:
    first = next(iter(report["results"].values()))
    t, m = report["trace"], report["machine"]
    head = (f"{t['source']}: {t['requests']} requests (mean prompt {t['mean_prompt_len']}, output "
            f"{t['mean_output_len']} tokens), time scale {report['time_scale']}; KV budget "
            f"{report['kv_cache_memory']} = {first['num_blocks']} blocks of {first['block_size']}, max_model_len "
            f"{first['max_model_len']}; ${report['price_per_hour']}/machine-hour\n"
            f"machine: {m['cpu']}, {m['cores']} cores, {' '.join(m['flags']) or 'no avx512/amx'}")
    table = format_table(report["results"], claims=True, markdown=markdown)
    return f"{head}\n{table}\n(claimed: the mission's figures for {report['claims']})"


def plot(results: dict[str, SimulationResult], folder: Path, report: dict) -> None:
    """``compare_timeline.png``: KV memory held, sequences per step and fragmentation over time."""
    from pagedllm.sim.timeline import plot_timeline

    t = report["trace"]
    plot_timeline(results, folder / "compare_timeline.png", f"paged vs contiguous KV, {t['source']} "
                  f"({t['requests']} requests), budget {report['kv_cache_memory']}", "seconds")


def main(args) -> dict:
    if args.time_scale < 0 or not math.isfinite(args.time_scale):
        raise ValueError(f"--time-scale must be a non-negative number, got {args.time_scale}")
    return run(args)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench compare``'s flags."""
    add_trace_source(p, workload="chat", num_requests=48, seed=False)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival times (0: every request at once, in trace order)")
    p.add_argument("--configs", default="contiguous,paged,paged + prefix caching",
                   help="the runs, comma-separated, in this order")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output, the contiguous reservation (default: the model's context)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV format(s), comma-separated: every run once per format at the same budget")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--price-per-hour", type=float, default=0.10,
                   help="dollars per machine-hour for the cost row (default 0.10: a 2-vCPU cloud VM)")
    p.add_argument("--plot", default=None, help="a folder for the PNG plot")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(kv_cache_memory="384MiB")
