"""``pagedllm bench structured``: what grammar-constrained requests cost the free ones sharing their batch.

Three runs on one engine, each until ``--free`` unconstrained requests (random prompts of
``--prompt-len`` tokens, greedy, ``--free-tokens`` tokens each, EOS ignored) are done:

- ``free alone``: just them;
- ``+ unconstrained``: with ``--constrained`` more requests kept in flight (a finished one is
  replaced at once) that are the constrained run's own requests without their grammar: the same
  chat prompts, each generating exactly as many tokens as its constrained twin did, so the
  batches have the same shape step by step and only the grammar work differs;
- ``+ json_schema``: with ``--constrained`` JSON-schema requests kept in flight (greedy, chat
  prompts "Give me a <kind> as JSON." over the schemas of ``bench/grammar_bench.py``).

Reported: the free requests' tokens/s (their tokens over the time until the last one is done),
the median over ``--repeats`` alternating rounds (other processes on a shared machine only slow
runs down, and alternating spreads that evenly), and, timed inside the constrained runs, the
grammar's own work per step (filling the bitmasks, applying them, feeding tokens to matchers).
A warm-up round first builds llguidance's tokenizer and compiles the grammars (then cached).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from pagedllm.bench.timers import time_calls


def _run(engine, free: list[tuple[list[int], object]], extras, num_extra: int) -> dict:
    """Run the free requests to completion with ``num_extra`` requests from ``extras`` kept in flight."""
    counter = itertools.count()
    free_left = set()
    for i, (prompt, params) in enumerate(free):
        engine.add_request(f"free{i}", {"prompt_token_ids": prompt}, params)
        free_left.add(f"free{i}")
    in_flight: dict[str, int] = {}
    lengths: dict[int, int] = {}

    def top_up() -> None:
        while len(in_flight) < num_extra:
            k = next(counter)
            prompt, params = extras(k)
            engine.add_request(f"x{k}", prompt, params)
            in_flight[f"x{k}"] = k

    top_up()
    steps, t0 = 0, time.perf_counter()
    while free_left:
        for out in engine.step():
            if not out.finished:
                continue
            if out.request_id in free_left:
                free_left.discard(out.request_id)
            elif out.request_id in in_flight:
                lengths[in_flight.pop(out.request_id)] = len(out.outputs[0].token_ids)
                if out.outputs[0].finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"request {out.request_id} ended with {out.outputs[0].finish_reason}: "
                                       f"{out.error}")
        top_up()
        steps += 1
    seconds = time.perf_counter() - t0
    for rid in in_flight:
        engine.abort(rid)
    free_tokens = sum(p.max_tokens for _, p in free)
    return {"seconds": seconds, "steps": steps, "free_tokens": free_tokens, "free_tok_s": free_tokens / seconds,
            "extra_lengths": lengths}


def main(args) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from pagedllm.bench.grammar_bench import SCHEMAS
    from pagedllm.engine.sampling_params import RequestOutputKind

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(64, args.free + args.constrained),
              seed=args.seed)
    engine = llm.engine
    tok = llm.get_tokenizer()
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.config.model.vocab_size
    final = RequestOutputKind.FINAL_ONLY
    free_params = SamplingParams(temperature=0, max_tokens=args.free_tokens, ignore_eos=True, output_kind=final)
    free = [(torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist(), free_params)
            for _ in range(args.free)]
    kinds = list(SCHEMAS)
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user",
                                                              "content": f"Give me a {k} as JSON."}])}
               for k in kinds]

    def constrained(k: int):
        return prompts[k % len(kinds)], SamplingParams(
            temperature=0, max_tokens=args.constrained_max_tokens, output_kind=final,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[kinds[k % len(kinds)]]))

    grammar = [0.0]  # seconds in grammar work, constrained runs only
    time_calls(engine.structured, "bitmask", grammar)
    time_calls(engine.structured, "accept", grammar)
    time_calls(engine.runner.sampler, "_apply_grammar", grammar)
    warm = _run(engine, free[:2], constrained, args.constrained)  # tokenizer info, compiles, kernels
    lengths = warm["extra_lengths"]

    def shadow(k: int):  # the constrained request k, without its grammar, for as many tokens
        prompt, _ = constrained(k)
        n = lengths.get(k, args.constrained_max_tokens)
        return prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=final)

    results: dict[str, list[dict]] = {"free alone": [], "+ unconstrained": [], "+ json_schema": []}
    for _ in range(args.repeats):
        grammar[0] = 0.0
        r = _run(engine, free, constrained, args.constrained)
        r["grammar_seconds"] = grammar[0]
        lengths.update(r["extra_lengths"])
        results["+ json_schema"].append(r)
        results["+ unconstrained"].append(_run(engine, free, shadow, args.constrained))
        results["free alone"].append(_run(engine, free, None, 0))
    summary = {}
    for name, runs in results.items():
        summary[name] = {"free_tok_s": statistics.median(r["free_tok_s"] for r in runs),
                         "all_free_tok_s": [round(r["free_tok_s"], 1) for r in runs],
                         "steps": statistics.median(r["steps"] for r in runs),
                         "step_ms": statistics.median(1e3 * r["seconds"] / r["steps"] for r in runs)}
    cons = results["+ json_schema"]
    summary["+ json_schema"]["grammar_ms_per_step"] = statistics.median(
        1e3 * r["grammar_seconds"] / r["steps"] for r in cons)
    summary["+ json_schema"]["grammar_share"] = statistics.median(r["grammar_seconds"] / r["seconds"] for r in cons)
    done = list(lengths.values()) or [0]
    print(f"{args.free} free requests ({args.prompt_len} prompt + {args.free_tokens} tokens, greedy) with "
          f"{args.constrained} more kept in flight; {len(lengths)} constrained outputs done, {min(done)}..{max(done)} "
          f"tokens (mean {statistics.mean(done):.1f}); median of {args.repeats} rounds; dtype {engine.config.dtype}")
    print("| run | free tokens/s | vs free alone | vs + unconstrained | steps | ms/step | grammar ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base, twin = summary["free alone"]["free_tok_s"], summary["+ unconstrained"]["free_tok_s"]
    for name, s in summary.items():
        g = f"{s['grammar_ms_per_step']:.2f} ({100 * s['grammar_share']:.1f}%)" if "grammar_ms_per_step" in s else "-"
        print(f"| {name} | {s['free_tok_s']:.1f} | {s['free_tok_s'] / base:.3f} | {s['free_tok_s'] / twin:.3f} | "
              f"{s['steps']:.0f} | {s['step_ms']:.1f} | {g} |")
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench structured``'s flags."""
    p.add_argument("--free", type=int, default=24, help="unconstrained requests")
    p.add_argument("--constrained", type=int, default=8, help="JSON-schema requests kept in flight")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--free-tokens", type=int, default=128)
    p.add_argument("--constrained-max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are shown")
