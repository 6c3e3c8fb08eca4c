"""Per-request measurements of a serving benchmark and their summary, as ``vllm bench serve`` defines them.

A ``RequestRecord`` holds what the load generator saw for one streamed request: when it was due
(its Poisson arrival), when it was sent, when each streamed chunk carrying output arrived, the
usage the server reported, and the error if it failed. ``summarize`` turns records into the
report's figures:

- TTFT: send -> first chunk carrying output;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token;
- ITL: every gap between two consecutive output-carrying chunks, all requests pooled;
- E2E: send -> end of the stream;
- throughput: completed requests, output tokens (as the server's usage reports them) and input +
  output tokens, each over the benchmark's duration (first arrival -> last request done).

Plain Python, no I/O: the same code summarizes a live run and a test's hand-made records.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    index: int
    prompt_words: int           # what was asked for: input length (words of the prompt) ...
    requested_output_len: int   # ... and max_tokens (sent with ignore_eos)
    scheduled_s: float = 0.0    # arrival time, seconds after the benchmark started
    start_s: float | None = None   # when the request was sent (after waiting for a concurrency slot)
    chunk_s: list[float] = field(default_factory=list)  # arrival of each output-carrying chunk
    end_s: float | None = None
    prompt_tokens: int | None = None      # from the usage the server reported
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.start_s if self.end_s is not None else None

    @property
    def num_output_tokens(self) -> int:
        """The usage's completion tokens, or the number of streamed chunks if the server sent no usage."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_s)

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        if n < 2 or self.ttft_s is None or self.e2e_s is None:  # e2e is None for a failed request
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 6)
        return {"index": self.index, "prompt_words": self.prompt_words,
                "requested_output_len": self.requested_output_len, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "streamed_chunks": len(self.chunk_s),
                "scheduled_s": r(self.scheduled_s), "start_s": r(self.start_s), "end_s": r(self.end_s),
                "ttft_s": r(self.ttft_s), "tpot_s": r(self.tpot_s), "e2e_s": r(self.e2e_s),
                "itl_s": [round(x, 6) for x in self.itl_s], "error": self.error}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in 0..100."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(values_s: list[float]) -> dict:
    """mean / p50 / p90 / p99 / max in milliseconds (None each when there are no values)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    ms = [v * 1000 for v in values_s]
    return {"mean": round(sum(ms) / len(ms), 3), "p50": round(percentile(ms, 50), 3),
            "p90": round(percentile(ms, 90), 3), "p99": round(percentile(ms, 99), 3), "max": round(max(ms), 3),
            "count": len(ms)}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """The report's figures over all records (failed requests counted, not measured)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output = sum(r.num_output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    chunks = sum(len(r.chunk_s) for r in done)
    per_s = lambda x: round(x / duration_s, 3) if duration_s > 0 else None
    return {
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(r.error or "no end of stream" for r in failed).most_common(10)),
        "duration_s": round(duration_s, 6),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "requested_output_tokens": sum(r.requested_output_len for r in done),
        "streamed_chunks": chunks,
        "requests_without_usage": sum(r.output_tokens is None for r in done),
        # a server streams one chunk per step and request, so chunks == tokens unless it batches deltas
        "usage_chunk_mismatches": sum(r.output_tokens is not None and r.output_tokens != len(r.chunk_s) for r in done),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output),
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
    }
