"""``pagedllm bench serve``: load on any OpenAI-compatible server, measured as ``vllm bench serve`` does.

Owns the client side of a serving benchmark: it sends ``num_prompts`` seeded synthetic requests
(random-word prompts, ``workloads/text.py``) to ``/v1/completions`` or ``/v1/chat/completions``
through the official ``openai.AsyncOpenAI`` client, each streamed (``stream_options.include_usage``)
with ``max_tokens`` = its output length and ``ignore_eos`` as an extra body field, so every request
generates exactly what it asked for (vLLM and pagedllm both accept it; for a server that ignores
it, such as llama.cpp's, ``logit_bias`` -100 on the EOS tokens does the same). Requests arrive as a
Poisson process of ``request_rate`` per second (``inf``: all at t = 0) and at most
``max_concurrency`` are in flight at once. Failed requests (HTTP errors, refused connections, an
error chunk mid-stream, a stream without a finish reason) are counted and reported, never raised.

The report (``serve_metrics.summarize``) gives completed/failed requests, throughput, TTFT, TPOT,
ITL and E2E latency, plus the settings, the machine, the most requests seen in flight, this
process's own CPU time over the run (the load generator's share of the cores) and, given
``server_pid`` on the same machine, the server's; and, where the server's ``/metrics`` has them
(pagedllm's or vLLM's, with ``--speculative-config``), its speculative-decoding counters over the
run: guesses verified and accepted, the acceptance rate and the mean accepted length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass

import openai

from pagedllm.cli_args import add_serve_workload_args
from pagedllm.loadgen.serve_metrics import RequestRecord, summarize
from pagedllm.machine import CpuClock, machine_info, process_cpu_seconds
from pagedllm.workloads.text import TextRequest, text_workload, trace_text_workload
from pagedllm.workloads.traces import read_trace

ENDPOINTS = ("completions", "chat")
# a server's speculative-decoding counters (pagedllm's and vLLM's share the names)
SPEC_COUNTER = re.compile(r"^(?:pagedllm|vllm):spec_decode_num_(drafts|draft_tokens|accepted_tokens)(?:_total)?"
                          r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


async def spec_decode_counters(http, base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its ``/metrics`` (summed over label sets:
    several replicas, several models), or None where it has none (or no /metrics)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        response = await http.get(root + "/metrics", timeout=10)
    except Exception:  # noqa: BLE001 - a server without /metrics reports nothing here
        return None
    if response.status_code != 200:
        return None
    out: dict[str, float] = {}
    for name, value in SPEC_COUNTER.findall(response.text):
        out[name] = out.get(name, 0.0) + float(value)
    return out if len(out) == 3 else None


def spec_decode_report(before: dict | None, after: dict | None) -> dict | None:
    """The counters' growth over the run, with the acceptance rate and the mean accepted length."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after}
    return {"drafts": int(d["drafts"]), "draft_tokens": int(d["draft_tokens"]),
            "accepted_tokens": int(d["accepted_tokens"]),
            "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "mean_accepted_length": 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 0.0}


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None            # None: the first id of GET /models
    api_key: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 64
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    request_rate: float = math.inf      # requests per second, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None  # None: no limit
    seed: int = 0
    num_warmups: int = 1                # short requests sent (and awaited) before the timed run
    server_pid: int | None = None       # also report this local process's CPU time over the run
    timeout_s: float = 600.0
    progress: bool = True
    trace: str | None = None            # a JSONL trace: its requests and arrival times replace the above
    logit_bias: dict[str, float] | None = None  # sent with every request (a server without ignore_eos:
                                                # -100 on the EOS tokens keeps every output at max_tokens)

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")

    def settings(self) -> dict:
        s = asdict(self)
        s.update(input_len=f"{self.input_len[0]}:{self.input_len[1]}",
                 output_len=f"{self.output_len[0]}:{self.output_len[1]}",
                 request_rate="inf" if math.isinf(self.request_rate) else self.request_rate,
                 api_key="***" if self.api_key else None)
        del s["progress"]
        return s


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: a Poisson process of ``rate``
    per second starting at 0 (exponential gaps), or all at 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:arrivals")
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def describe_error(exc: BaseException) -> str:
    """One short line for an error, the same for every request that hit the same problem."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        text = f"HTTP {exc.status_code}: {body.get('message') or exc.message}"
    elif isinstance(exc, openai.APIConnectionError):
        text = f"{type(exc).__name__}: {exc.__cause__ or exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:300]


def _carries_output(chunk, chat: bool) -> bool:
    """A chunk that stands for generated tokens: any completions choice; for chat, any choice but
    the opening one that only announces the assistant's role. Neither counts a closing chunk that
    only brings the finish reason, with no text (llama.cpp's server sends one after the last
    token, and no usage, so its tokens are counted by chunks)."""
    if not chunk.choices:
        return False
    choice = chunk.choices[0]
    if not chat:
        return not (choice.finish_reason is not None and not choice.text)
    delta = choice.delta
    content = delta.content if delta is not None else None
    if choice.finish_reason is not None:
        return bool(content)
    return not (delta is not None and delta.role and not content)


class Session:
    """One benchmark run's client, clock and in-flight accounting."""

    def __init__(self, cfg: ServeBenchConfig, client: openai.AsyncOpenAI, model: str) -> None:
        self.cfg, self.client, self.model = cfg, client, model
        self.t0 = time.perf_counter()
        self.in_flight = 0
        self.max_in_flight = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _create(self, prompt: str, max_tokens: int):
        common = dict(model=self.model, stream=True, stream_options={"include_usage": True}, temperature=0.0,
                      extra_body={"ignore_eos": True})
        if self.cfg.logit_bias:
            common["logit_bias"] = self.cfg.logit_bias
        if self.cfg.endpoint == "chat":
            return await self.client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens, **common)
        return await self.client.completions.create(prompt=prompt, max_tokens=max_tokens, **common)

    async def stream_one(self, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        """Send one streamed request, filling ``record``; errors end up in ``record.error``."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        record.start_s = self.now()
        stream, finished = None, False
        try:
            stream = await self._create(prompt, max_tokens)
            async for chunk in stream:
                t = self.now()
                if chunk.usage is not None:
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.output_tokens = chunk.usage.completion_tokens
                if _carries_output(chunk, self.cfg.endpoint == "chat"):
                    record.chunk_s.append(t)
                if chunk.choices:
                    finished = finished or chunk.choices[0].finish_reason is not None
            if not finished:
                raise RuntimeError("the stream ended without a finish reason")
            record.end_s = self.now()
        except Exception as exc:  # noqa: BLE001 - counted and reported, never raised
            record.error = describe_error(exc)
        finally:
            self.in_flight -= 1
            if stream is not None:
                await stream.close()


async def resolve_model(client: openai.AsyncOpenAI, model: str | None) -> tuple[str, str | None]:
    """(model name, error): the given name, else the first id GET /models lists."""
    if model is not None:
        return model, None
    try:
        listed = await client.models.list()
        return listed.data[0].id, None
    except Exception as exc:  # noqa: BLE001 - the requests will fail and be counted
        return "unknown", f"GET /models: {describe_error(exc)}"


def workload(cfg: ServeBenchConfig) -> tuple[list[TextRequest], list[float]]:
    """The requests and their arrival offsets: the trace's (``cfg.trace``), else ``num_prompts``
    seeded random-word prompts arriving at ``request_rate``."""
    if cfg.trace:
        trace = read_trace(cfg.trace)
        return trace_text_workload(trace), [r.arrival for r in trace]
    requests = text_workload(cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.seed)
    return requests, arrival_offsets(len(requests), cfg.request_rate, cfg.seed)


async def run_benchmark(cfg: ServeBenchConfig, http_client=None) -> dict:
    """Run the benchmark and return its report. ``http_client``: an ``httpx.AsyncClient`` for the
    ``openai`` client to use (tests instrument the transport with it)."""
    from tqdm import tqdm

    cfg.validate()
    requests, offsets = workload(cfg)
    client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key or "EMPTY", max_retries=0,
                                timeout=cfg.timeout_s, http_client=http_client)
    import httpx

    metrics_http = httpx.AsyncClient()
    try:
        model, model_error = await resolve_model(client, cfg.model)
        warmup_errors = await _warmup(cfg, client, model)
        spec_before = await spec_decode_counters(metrics_http, cfg.base_url)
        records = [RequestRecord(i, r.num_words, r.output_len, scheduled_s=t)
                   for i, (r, t) in enumerate(zip(requests, offsets, strict=True))]
        server_cpu0 = process_cpu_seconds(cfg.server_pid) if cfg.server_pid else None
        with tqdm(total=len(records), desc="bench serve", unit="req", disable=not cfg.progress,
                  file=sys.stderr) as bar, CpuClock() as clock:
            session = Session(cfg, client, model)
            slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

            async def arrive(request: TextRequest, record: RequestRecord) -> None:
                while (wait := record.scheduled_s - session.now()) > 0:  # never sent before it is due
                    await asyncio.sleep(wait)
                if slots is None:
                    await session.stream_one(request.prompt, request.output_len, record)
                else:
                    async with slots:
                        await session.stream_one(request.prompt, request.output_len, record)
                bar.update(1)

            await asyncio.gather(*(arrive(q, r) for q, r in zip(requests, records, strict=True)))
            duration = session.now()
        spec_decode = spec_decode_report(spec_before, await spec_decode_counters(metrics_http, cfg.base_url))
        server_cpu = None
        if server_cpu0 is not None:
            used = process_cpu_seconds(cfg.server_pid) - server_cpu0
            server_cpu = {"pid": cfg.server_pid, "cpu_s": round(used, 3), "cores_busy": round(used / duration, 3)}
    finally:
        await client.close()
        await metrics_http.aclose()
    return {"settings": cfg.settings(), "model": model, "model_error": model_error, "warmup_errors": warmup_errors,
            "machine": machine_info(), **summarize(records, duration), "max_in_flight": session.max_in_flight,
            "client_cpu": clock.result.as_dict(), "server_cpu": server_cpu, "spec_decode": spec_decode,
            "requests": [r.as_dict() for r in records]}


async def _warmup(cfg: ServeBenchConfig, client: openai.AsyncOpenAI, model: str) -> list[str]:
    """Short requests (their own prompts, so no prefix-cache hits for the timed ones), not measured."""
    if not cfg.num_warmups:
        return []
    warm = text_workload(cfg.num_warmups, cfg.input_len, (16, 16), f"{cfg.seed}:warmup")
    session = Session(cfg, client, model)
    records = [RequestRecord(i, r.num_words, r.output_len) for i, r in enumerate(warm)]
    await asyncio.gather(*(session.stream_one(r.prompt, r.output_len, rec) for r, rec in zip(warm, records,
                                                                                             strict=True)))
    return sorted({r.error for r in records if r.error})


def run(cfg: ServeBenchConfig, http_client=None) -> dict:
    return asyncio.run(run_benchmark(cfg, http_client))


def _row(label: str, value) -> str:
    return f"{label:<44}{'-' if value is None else value:>12}"


def format_report(report: dict) -> str:
    s = report["settings"]
    lines = [f"{'=' * 16} Serving Benchmark Result {'=' * 16}",
             f"{report['model']} at {s['base_url']} ({s['endpoint']}), "
             + (f"trace {s['trace']} ({len(report['requests'])} requests at its arrival times), "
                if s.get("trace") else f"{s['num_prompts']} prompts, input {s['input_len']} words, output "
                                      f"{s['output_len']} tokens, rate {s['request_rate']}/s, ")
             + f"max concurrency {s['max_concurrency'] or 'none'}",
             _row("Successful requests:", report["completed"]),
             _row("Failed requests:", report["failed"])]
    lines += [f"  {n} x {err}" for err, n in report["errors"].items()]
    for label, err in (("model", report["model_error"]), ("warmup", "; ".join(report["warmup_errors"]) or None)):
        if err:
            lines.append(f"  {label}: {err}")
    cpu, server = report["client_cpu"], report["server_cpu"]
    lines += [_row("Benchmark duration (s):", f"{report['duration_s']:.2f}"),
              _row("Total input tokens:", report["total_input_tokens"]),
              _row("Total generated tokens (usage):", report["total_output_tokens"]),
              _row("Streamed output chunks:", report["streamed_chunks"]),
              _row("Request throughput (req/s):", report["request_throughput"]),
              _row("Output token throughput (tok/s):", report["output_throughput"]),
              _row("Total token throughput (tok/s):", report["total_token_throughput"]),
              _row("Most requests in flight:", report["max_in_flight"]),
              _row("Load generator CPU (s / cores busy):", f"{cpu['process_s']:.2f} / {cpu['cores_busy']:.2f}")]
    if server:
        lines.append(_row("Server CPU (s / cores busy):", f"{server['cpu_s']:.2f} / {server['cores_busy']:.2f}"))
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        d = report[key]
        lines.append(f"{name:-^58}")
        for stat in ("mean", "p50", "p99"):
            lines.append(_row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} (ms):",
                              None if d[stat] is None else f"{d[stat]:.2f}"))
    spec = report.get("spec_decode")
    if spec is not None:  # as vllm bench serve prints it
        lines += [f"{'Speculative Decoding':-^58}",
                  _row("Acceptance rate (%):", f"{100 * spec['acceptance_rate']:.2f}"),
                  _row("Acceptance length:", f"{spec['mean_accepted_length']:.2f}"),
                  _row("Drafts:", spec["drafts"]), _row("Draft tokens:", spec["draft_tokens"]),
                  _row("Accepted tokens:", spec["accepted_tokens"])]
    lines.append("=" * 58)
    return "\n".join(lines)


def config_from_args(args) -> ServeBenchConfig:
    from pagedllm.workloads.synthetic import parse_range

    return ServeBenchConfig(base_url=args.base_url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                            num_prompts=args.num_prompts, input_len=parse_range(args.input_len, "--input-len"),
                            output_len=parse_range(args.output_len, "--output-len"), request_rate=args.request_rate,
                            max_concurrency=args.max_concurrency, seed=args.seed, num_warmups=args.num_warmups,
                            server_pid=args.server_pid, timeout_s=args.timeout, progress=not args.no_progress,
                            trace=args.trace, logit_bias=parse_logit_bias(args.logit_bias))


def parse_logit_bias(text: str | None) -> dict[str, float] | None:
    """``'{"2": -100}'`` -> {"2": -100.0}: token ids (as strings, as the OpenAI API has them) to biases."""
    if not text:
        return None
    try:
        bias = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--logit-bias: not JSON ({e.msg}): {text!r}") from None
    if not isinstance(bias, dict) or not all(k.isdigit() and isinstance(v, int | float) and not isinstance(v, bool)
                                             for k, v in bias.items()):
        raise ValueError(f'--logit-bias: expected an object of token ids to numbers, e.g. {{"2": -100}}: {text!r}')
    return {k: float(v) for k, v in bias.items()}


def main(args) -> dict:
    report = run(config_from_args(args))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench serve``'s flags."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name to send (default: the first id of GET /models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    add_serve_workload_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--server-pid", type=int, default=None, help="also report this local process's CPU time")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--logit-bias", default=None,
                   help='JSON token id -> bias sent with every request, e.g. \'{"2": -100}\' to keep a server '
                        "without ignore_eos (llama.cpp's) from stopping early")
