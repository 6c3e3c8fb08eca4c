"""Command line: ``pagedllm generate | chat | serve | trace | simulate | plan | bench``.

``generate`` prints the completion as it streams, then a one-line summary (tokens/s, peak KV
blocks used / total). ``chat`` is an interactive conversation with the chat template applied.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time
import typing

from pagedllm.errors import PagedLLMError


def _flag_type(annotation) -> type:
    """bool, int or str: how a flag of this option's annotation is parsed."""
    from pydantic import ByteSize

    if typing.get_origin(annotation) is typing.Annotated:  # PositiveInt = Annotated[int, Gt(0)]
        return _flag_type(typing.get_args(annotation)[0])
    for a in typing.get_args(annotation) or (annotation,):  # X | None: X's type
        if typing.get_origin(a) is typing.Annotated:
            return _flag_type(a)
        a = typing.get_origin(a) or a
        if isinstance(a, type) and issubclass(a, ByteSize):
            return str  # "512MiB"
        if a in (bool, int):
            return a
    return str


def add_option_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """One flag per engine option (``pagedllm.config.EngineOptions``): ``--block-size`` for
    ``block_size``, with its default, choices and help; booleans as ``--x/--no-x``."""
    from pagedllm.config import option_choices, option_fields

    g = p.add_argument_group("engine")
    for name, info in option_fields().items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        default = (defaults or {}).get(name, info.default)
        kind = _flag_type(info.annotation)
        text = (info.description or "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            g.add_argument(flag, type=kind, default=default, choices=option_choices(info.annotation), help=text)


def engine_options(args) -> dict:
    """The engine options a parsed command line carries."""
    from pagedllm.config import option_fields

    return {name: getattr(args, name) for name in option_fields() if hasattr(args, name)}


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
    return {"tokens": tokens, "seconds": dt, "ttft": (first - t0) if first else None, "text": "".join(text),
            "finish_reason": final.outputs[0].finish_reason, "peak_blocks": peak,
            "num_blocks": engine.kv_manager.num_blocks, "prompt_tokens": len(final.prompt_token_ids)}


def summary_line(s: dict) -> str:
    return (f"[{s['tokens']} tokens in {s['seconds']:.2f}s = {s['tokens'] / s['seconds']:.1f} tok/s, "
            f"first token {s['ttft'] * 1000:.0f} ms, prompt {s['prompt_tokens']} tokens, "
            f"KV blocks used {s['peak_blocks']}/{s['num_blocks']} (peak), finish: {s['finish_reason']}]")


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


def cmd_serve(args) -> int:
    from pagedllm.server.serve import serve

    options = engine_options(args)
    if args.model_path is not None:
        if options.get("model") not in (None, args.model_path):
            raise ValueError("give the model once: as MODEL or as --model")
        options["model"] = args.model_path
    from pagedllm.server.limits import ServerLimits

    limits = ServerLimits(max_prompt_bytes=args.max_prompt_bytes, max_logit_bias=args.max_logit_bias,
                          max_stop=args.max_stop, default_chat_max_tokens=args.default_chat_max_tokens,
                          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    return serve(options, host=args.host, port=args.port, api_keys=tuple(args.api_key or ()),
                 served_model_name=args.served_model_name, max_queue=args.max_queue,
                 max_body_bytes=args.max_body_bytes, uvicorn_log_level=args.uvicorn_log_level, limits=limits,
                 guard_metrics=args.guard_metrics, salt_per_key=args.cache_salt_per_key,
                 metrics_prefix=args.metrics_prefix, root_path=args.root_path,
                 tool_call_parser=args.tool_call_parser, chat_template=args.chat_template)


def cmd_bench(args) -> int:
    """Run the benchmark module named by the subcommand (imported only when asked for)."""
    importlib.import_module(f"pagedllm.bench.{args.bench_module}").main(args)
    return 0


def cmd_trace(args) -> int:
    from pagedllm.bench import traces

    try:
        rate = float(args.rate)
    except ValueError:
        raise ValueError(f"--rate must be a number or inf, got {args.rate!r}") from None
    args.rate = rate
    traces.main(args)
    return 0


def add_trace_source(p: argparse.ArgumentParser, workload: str = "sharegpt", num_requests: int = 1000,
                     seed: bool = True) -> None:
    """``--trace FILE``, or a generated ``--workload`` with ``--num-requests``, ``--rate`` (and ``--seed``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help="a JSONL trace (pagedllm trace writes one)")
    src.add_argument("--workload", default=workload, choices=["sharegpt", "alpaca", "chat", "code"],
                     help="generate the trace instead (with --num-requests, --rate, --seed)")
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (chat: conversations per second; inf: all at t=0)")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def add_shape_presets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-13b", help="a model shape preset (see docs/simulator.md)")
    p.add_argument("--device", default="a100-80gb", help="a device preset (see docs/simulator.md)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference over a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streamed, with a summary line")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    add_option_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, tokens streamed as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_option_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=512)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="local .gguf file or HF folder (same as --model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", action="append", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /dashboard/state; "
                          "repeat for several keys, one per tenant (default: $PAGEDLLM_API_KEY, comma-separated, "
                          "else no key)")
    srv.add_argument("--cache-salt-per-key", action="store_true",
                     help="salt each API key's prefix cache apart: no tenant's request hits (or learns of, through "
                          "cached_tokens or timing) another's cached prefixes")
    srv.add_argument("--guard-metrics", action="store_true", help="with --api-key, guard /metrics too "
                                                                  "(open by default, for scrapers, as vLLM's)")
    srv.add_argument("--max-prompt-bytes", type=int, default=None,
                     help="refuse prompt text over this many UTF-8 bytes before tokenizing it (default: "
                          "max_model_len x the vocabulary's longest token, in bytes)")
    srv.add_argument("--max-logit-bias", type=int, default=1024, help="most logit_bias entries per request")
    srv.add_argument("--max-stop", type=int, default=64, help="most stop strings per request")
    srv.add_argument("--default-chat-max-tokens", type=int, default=None,
                     help="max_tokens of a chat request that gives none (default: the rest of the context)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a client has to send a request's headers (slow clients are disconnected)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a client has to send a request's body after its headers (else 408)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send "
                                                               "(default: MODEL, or the model file's name)")
    srv.add_argument("--max-queue", type=int, default=1024,
                     help="most requests waiting for a sequence slot; more get 429 with Retry-After")
    srv.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 8 MiB)")
    srv.add_argument("--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info"])
    srv.add_argument("--metrics-prefix", default="pagedllm", choices=["pagedllm", "vllm"],
                     help="name the /metrics series pagedllm:* (default) or vllm:* with vLLM's model_name label, "
                          "for dashboards built for vLLM")
    srv.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "json"],
                     help="how tool_choice 'auto' finds calls in the output: <tool_call> blocks (hermes, as Qwen2.5 "
                          "writes them) or a whole-output JSON call (json)")
    srv.add_argument("--chat-template", default=None,
                     help="a Jinja chat template (a file, or the template itself) in place of the model's")
    srv.add_argument("--root-path", default="",
                     help="the path prefix a proxy serves this server under (e.g. /llm), as vLLM's --root-path")
    add_option_args(srv)
    srv.set_defaults(func=cmd_serve)
    tr = sub.add_parser("trace", help="write a seeded request trace (JSONL) for the benchmarks and the simulator")
    tr.add_argument("--workload", required=True, choices=["sharegpt", "alpaca", "chat", "code"])
    tr.add_argument("--num-requests", type=int, default=1000)
    tr.add_argument("--rate", default="inf", help="Poisson arrivals per second (inf: all at t=0)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", required=True, help="the JSONL file to write")
    tr.set_defaults(func=cmd_trace)
    sim = sub.add_parser("simulate", help="replay a trace through the real scheduler and KV manager with a "
                                          "step-time model: any model shape, any device, paged vs contiguous")
    add_trace_source(sim)
    add_shape_presets(sim)
    sim.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    sim.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    sim.add_argument("--kv-memory", default=None, help="KV pool: bytes ('8GiB') or a share of what the weights "
                                                      "leave ('25%%'); default: --memory-utilization")
    sim.add_argument("--memory-utilization", type=float, default=0.9,
                     help="share of the device's memory for weights + KV (vLLM's gpu_memory_utilization)")
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (--calibrate: the engine's 64)")
    sim.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="default 8192 (--calibrate: the engine's 1024)")
    sim.add_argument("--max-model-len", type=int, default=4096)
    sim.add_argument("--layout", default="both", choices=["both", "paged", "contiguous"])
    sim.add_argument("--contiguous-reservation", default="max_model_len", choices=["max_model_len", "request"],
                     help="what a contiguous request reserves: max_model_len, or its own prompt + output length")
    sim.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="prefix caching for the paged layout")
    sim.add_argument("--price-per-hour", type=float, default=None,
                     help="dollars per machine-hour for the cost row (default: the device preset's)")
    sim.add_argument("--plot", default=None, help="a folder for PNG plots")
    sim.add_argument("--json", default=None, help="also write the report to this file")
    sim.add_argument("--no-progress", action="store_true")
    cal = sim.add_argument_group("calibration (--calibrate: fit this CPU's step-time model to the real engine)")
    cal.add_argument("--calibrate", action="store_true")
    cal.add_argument("--engine-model", default=None, help="the model the engine runs (default: the embedded one)")
    cal.add_argument("--calibration-workload", default="alpaca", choices=["sharegpt", "alpaca", "chat", "code"])
    cal.add_argument("--calibration-requests", type=int, default=48)
    cal.add_argument("--validate", default="sharegpt,code", help="held-out workloads, comma-separated")
    sw = sim.add_argument_group("block size (--sweep-block-size: B_opt = argmin Memory(B)/B + alpha * Overhead(B))")
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
    pg = sim.add_argument_group("placement (--placements: merging adjacent blocks, a reserve of large blocks)")
    pg.add_argument("--placements", action="store_true")
    pg.add_argument("--reserve-share", type=float, default=0.25, help="share of the pool held in large blocks")
    pg.add_argument("--run-blocks", type=int, default=4, help="blocks per large block (2-4)")
    pg.add_argument("--threshold-blocks", type=int, default=8,
                    help="a sequence holding this many blocks takes large ones")
    sim.set_defaults(func=cmd_bench, bench_module="simulate_cmd")
    pl = sub.add_parser("plan", help="recommend block size, memory, batch limits and dtype for a trace, by simulation")
    add_trace_source(pl)
    add_shape_presets(pl)
    pl.add_argument("--dtypes", default="bfloat16,float32",
                    help="dtypes to consider for the KV cache (the engine keeps K/V in the model's dtype)")
    pl.add_argument("--block-sizes", default="8,16,32,64,128")
    pl.add_argument("--alpha", type=float, default=0.3, help="the block-size formula's weight of Overhead(B)")
    pl.add_argument("--memory-shares", default="10%,20%,30%,50%,70%,90%",
                    help="KV pool sizes to try, as shares of the memory the weights leave")
    pl.add_argument("--memory-utilization", type=float, default=0.9,
                    help="share of the device's memory for weights + KV (vLLM's gpu_memory_utilization)")
    pl.add_argument("--tolerance", type=float, default=0.02,
                    help="the smallest KV memory within this share of the best throughput is recommended")
    pl.add_argument("--max-num-seqs", default="64,128,256")
    pl.add_argument("--max-num-batched-tokens", default="2048,4096,8192")
    pl.add_argument("--max-model-len", type=int, default=4096)
    pl.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    pl.add_argument("--json", default=None, help="also write the plan to this file")
    pl.add_argument("--no-progress", action="store_true")
    pl.set_defaults(func=cmd_bench, bench_module="plan")
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)

    def bench_parser(name: str, help_text: str, module: str, engine_options: bool = True) -> argparse.ArgumentParser:
        p = bsub.add_parser(name, help=help_text)
        p.set_defaults(func=cmd_bench, bench_module=module)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", default=None, help="also write the report to this file")
        if engine_options:
            add_option_args(p, only=("model", "dtype", "block_size", "kv_cache_memory", "quantization"),
                            defaults={"dtype": "bfloat16"})
        return p

    def kv_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = bench_parser(name, help_text, "kv_bench")
        p.add_argument("--plot", default=None, help="also draw a PNG plot to this file")
        return p

    tp = bench_parser("throughput", "pagedllm vs HF transformers padded batched generate", "throughput")
    tp.add_argument("--num-requests", type=int, default=32)
    tp.add_argument("--prompt-len", default="32:512", help="N or MIN:MAX (uniform)")
    tp.add_argument("--output-len", default="16:256", help="N or MIN:MAX (uniform)")
    tp.add_argument("--hf-batch-size", type=int, default=32)
    tp.add_argument("--max-num-seqs", type=int, default=64)
    tp.add_argument("--max-num-batched-tokens", type=int, default=1024)
    tp.add_argument("--skip-hf", action="store_true", help="measure pagedllm only")

    pc = kv_parser("prefix-cache", "multi-turn chat TTFT with prefix caching on vs off")
    pc.add_argument("--conversations", type=int, default=2)
    pc.add_argument("--turns", type=int, default=8)
    pc.add_argument("--system-tokens", type=int, default=100)
    pc.add_argument("--user-tokens", type=int, default=200)
    pc.add_argument("--answer-tokens", type=int, default=32)
    pc.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sh = kv_parser("sharing", "memory saved by block sharing: n-way sampling and beam search")
    sh.add_argument("--prompt-tokens", type=int, default=512)
    sh.add_argument("--output-tokens", type=int, default=64)
    sh.add_argument("--n", type=int, default=4)
    sh.add_argument("--beam-width", type=int, default=4)
    fr = kv_parser("fragmentation", "paged vs contiguous KV on the same request mix")
    fr.add_argument("--num-requests", type=int, default=32)
    fr.add_argument("--prompt-len", default="32:512")
    fr.add_argument("--output-len", default="16:256")
    fr.add_argument("--max-model-len", type=int, default=2048)
    fr.add_argument("--max-num-seqs", type=int, default=64)
    at = bench_parser("attention", "paged-attention backends vs contiguous SDPA (decode)", "attention_bench",
                      engine_options=False)
    at.add_argument("--batch", default="1,8,32,64")
    at.add_argument("--context", default="128,512,2048,4096")
    at.add_argument("--block-size", default="16")
    at.add_argument("--dtype", default="bfloat16")
    at.add_argument("--backends", default="cpu,reference")
    at.add_argument("--repeats", type=int, default=10)
    at.add_argument("--device", default="cpu")
    at.add_argument("--plot", default=None)
    at.add_argument("--block-order", default="shuffled",
                    help="shuffled (a pool after churn), adjacent (merged runs), or both: timed in alternation")
    at.add_argument("--prefill", action="store_true",
                    help="causal prefill of --context tokens per sequence instead of decode (GFLOP/s)")
    mm = bench_parser("matmul", "dense vs prepacked vs GGUF-block matmuls per projection", "matmul_bench",
                      engine_options=False)
    mm.add_argument("--model", default=None)
    mm.add_argument("--rows", default="1,2,4,8,16,32,64")
    mm.add_argument("--repeats", type=int, default=50)
    sp = bench_parser("step", "where one decode step's time goes", "step_profile")
    sp.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "reference"])
    sp.add_argument("--batch", type=int, default=32)
    sp.add_argument("--context", type=int, default=128)
    sp.add_argument("--steps", type=int, default=20)
    sp.add_argument("--layer-loop", default="auto", choices=["auto", "python"],
                    help="auto: the C++ decoder stack where it applies; python: the Python layer loop (for A/B)")
    pr = kv_parser("preemption", "recompute vs swap preemption on a pool too small for the load")
    pr.add_argument("--num-requests", type=int, default=16)
    pr.add_argument("--prompt-len", default="64:256")
    pr.add_argument("--output-len", default="64:128")
    pr.add_argument("--num-kv-blocks", type=int, default=64)
    pr.add_argument("--swap-space", default="256MiB")
    gl = bench_parser("grammar-libs", "structured output: xgrammar vs llguidance (compile, mask, memory)",
                      "grammar_bench", engine_options=False)
    gl.add_argument("--batch", type=int, default=32)
    gl.add_argument("--steps", type=int, default=400)
    gl.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    gl.add_argument("--repeats", type=int, default=3, help="runs per library (alternating); the fastest is shown")
    gl.add_argument("--single", default=None, help=argparse.SUPPRESS)  # one library, in a child process
    so = bench_parser("structured", "free requests' throughput next to JSON-schema-constrained ones",
                      "structured_bench")
    so.add_argument("--free", type=int, default=24, help="unconstrained requests")
    so.add_argument("--constrained", type=int, default=8, help="JSON-schema requests kept in flight")
    so.add_argument("--prompt-len", type=int, default=64)
    so.add_argument("--free-tokens", type=int, default=128)
    so.add_argument("--constrained-max-tokens", type=int, default=256)
    so.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are shown")

    def serve_workload_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--num-prompts", type=int, default=64)
        p.add_argument("--input-len", default="128", help="prompt words (one token each in SmolLM2): N or MIN:MAX")
        p.add_argument("--output-len", default="128", help="output tokens (max_tokens + ignore_eos): N or MIN:MAX")
        p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
        p.add_argument("--num-warmups", type=int, default=1, help="short untimed requests first")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--trace", default=None, help="a JSONL trace (pagedllm trace): its requests, output lengths "
                                                     "and arrival times instead of the prompts above")

    so = bench_parser("soak", "a bounded soak of a running server: mixed valid, invalid, cancelled and oversized "
                      "requests, clients killed every few seconds", "soak", engine_options=False)
    so.add_argument("--base-url", default="http://127.0.0.1:8000")
    so.add_argument("--server-pid", type=int, default=None, help="sample this local process's RSS")
    so.add_argument("--duration", type=float, default=600.0, help="seconds (default 10 minutes)")
    so.add_argument("--clients", type=int, default=32)
    so.add_argument("--kill-every", type=float, default=3.0, help="seconds between kills of every client")

    sv = bench_parser("serve", "load on any OpenAI-compatible server (as vllm bench serve)", "serve_bench",
                      engine_options=False)
    sv.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    sv.add_argument("--model", default=None, help="model name to send (default: the first id of GET /models)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    serve_workload_args(sv)
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default inf: all at once)")
    sv.add_argument("--server-pid", type=int, default=None, help="also report this local process's CPU time")
    sv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    sv.add_argument("--logit-bias", default=None,
                    help='JSON token id -> bias sent with every request, e.g. \'{"2": -100}\' to keep a server '
                         "without ignore_eos (llama.cpp's) from stopping early")
    pe = bench_parser("peers", "pagedllm against vLLM's CPU build and llama.cpp, offline, same prompts, "
                               "alternating runs", "peers")
    pe.add_argument("--concurrency", default="1,8,32,64", help="decode workloads: concurrent requests, comma-separated")
    pe.add_argument("--prefill", default="32x128,64x128,32x512,8x1024,4x2048",
                    help="prefill workloads: NxL (N prompts of L tokens, max_tokens 1), comma-separated")
    pe.add_argument("--input-len", type=int, default=128, help="prompt tokens of the decode workloads")
    pe.add_argument("--output-len", type=int, default=128, help="new tokens of the decode workloads")
    pe.add_argument("--trace", default=None, help="a JSONL trace instead of the workloads above: its requests all "
                                                  "at once, each with its output length")
    pe.add_argument("--rounds", type=int, default=3)
    pe.add_argument("--peer", default="vllm", help="the peers, comma-separated: vllm, llama.cpp")
    pe.add_argument("--peer-dtype", default="bfloat16,float32",
                    help="vLLM's dtypes to try, comma-separated; the faster counts per workload")
    pe.add_argument("--peer-drop", type=float, default=2.0,
                    help="after round 1, stop running a peer setting this many times slower than that peer's "
                         "fastest on a workload (0: run all every round)")
    pe.add_argument("--peer-python", default=".venv-peers/bin/python", help="the vLLM venv's Python (make peers)")
    pe.add_argument("--peer-model", default=".peers/SmolLM2-135M-Instruct", help="the HF folder make peers writes")
    pe.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python",
                    help="the llama.cpp venv's Python (make peers)")
    pe.add_argument("--llamacpp-model", default=None,
                    help="the GGUF llama.cpp runs (default: the --model file when it is a GGUF)")
    pe.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)  # tests: a stand-in worker script
    pe.add_argument("--no-progress", action="store_true")
    cp = bench_parser("compare", "paged vs contiguous KV (prefix caching on and off) on a trace, one KV budget, "
                                 "the mission's table", "compare")
    add_trace_source(cp, workload="chat", num_requests=48, seed=False)
    cp.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply the trace's arrival times (0: every request at once, in trace order)")
    cp.add_argument("--configs", default="contiguous,paged,paged + prefix caching",
                    help="the runs, comma-separated, in this order")
    cp.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + output, the contiguous reservation (default: the model's context)")
    cp.add_argument("--max-num-seqs", type=int, default=None)
    cp.add_argument("--max-num-batched-tokens", type=int, default=None)
    cp.add_argument("--price-per-hour", type=float, default=0.10,
                    help="dollars per machine-hour for the cost row (default 0.10: a 2-vCPU cloud VM)")
    cp.add_argument("--plot", default=None, help="a folder for the PNG plot")
    cp.add_argument("--no-progress", action="store_true")
    cp.set_defaults(kv_cache_memory="384MiB")
    off = bench_parser("serve-offline", "the bench serve workload through LLM.generate in-process (the server's "
                      "baseline)", "serve_offline")
    serve_workload_args(off)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except (PagedLLMError, ValueError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
