"""KV memory benchmarks (issue 3): prefix caching TTFT, sharing savings, paged vs contiguous.

``pagedllm bench prefix-cache``  multi-turn chats growing to ~2,000 tokens: time to first token
                                 with prefix caching on and off, same run.
``pagedllm bench sharing``       n = 4 parallel sampling and beam width 4: peak KV blocks held
                                 with block sharing against what the sequences would hold alone.
``pagedllm bench fragmentation`` the same request mix through the paged and the contiguous layout:
                                 reserved-but-unfilled KV share, concurrency, throughput.
``pagedllm bench preemption``    a pool too small for the load: recompute vs swap preemption, and
                                 how much of the swap-in copying overlapped computation.
Every figure is measured in one process, on the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from pagedllm.workloads.synthetic import parse_range, random_workload


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def _llm(args, **overrides):
    from pagedllm import LLM

    opts = dict(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                quantization=args.quantization)
    opts.update(overrides)
    return LLM(**opts)


def _drive(engine, on_step=None) -> dict[str, object]:
    """Step an engine until idle; returns finished outputs by request id."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return done


# -- prefix caching ---------------------------------------------------------------------------------
def bench_prefix_cache(args) -> dict:
    from pagedllm import SamplingParams

    rng = random.Random(args.seed)
    results = {}
    for caching in (True, False):
        llm = _llm(args, enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens)
        engine = llm.engine
        vocab = engine.config.model.vocab_size
        rng.seed(args.seed)
        system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
        convs = [list(system) for _ in range(args.conversations)]
        ttft: list[list[float]] = []
        lengths = []
        _drive(engine) if engine.has_unfinished() else None
        warm = SamplingParams(temperature=0, max_tokens=2)
        engine.add_request("warmup", [5, 6, 7], warm)
        _drive(engine)
        for turn in range(args.turns):
            params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
            for c, conv in enumerate(convs):
                conv.extend(rng.randrange(100, vocab) for _ in range(args.user_tokens))
                engine.add_request(f"t{turn}c{c}", list(conv), params)
            outs = _drive(engine)
            ttft.append([outs[f"t{turn}c{c}"].metrics.time_to_first_token for c in range(len(convs))])
            lengths.append(len(convs[0]))
            for c, conv in enumerate(convs):
                conv.extend(outs[f"t{turn}c{c}"].outputs[0].token_ids)
        stats = llm.kv_cache_stats()
        results["on" if caching else "off"] = {
            "ttft_by_turn_ms": [round(1000 * statistics.mean(t), 1) for t in ttft],
            "mean_ttft_ms": round(1000 * statistics.mean(x for t in ttft for x in t), 1),
            "mean_ttft_after_first_turn_ms": round(1000 * statistics.mean(x for t in ttft[1:] for x in t), 1),
            "prefix_cache_queries": stats["prefix_cache_queries"], "prefix_cache_hits": stats["prefix_cache_hits"],
        }
        results["prompt_tokens_by_turn"] = lengths
        del llm
    on, off = results["on"], results["off"]
    results["ttft_ratio_off_over_on"] = round(off["mean_ttft_ms"] / on["mean_ttft_ms"], 2)
    results["ttft_ratio_after_first_turn"] = round(
        off["mean_ttft_after_first_turn_ms"] / on["mean_ttft_after_first_turn_ms"], 2)
    print(f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, prompts "
          f"{lengths[0]} -> {lengths[-1]} tokens, {args.answer_tokens}-token answers")
    print(f"{'turn':>4} {'prompt':>7} {'TTFT cache on (ms)':>19} {'TTFT cache off (ms)':>20}")
    for i, n in enumerate(lengths):
        print(f"{i + 1:>4} {n:>7} {on['ttft_by_turn_ms'][i]:>19} {off['ttft_by_turn_ms'][i]:>20}")
    print(f"mean TTFT: on {on['mean_ttft_ms']} ms, off {off['mean_ttft_ms']} ms -> "
          f"{results['ttft_ratio_off_over_on']}x lower with prefix caching "
          f"({results['ttft_ratio_after_first_turn']}x after the first turn); "
          f"hits {on['prefix_cache_hits']}/{on['prefix_cache_queries']} prompt tokens")
    return results


# -- sharing ----------------------------------------------------------------------------------------
def _peak_tracker():
    peak = {"used": 0, "unshared": 0}

    def on_step(engine):
        kv = engine.kv_manager
        peak["used"] = max(peak["used"], kv.num_blocks - kv.num_free_blocks)
        peak["unshared"] = max(peak["unshared"], sum(len(t.blocks) for t in kv.tables.values()))
    return peak, on_step


def bench_sharing(args) -> dict:
    from pagedllm import BeamSearchParams, SamplingParams

    llm = _llm(args, enable_prefix_caching=False)
    engine = llm.engine
    prompt = [random.Random(args.seed).randrange(100, engine.config.model.vocab_size)
              for _ in range(args.prompt_tokens)]
    results = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    peak, on_step = _peak_tracker()
    engine.add_request("par", prompt, SamplingParams(n=args.n, temperature=1.0, seed=args.seed,
                                                     max_tokens=args.output_tokens, ignore_eos=True))
    _drive(engine, on_step)
    results["parallel_sampling"] = {"n": args.n, "peak_blocks_shared": peak["used"],
                                    "peak_blocks_unshared": peak["unshared"],
                                    "saved": round(1 - peak["used"] / peak["unshared"], 3),
                                    "cow_copies": llm.kv_cache_stats()["num_cow_copies"]}
    peak, on_step = _peak_tracker()
    engine.add_request("beam", prompt, BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_tokens,
                                                         ignore_eos=True))
    _drive(engine, on_step)
    results["beam_search"] = {"beam_width": args.beam_width, "peak_blocks_shared": peak["used"],
                              "peak_blocks_unshared": peak["unshared"],
                              "saved": round(1 - peak["used"] / peak["unshared"], 3)}
    for name in ("parallel_sampling", "beam_search"):
        r = results[name]
        print(f"{name}: peak KV blocks {r['peak_blocks_shared']} shared vs {r['peak_blocks_unshared']} unshared "
              f"-> {100 * r['saved']:.1f}% memory saved (prompt {args.prompt_tokens}, output {args.output_tokens})")
    return results


# -- fragmentation: paged vs contiguous -------------------------------------------------------------
def bench_fragmentation(args) -> dict:
    from pagedllm import SamplingParams

    results = {}
    for layout in ("paged", "contiguous"):
        llm = _llm(args, kv_layout=layout, max_model_len=args.max_model_len, enable_prefix_caching=False,
                   max_num_seqs=args.max_num_seqs)
        engine = llm.engine
        reqs = random_workload(args.num_requests, parse_range(args.prompt_len, "--prompt-len"),
                               parse_range(args.output_len, "--output-len"), engine.config.model.vocab_size,
                               args.seed)
        samples = {"frag": [], "running": [], "usage": []}

        def on_step(engine, samples=samples):
            st = engine.kv_manager.stats()
            if st["num_used_blocks"]:
                samples["frag"].append(st["fragmentation"])
                samples["usage"].append(st["usage"])
            samples["running"].append(len(engine.scheduler.running))

        for i, r in enumerate(reqs):
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        t0 = time.perf_counter()
        _drive(engine, on_step)
        dt = time.perf_counter() - t0
        tokens = sum(r.output_len for r in reqs)
        results[layout] = {
            "mean_fragmentation": round(statistics.mean(samples["frag"]), 4),
            "max_fragmentation": round(max(samples["frag"]), 4),
            "mean_running": round(statistics.mean(samples["running"]), 1),
            "max_running": max(samples["running"]), "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt, 1), "num_blocks": engine.kv_manager.num_blocks,
            "fragmentation_trace": [round(f, 4) for f in samples["frag"]],
        }
        del llm
    for layout in ("paged", "contiguous"):
        r = results[layout]
        print(f"{layout:>10}: fragmentation mean {100 * r['mean_fragmentation']:.1f}% (max "
              f"{100 * r['max_fragmentation']:.1f}%), concurrent requests mean {r['mean_running']} (max "
              f"{r['max_running']}), {r['tokens_per_s']} tok/s")
    results["throughput_ratio_paged_over_contiguous"] = round(
        results["paged"]["tokens_per_s"] / results["contiguous"]["tokens_per_s"], 2)
    return results


# -- preemption: recompute vs swap ------------------------------------------------------------------
def bench_preemption(args) -> dict:
    from pagedllm import SamplingParams

    results = {}
    for mode in ("recompute", "swap"):
        llm = _llm(args, num_kv_blocks=args.num_kv_blocks, preemption_mode=mode, swap_space=args.swap_space,
                   enable_prefix_caching=False)
        engine = llm.engine
        reqs = random_workload(args.num_requests, parse_range(args.prompt_len, "--prompt-len"),
                               parse_range(args.output_len, "--output-len"), engine.config.model.vocab_size,
                               args.seed)
        for i, r in enumerate(reqs):
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        t0 = time.perf_counter()
        outs = _drive(engine)
        dt = time.perf_counter() - t0
        st = llm.kv_cache_stats()
        results[mode] = {
            "seconds": round(dt, 2), "tokens_per_s": round(sum(r.output_len for r in reqs) / dt, 1),
            "num_preemptions": st["num_preemptions"], "swapped_out_blocks": st["num_swapped_out_blocks"],
            "swap_in_copy_ms": round(1000 * st.get("swap_in_copy_seconds", 0.0), 1),
            "swap_in_wait_ms": round(1000 * st.get("swap_in_wait_seconds", 0.0), 1),
            "swap_in_overlap": round(st.get("swap_in_overlap", 0.0), 3),
            "outputs": [outs[str(i)].outputs[0].token_ids for i in range(len(reqs))],
        }
        del llm
    results["same_outputs"] = results["recompute"].pop("outputs") == results["swap"].pop("outputs")
    for mode in ("recompute", "swap"):
        r = results[mode]
        print(f"{mode:>10}: {r['tokens_per_s']} tok/s, {r['num_preemptions']} preemptions, "
              f"{r['swapped_out_blocks']} blocks swapped out; copy-in {r['swap_in_copy_ms']} ms of which "
              f"{r['swap_in_wait_ms']} ms waited for (overlap {100 * r['swap_in_overlap']:.0f}%)")
    print(f"identical greedy outputs: {results['same_outputs']}")
    return results


def plot(report: dict, path: str) -> None:
    """PNG of a prefix-cache report (TTFT per turn) or a fragmentation report (trace per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    if "on" in report:
        turns = report["prompt_tokens_by_turn"]
        ax.plot(turns, report["on"]["ttft_by_turn_ms"], "o-", label="prefix caching on")
        ax.plot(turns, report["off"]["ttft_by_turn_ms"], "s-", label="prefix caching off")
        ax.set_xlabel("conversation length at this turn (tokens)")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title("Multi-turn chat: TTFT per turn")
    elif "paged" in report:
        for layout in ("paged", "contiguous"):
            ax.plot([100 * f for f in report[layout]["fragmentation_trace"]], label=layout)
        ax.set_xlabel("engine step")
        ax.set_ylabel("reserved but unfilled KV slots (%)")
        ax.set_title("KV fragmentation, same 32 requests")
    else:
        raise ValueError("nothing to plot in this report")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> dict:
    runs = {"prefix-cache": bench_prefix_cache, "sharing": bench_sharing, "fragmentation": bench_fragmentation,
            "preemption": bench_preemption}
    report = {"machine": machine(), "bench": args.bench, **runs[args.bench](args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if getattr(args, "plot", None):
        plot(report, args.plot)
    return report


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench prefix-cache``'s flags."""
    p.add_argument("--plot", default=None, help="also draw a PNG plot to this file")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=100)
    p.add_argument("--user-tokens", type=int, default=200)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)


def add_sharing_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench sharing``'s flags."""
    p.add_argument("--plot", default=None, help="also draw a PNG plot to this file")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--beam-width", type=int, default=4)


def add_fragmentation_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench fragmentation``'s flags."""
    p.add_argument("--plot", default=None, help="also draw a PNG plot to this file")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="32:512")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)


def add_preemption_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench preemption``'s flags."""
    p.add_argument("--plot", default=None, help="also draw a PNG plot to this file")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", default="64:256")
    p.add_argument("--output-len", default="64:128")
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--swap-space", default="256MiB")
