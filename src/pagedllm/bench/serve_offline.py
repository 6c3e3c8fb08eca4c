"""``pagedllm bench serve-offline``: the workload of ``bench serve``, through ``LLM.generate`` in-process.

The baseline for the server's overhead: the same seeded prompts and output lengths as
``pagedllm bench serve`` with the same ``--seed``, ``--num-prompts``, ``--input-len`` and
``--output-len``, generated greedily with ``ignore_eos`` by an engine of ``max_num_seqs`` =
``--max-concurrency`` (so at most that many run at once, as the load generator allows the server),
with the server's engine defaults otherwise. Reports the same throughput fields as ``bench serve``
(duration, request/s, output tok/s, total tok/s) and this process's CPU time.
"""

from __future__ import annotations

import argparse
import json

from pagedllm.cli_args import add_serve_workload_args
from pagedllm.machine import CpuClock, machine_info
from pagedllm.workloads.synthetic import parse_range
from pagedllm.workloads.text import text_workload, trace_text_workload
from pagedllm.workloads.traces import read_trace


def main(args) -> dict:
    from pagedllm import LLM, SamplingParams

    input_len = parse_range(args.input_len, "--input-len")
    output_len = parse_range(args.output_len, "--output-len")
    if args.trace:  # the trace's requests, all at once (offline: arrival times are not replayed)
        requests = trace_text_workload(read_trace(args.trace))
    else:
        requests = text_workload(args.num_prompts, input_len, output_len, args.seed)
    max_num_seqs = args.max_concurrency or 64
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
              quantization=args.quantization, max_num_seqs=max_num_seqs)
    if args.num_warmups:  # as bench serve warms the server: short requests on prompts of their own
        warm = text_workload(args.num_warmups, input_len, (16, 16), f"{args.seed}:warmup")
        llm.generate([w.prompt for w in warm], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    with CpuClock() as clock:
        outs = llm.generate([r.prompt for r in requests], params, use_tqdm=not args.no_progress)
    duration = clock.result.wall_s
    output = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    cfg = llm.engine.config
    report = {
        "settings": {"system": "LLM.generate (offline)", "num_prompts": len(requests), "trace": args.trace,
                     "input_len": args.input_len,
                     "output_len": args.output_len, "max_num_seqs": max_num_seqs, "seed": args.seed,
                     "dtype": cfg.dtype, "quantization": cfg.quantization,
                     "attention_backend": llm.engine.runner.backend.name},
        "machine": machine_info(),
        "completed": len(outs), "failed": 0, "duration_s": round(duration, 3),
        "total_input_tokens": prompt, "total_output_tokens": output,
        "requested_output_tokens": sum(r.output_len for r in requests),
        "request_throughput": round(len(outs) / duration, 3),
        "output_throughput": round(output / duration, 3),
        "total_token_throughput": round((prompt + output) / duration, 3),
        "process_cpu": clock.result.as_dict(),
    }
    print(f"LLM.generate, {len(requests)} prompts (input {args.input_len} words, output {args.output_len} "
          f"tokens), max_num_seqs {max_num_seqs}, {cfg.dtype}: {output} output tokens in {duration:.2f}s = "
          f"{report['output_throughput']:.1f} tok/s ({report['total_token_throughput']:.1f} tok/s with the "
          f"{prompt} prompt tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench serve-offline``'s flags: those of ``bench serve``'s workload."""
    add_serve_workload_args(p)
