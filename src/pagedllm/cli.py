"""Command line: ``pagedllm generate | chat | serve | trace | simulate | plan | bench <name>``.

A table of subcommands (``COMMANDS``, ``BENCHMARKS``): each names the module that declares its flags
(``add_cli_args``) and runs it (``main``), imported only when that subcommand is run. ``generate``
prints the completion as it streams, then a one-line summary (tokens/s, peak KV blocks used /
total); ``chat`` is an interactive conversation with the chat template applied: both live here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from dataclasses import dataclass

from pagedllm.cli_args import add_option_args, engine_options
from pagedllm.errors import PagedLLMError


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_llm(args):
    from pagedllm import LLM

    return LLM(**engine_options(args))


def sampling_params(args):
    from pagedllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          min_tokens=args.min_tokens, seed=args.sampling_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def stream(llm, prompt, params, out=sys.stdout) -> dict:
    """Generate one request, writing text as it arrives (held back while it could still turn out to
    be a stop string, so what is written is exactly the final text); returns a summary."""
    from pagedllm.engine.sampling_params import RequestOutputKind

    engine = llm.engine
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    drafter = engine.scheduler.drafter
    spec_before = drafter.stats.as_dict() if drafter is not None else None
    t0 = time.perf_counter()
    first = None
    peak = 0
    text, tokens, final = [], 0, None
    for o in llm.generate_stream(prompt, params):
        first = first or time.perf_counter()
        delta = o.outputs[0]
        out.write(delta.text)
        out.flush()
        text.append(delta.text)
        tokens += len(delta.token_ids)
        peak = max(peak, engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks)
        if o.finished:
            final = o
    dt = time.perf_counter() - t0
    summary = {"tokens": tokens, "seconds": dt, "ttft": (first - t0) if first else None, "text": "".join(text),
               "finish_reason": final.outputs[0].finish_reason, "peak_blocks": peak,
               "num_blocks": engine.kv_manager.num_blocks, "prompt_tokens": len(final.prompt_token_ids)}
    if spec_before is not None:  # this request's verifications: the engine's counters, after less before
        after = drafter.stats.as_dict()
        summary["speculation"] = {k: after[k] - spec_before[k] for k in
                                  ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                   "spec_decode_num_accepted_tokens")}
    return summary


def summary_line(s: dict) -> str:
    line = (f"[{s['tokens']} tokens in {s['seconds']:.2f}s = {s['tokens'] / s['seconds']:.1f} tok/s, "
            f"first token {s['ttft'] * 1000:.0f} ms, prompt {s['prompt_tokens']} tokens, "
            f"KV blocks used {s['peak_blocks']}/{s['num_blocks']} (peak), finish: {s['finish_reason']}")
    spec = s.get("speculation")
    if spec is not None:
        drafts, guessed, accepted = (spec["spec_decode_num_drafts"], spec["spec_decode_num_draft_tokens"],
                                     spec["spec_decode_num_accepted_tokens"])
        line += f", speculation: {drafts} verifying steps, {accepted} of {guessed} guessed tokens accepted"
        if drafts:
            line += f" ({accepted / guessed:.0%}), {1 + accepted / drafts:.2f} tokens per verifying step"
    return line + "]"


def cmd_generate(args) -> int:
    llm = build_llm(args)
    eng = llm.engine
    print(f"[model {eng.model_path.name}, {eng.config.dtype}, quantization {eng.config.quantization}, "
          f"loaded in {eng.load_seconds:.1f}s, "
          f"attention {eng.runner.backend.name}, {eng.kv_manager.num_blocks} KV blocks of "
          f"{eng.kv_manager.block_size} tokens; {eng.kernels_line()}]", file=sys.stderr)
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])}
    s = stream(llm, prompt, sampling_params(args))
    print()
    print(summary_line(s))
    return 0


def cmd_chat(args) -> int:
    llm = build_llm(args)
    tok = llm.get_tokenizer()
    params = sampling_params(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message; /reset clears the history, /history prints it, "
          "/exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if line.strip() == "/history":
            print(json.dumps(history, ensure_ascii=False))
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(history)
        print("assistant> ", end="", flush=True)
        s = stream(llm, {"prompt_token_ids": ids}, params)
        print()
        print(summary_line(s), file=sys.stderr)
        history.append({"role": "assistant", "content": s["text"]})


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm generate``'s flags."""
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    add_option_args(p)
    add_sampling_args(p)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm chat``'s flags."""
    p.add_argument("--system", default=None, help="system prompt")
    add_option_args(p)
    add_sampling_args(p)
    p.set_defaults(max_tokens=512)


@dataclass(frozen=True)
class Subcommand:
    """One subcommand: the module that declares its flags (``add_args``) and runs it (``main``).
    ``bench_common``: the flags every benchmark takes (``--seed``, ``--json``); ``engine_options``:
    also the engine's model, dtype (bfloat16 by default), block size, KV memory and quantization."""

    name: str
    help: str
    module: str
    add_args: str = "add_cli_args"
    main: str = "main"
    bench_common: bool = False
    engine_options: bool = False

    def add_to(self, p: argparse.ArgumentParser) -> None:
        if self.bench_common:
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--json", default=None, help="also write the report to this file")
        if self.engine_options:
            add_option_args(p, only=("model", "dtype", "block_size", "kv_cache_memory", "quantization"),
                            defaults={"dtype": "bfloat16"})
        getattr(importlib.import_module(self.module), self.add_args)(p)

    def run(self, args) -> int:
        result = getattr(importlib.import_module(self.module), self.main)(args)
        return result if isinstance(result, int) else 0


COMMANDS = (
    Subcommand("generate", "complete one prompt, streamed, with a summary line", "pagedllm.cli",
               "add_generate_args", "cmd_generate"),
    Subcommand("chat", "interactive chat, tokens streamed as they come", "pagedllm.cli", "add_chat_args", "cmd_chat"),
    Subcommand("serve", "OpenAI-compatible HTTP server (FastAPI + uvicorn; --replicas N: on Ray Serve)",
               "pagedllm.cluster.launch"),
    Subcommand("trace", "write a seeded request trace (JSONL) for the benchmarks and the simulator",
               "pagedllm.workloads.traces"),
    Subcommand("simulate", "replay a trace through the real scheduler and KV manager with a step-time model: "
                           "any model shape, any device, paged vs contiguous; --replicas N behind a router",
               "pagedllm.cluster.sim_replicas"),
    Subcommand("plan", "recommend block size, memory, batch limits and dtype for a trace, by simulation",
               "pagedllm.sim.plan"),
    Subcommand("tp-worker", "one tensor-parallel rank (RANK > 0) of a torchrun-style launch over several machines",
               "pagedllm.parallel.launch"),
)


def _bench(name: str, help_text: str, module: str, add_args: str = "add_cli_args",
           engine_options: bool = True) -> Subcommand:
    return Subcommand(name, help_text, module, add_args, bench_common=True, engine_options=engine_options)


BENCHMARKS = (
    _bench("throughput", "pagedllm vs HF transformers padded batched generate", "pagedllm.bench.throughput"),
    _bench("prefix-cache", "multi-turn chat TTFT with prefix caching on vs off", "pagedllm.bench.kv_bench",
           "add_prefix_cache_args"),
    _bench("sharing", "memory saved by block sharing: n-way sampling and beam search", "pagedllm.bench.kv_bench",
           "add_sharing_args"),
    _bench("fragmentation", "paged vs contiguous KV on the same request mix", "pagedllm.bench.kv_bench",
           "add_fragmentation_args"),
    _bench("attention", "paged-attention backends vs contiguous SDPA (decode)", "pagedllm.bench.attention_bench",
           engine_options=False),
    _bench("matmul", "dense vs prepacked vs GGUF-block matmuls per projection", "pagedllm.bench.matmul_bench",
           engine_options=False),
    _bench("step", "where one decode step's time goes", "pagedllm.bench.step_profile"),
    _bench("preemption", "recompute vs swap preemption on a pool too small for the load", "pagedllm.bench.kv_bench",
           "add_preemption_args"),
    _bench("grammar-libs", "structured output: xgrammar vs llguidance (compile, mask, memory)",
           "pagedllm.bench.grammar_bench", engine_options=False),
    _bench("structured", "free requests' throughput next to JSON-schema-constrained ones",
           "pagedllm.bench.structured_bench"),
    _bench("soak", "a bounded soak of a running server: mixed valid, invalid, cancelled and oversized requests, "
                   "clients killed every few seconds", "pagedllm.loadgen.soak", engine_options=False),
    _bench("serve", "load on any OpenAI-compatible server (as vllm bench serve)", "pagedllm.loadgen.serve_bench",
           engine_options=False),
    _bench("peers", "pagedllm against vLLM's CPU build and llama.cpp, offline, same prompts, alternating runs",
           "pagedllm.bench.peers"),
    _bench("compare", "paged vs contiguous KV (prefix caching on and off) on a trace, one KV budget, the mission's "
                      "table", "pagedllm.bench.compare"),
    _bench("accuracy", "perplexity, KL and teacher-forced agreement of each KV format and weight mode against "
                       "float32", "pagedllm.bench.accuracy", engine_options=False),
    _bench("speculative", "speculative decoding (ngram, suffix) vs none: edit, code and random prompts at several "
                          "batch sizes, alternating runs", "pagedllm.bench.speculative_bench"),
    _bench("serve-offline", "the bench serve workload through LLM.generate in-process (the server's baseline)",
           "pagedllm.bench.serve_offline"),
)


def chosen_subcommand(argv: list[str]) -> tuple[str, ...]:
    """The subcommand a command line names (``("serve",)``, ``("bench", "step")``), read before
    parsing so that only its module is imported; ``()`` when it names none (``--help``)."""
    words = [w for w in argv if not w.startswith("-")]
    if not words:
        return ()
    return tuple(words[:2]) if words[0] == "bench" and len(words) > 1 else (words[0],)


def make_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With ``argv``, only the subcommand it names gets its flags (and has
    its module imported); without, every subcommand does (for ``--help`` of each, and the tests)."""
    wanted = None if argv is None else chosen_subcommand(argv)
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference over a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        p.set_defaults(subcommand=command)
        if wanted is None or wanted == (command.name,):
            command.add_to(p)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for command in BENCHMARKS:
        p = bsub.add_parser(command.name, help=command.help)
        p.set_defaults(subcommand=command)
        if wanted is None or wanted == ("bench", command.name):
            command.add_to(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = make_parser(argv).parse_args(argv)
    try:
        return args.subcommand.run(args)
    except (PagedLLMError, ValueError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
