"""Beam search as an ordinary engine request (vLLM's ``BeamSearchParams`` and ranking).

A ``BeamGroup`` is one beam-search request inside the ``Engine``. Its live beams are scheduler
requests whose next token it chooses (``Request.external_tokens``): each model step returns the top
``2 * beam_width`` log-probabilities of every live beam that computed; once every live beam has
delivered, the group advances as vLLM does: every candidate that ends in EOS moves to the
completed beams (unless ``ignore_eos``), and the ``beam_width`` best non-EOS candidates (by
cumulative log-probability) stay live. A beam kept k times continues itself and forks k - 1
children sharing all its blocks (ref counts; the partly filled last block is copied only when a
child writes into it); beams not kept are finished and release their blocks. Beams reaching
``max_tokens`` complete with ``length``. The result ranks completed beams by
``cum_logprob / len(tokens) ** length_penalty`` (tokens include the prompt; a final EOS is not
counted) and returns the best ``beam_width``.

Beams that have delivered hold their blocks while a sibling still computes. If no sibling that
still has to deliver is running (they were preempted and wait for memory), the delivered beams
release their blocks (``Scheduler.preempt``) so the siblings can come back: the group never
waits on memory that it holds itself. The engine interleaves groups with other requests and
can abort them like any request.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in 1..10, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, int | float) or \
                not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]              # prompt + generated, as in vLLM
    cum_logprob: float
    text: str | None = None        # the generated part
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos: frozenset[int], length_penalty: float) -> float:
    """``cum_logprob / n ** length_penalty``; where ``n ** length_penalty`` leaves the float range
    (a length_penalty of 1e300 or -1e300), its limit: 0 (-0.0) or -inf (0 for a zero logprob), not
    an OverflowError or ZeroDivisionError in the engine thread."""
    n = max(1, len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos else 0))
    try:
        scale = n ** length_penalty
    except OverflowError:
        scale = math.inf
    if scale == 0.0:
        return -math.inf if seq.cum_logprob < 0 else 0.0
    return seq.cum_logprob / scale


@dataclass
class _Beam:
    request: Request
    cum_logprob: float


@dataclass
class BeamGroup:
    """One beam-search request: live beams (scheduler requests), completed beams, pending logprobs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    cache_salt: str | None = None
    live: dict[str, _Beam] = field(default_factory=dict)
    done: list[BeamSearchSequence] = field(default_factory=list)
    pending: dict[str, TokenLogprobs] = field(default_factory=dict)
    error: str | None = None
    aborted: bool = False
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.params.max_tokens, logprobs=2 * self.params.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    @property
    def finished(self) -> bool:
        return not self.live

    def _new_beam(self, token_ids: list[int], output_ids: list[int], sp: SamplingParams) -> Request:
        req = Request(f"{self.request_id}#beam{next(self._ids)}", self.prompt_token_ids, sp,
                      max_tokens=self.params.max_tokens, cache_salt=self.cache_salt, external_tokens=True)
        req.token_ids = list(token_ids)
        req.output_token_ids = list(output_ids)
        return req

    def start(self, scheduler) -> Request:
        """Queue the root beam (the prompt)."""
        root = self._new_beam(self.prompt_token_ids, [], self.sampling_params)
        self.live[root.request_id] = _Beam(root, 0.0)
        scheduler.add(root)
        return root

    def deliver(self, request_id: str, logprobs: TokenLogprobs) -> None:
        if request_id in self.live:
            self.pending[request_id] = logprobs

    def step(self, scheduler) -> list[str]:
        """After a model step: advance if every live beam delivered, else make sure the group is not
        waiting on memory it holds. Returns the ids of beams that left the scheduler."""
        if not self.live:
            return []
        if all(rid in self.pending for rid in self.live):
            return self._advance(scheduler)
        missing = [b.request for rid, b in self.live.items() if rid not in self.pending]
        if not any(r.status is RequestStatus.RUNNING for r in missing):
            for rid in self.pending:
                if rid in self.live and self.live[rid].request.status is RequestStatus.RUNNING:
                    scheduler.preempt(rid)
        return []

    def _advance(self, scheduler) -> list[str]:
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        candidates = []  # (cum logprob, beam id, token), in beam order then likelihood order
        for rid, beam in self.live.items():
            for token, lp in self.pending[rid].top:
                cum = beam.cum_logprob + lp
                if token in eos:
                    self.done.append(BeamSearchSequence(beam.request.token_ids + [token], cum, finish_reason="stop"))
                else:
                    candidates.append((cum, rid, token))
        self.pending.clear()
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order
        keep: dict[str, list[tuple[float, int]]] = {}
        for cum, rid, token in candidates[:self.params.beam_width]:
            keep.setdefault(rid, []).append((cum, token))
        left: list[str] = []
        new_live: dict[str, _Beam] = {}
        for rid, beam in self.live.items():
            extensions = keep.get(rid)
            if not extensions:
                scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
                left.append(rid)
                continue
            parent = beam.request
            reqs = [parent]
            for _ in extensions[1:]:  # forks first, while they still match the parent
                child = self._new_beam(parent.token_ids, parent.output_token_ids, parent.sampling_params)
                scheduler.fork(rid, child)
                reqs.append(child)
            for req, (cum, token) in zip(reqs, extensions, strict=True):
                scheduler.append_token(req.request_id, token)
                if req.status.finished:  # reached max_tokens
                    self.done.append(BeamSearchSequence(list(req.token_ids), cum, finish_reason="length"))
                    left.append(req.request_id)
                else:
                    new_live[req.request_id] = _Beam(req, cum)
        self.live = new_live
        return left

    def finish_beams(self, scheduler, reason: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[str]:
        """Finish every live beam; returns their ids."""
        ids = list(self.live)
        for rid in ids:
            scheduler.finish(rid, reason)
        self.live.clear()
        self.pending.clear()
        self.aborted = True
        return ids

    # -- the request-owner interface (engine/request_owner.py) -------------------------------------
    steps_always = True  # every step: a group waiting on memory its own beams hold must release it

    def live_ids(self) -> list[str]:
        return list(self.live)

    def take_prompt_logprobs(self, entries, tokenizer) -> None:
        pass  # beams ask for no prompt logprobs

    def take_token(self, host, req: Request, logprobs: TokenLogprobs | None) -> None:
        pass  # beams' tokens are chosen here (external_tokens), from their logprobs

    def take_logprobs(self, request_id: str, logprobs: TokenLogprobs) -> None:
        self.deliver(request_id, logprobs)

    def end_step(self, host, outputs: list[RequestOutput]) -> None:
        for rid in self.step(host.scheduler):
            host.release(rid)
        for rid in self.live:
            host.adopt(rid, self)
        if self.finished:
            host.retire(self)
            outputs.append(self.output(host.tokenizer))

    def abort(self, host) -> None:
        for rid in self.live_ids():
            host.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            host.release(rid)
        self.finish_beams(host.scheduler)

    def fail(self, host, message: str, outputs: list[RequestOutput]) -> None:
        for rid in self.live_ids():
            host.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            host.release(rid)
        host.retire(self)
        self.finish_beams(host.scheduler, RequestStatus.FINISHED_ERROR)
        self.error = message
        outputs.append(self.output(host.tokenizer))

    def output(self, tokenizer) -> RequestOutput:
        """The group's one output: the best ``beam_width`` completed beams, best first."""
        n = len(self.prompt_token_ids)
        completions = []
        for i, seq in enumerate(self.ranked()):
            generated = seq.tokens[n:]
            text = None if tokenizer is None else tokenizer.decode(generated)
            completions.append(CompletionOutput(i, text, generated, seq.finish_reason, None, seq.cum_logprob))
        metrics = RequestMetrics(self.arrival_time, None, time.monotonic())
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, True, metrics,
                             error=self.error)

    def ranked(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` completed beams, best first."""
        key = lambda s: beam_score(s, self.eos_token_ids, self.params.length_penalty)  # noqa: E731
        return sorted(self.done, key=key, reverse=True)[:self.params.beam_width]
