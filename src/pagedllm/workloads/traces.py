"""Request traces: the workloads every benchmark and the simulator replay, and their JSONL format.

A trace is a list of ``TraceRequest``s, one JSON object per line::

    {"arrival": 0.0, "prompt_len": 812, "output_len": 24, "prefix_id": "repo-3", "prefix_len": 200}
    {"arrival": 0.41, "prompt": "Hello", "output_len": 64, "conversation": "c7", "turn": 2}

``arrival`` is seconds from the start; the prompt is either text (``prompt``; then ``prompt_len``,
if given, is only informative) or a length in tokens (``prompt_len``). ``prefix_id`` names a
prefix of ``prefix_len`` tokens that every request with that id starts with (a shared system
prompt, a repository's header); ``conversation`` and ``turn`` tie a chat's turns together: turn
k + 1's prompt starts with turn k's prompt. ``prompt_token_ids`` turns a length-only request into
token ids that keep both promises, so prefix caching sees the sharing the trace describes.

Generators (seeded: one seed, one trace):

- ``sharegpt``: log-normal lengths, mean ~160 prompt and ~340 output tokens (the vLLM paper's
  ShareGPT figures, 161 / 338), no sharing.
- ``alpaca``: log-normal, mean ~20 prompt and ~60 output tokens (the paper's 19 / 58).
- ``chat``: customer-service conversations: one shared system prompt, turns that each add a user
  message and the previous answer to the history, contexts averaging over 2,000 tokens.
- ``code``: code completion: ~800-token contexts whose first part is one of a few shared
  repository headers, short outputs.

Arrivals are Poisson at ``rate`` requests/s (``rate=inf``: all at t=0). A chat's turns arrive
in order, each a think time after the previous one; the replay does not wait for the answer.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WORKLOADS = ("sharegpt", "alpaca", "chat", "code")


class TraceError(ValueError):
    """A trace file that cannot be read: which line, and what is wrong with it."""


class TraceRequest(BaseModel):
    """One request of a trace (see the module docstring for the fields' meaning)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arrival: float = Field(ge=0, description="seconds from the start of the trace")
    output_len: int = Field(ge=1, description="tokens to generate")
    prompt: str | None = Field(None, description="the prompt text (or give prompt_len)")
    prompt_len: int | None = Field(None, ge=1, description="the prompt's length in tokens")
    prefix_id: str | None = Field(None, description="requests with the same id share a prefix")
    prefix_len: int = Field(0, ge=0, description="tokens of that shared prefix")
    conversation: str | None = Field(None, description="the conversation this turn belongs to")
    turn: int = Field(0, ge=0, description="the turn's index in its conversation")

    @model_validator(mode="after")
    def _prompt_given(self) -> TraceRequest:
        if self.prompt is None and self.prompt_len is None:
            raise ValueError("give prompt or prompt_len")
        if self.prompt is None and self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len {self.prefix_len} is longer than prompt_len {self.prompt_len}")
        if self.prefix_len and self.prefix_id is None:
            raise ValueError("prefix_len needs a prefix_id")
        return self


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(r.model_dump_json(exclude_defaults=True) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The trace in ``path``, sorted by arrival (stable); ``TraceError`` names the first bad line."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRequest.model_validate(json.loads(line)))
            except json.JSONDecodeError as e:
                raise TraceError(f"{path} line {number}: not JSON ({e.msg})") from None
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'request'}: {err['msg']}"
                                     for err in e.errors())
                raise TraceError(f"{path} line {number}: {problems}") from None
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival)


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """n Poisson arrival times at ``rate`` per second; all 0 when the rate is infinite."""
    if rate <= 0:
        raise ValueError(f"rate must be positive (inf: all at once), got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return out


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw with the given mean (before clipping to [lo, hi])."""
    return max(lo, min(hi, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def sharegpt(n: int, rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(f"sharegpt-{seed}")
    return [TraceRequest(arrival=t, prompt_len=_lognormal(rng, 161, 1.0, 4, 2048),
                         output_len=_lognormal(rng, 338, 0.8, 4, 2048)) for t in _arrivals(rng, n, rate)]


def alpaca(n: int, rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(f"alpaca-{seed}")
    return [TraceRequest(arrival=t, prompt_len=_lognormal(rng, 19, 0.5, 2, 256),
                         output_len=_lognormal(rng, 58, 0.7, 2, 512)) for t in _arrivals(rng, n, rate)]


CHAT_SYSTEM_PROMPT_LEN = 600  # one support bot's instructions, shared by every conversation
CHAT_THINK_TIME_S = 20.0      # mean pause between two turns' arrivals


def chat(n: int, rate: float = math.inf, seed: int = 0, turns: tuple[int, int] = (6, 14)) -> list[TraceRequest]:
    """``n`` requests from customer-service conversations: conversations start at ``rate`` per
    second, each with ``turns`` (min, max) turns; a turn's prompt is the system prompt, the history
    (every earlier user message and answer) and a new user message of ~100 tokens; answers ~200."""
    rng = random.Random(f"chat-{seed}")
    out: list[TraceRequest] = []
    starts = iter(_arrivals(rng, n, rate))
    conv = 0
    while len(out) < n:
        t, history = next(starts), CHAT_SYSTEM_PROMPT_LEN
        for k in range(rng.randint(*turns)):
            if len(out) == n:
                break
            user, answer = _lognormal(rng, 100, 0.6, 4, 600), _lognormal(rng, 200, 0.5, 8, 1024)
            out.append(TraceRequest(arrival=round(t, 6), prompt_len=history + user, output_len=answer,
                                    prefix_id="system", prefix_len=CHAT_SYSTEM_PROMPT_LEN,
                                    conversation=f"c{conv}", turn=k))
            history += user + answer
            t += CHAT_THINK_TIME_S * (0.5 + rng.random())  # 10-30 s: read the answer, type the next message
        conv += 1
    return sorted(out, key=lambda r: r.arrival)


CODE_REPOSITORIES = 8       # shared headers (imports, the file's first lines) among completions
CODE_HEADER_LEN = 256


def code(n: int, rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    """Code completion: contexts of ~800 tokens (the first ``CODE_HEADER_LEN`` shared by every
    request on the same repository), outputs of ~32 tokens."""
    rng = random.Random(f"code-{seed}")
    out = []
    for t in _arrivals(rng, n, rate):
        context = max(CODE_HEADER_LEN + 16, min(4096, round(rng.gauss(800, 200))))
        out.append(TraceRequest(arrival=t, prompt_len=context, output_len=_lognormal(rng, 32, 0.6, 1, 256),
                                prefix_id=f"repo-{rng.randrange(CODE_REPOSITORIES)}", prefix_len=CODE_HEADER_LEN))
    return out


def make_trace(workload: str, n: int, rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    generators = {"sharegpt": sharegpt, "alpaca": alpaca, "chat": chat, "code": code}
    if workload not in generators:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if n < 1:
        raise ValueError(f"the number of requests must be at least 1, got {n}")
    return generators[workload](n, rate, seed)


def _stream(name: str, count: int, vocab_size: int, first_token: int) -> list[int]:
    """The first ``count`` tokens of a deterministic stream named ``name`` (same name, same tokens)."""
    rng = random.Random(name)
    return [rng.randrange(first_token, vocab_size) for _ in range(count)]


def prompt_token_ids(r: TraceRequest, vocab_size: int, index: int, first_token: int = 100) -> list[int]:
    """Token ids for a length-only request: its shared prefix's stream, then its conversation's
    stream (so a turn starts with the previous turn's prompt), else a stream of its own (``index``:
    its position in the trace). Ids start at ``first_token``, past the special tokens."""
    if r.prompt_len is None:
        raise ValueError("the request has a text prompt: tokenize it instead")
    head = _stream(f"prefix:{r.prefix_id}", r.prefix_len, vocab_size, first_token) if r.prefix_len else []
    rest = f"conversation:{r.conversation}" if r.conversation is not None else f"request:{index}"
    return head + _stream(rest, r.prompt_len - r.prefix_len, vocab_size, first_token)


def summary(trace: list[TraceRequest]) -> dict:
    """Counts and means a reader checks a trace by (lengths of length-only requests)."""
    sized = [r for r in trace if r.prompt_len is not None]
    return {"requests": len(trace), "duration_s": round(max(r.arrival for r in trace), 3),
            "mean_prompt_len": round(sum(r.prompt_len for r in sized) / len(sized), 1) if sized else None,
            "mean_output_len": round(sum(r.output_len for r in trace) / len(trace), 1),
            "conversations": len({r.conversation for r in trace if r.conversation is not None}),
            "shared_prefixes": len({r.prefix_id for r in trace if r.prefix_id is not None})}


def main(args) -> dict:
    """``pagedllm trace``: write a generated trace as JSONL and print its summary."""
    try:
        args.rate = float(args.rate)
    except ValueError:
        raise ValueError(f"--rate must be a number or inf, got {args.rate!r}") from None
    trace = make_trace(args.workload, args.num_requests, args.rate, args.seed)
    write_trace(args.out, trace)
    info = {"workload": args.workload, "rate": args.rate, "seed": args.seed, "file": str(args.out), **summary(trace)}
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    return info


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm trace``'s flags."""
    p.add_argument("--workload", required=True, choices=["sharegpt", "alpaca", "chat", "code"])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", default="inf", help="Poisson arrivals per second (inf: all at t=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSONL file to write")
