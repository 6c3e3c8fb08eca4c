"""Output processing: from a request's new tokens to the ``RequestOutput``s the caller sees.

Owns, per user request (``RequestState``) and per sequence of it (``SequenceState``): the
incremental detokenizer, the text so far, stop-string matching, log-probabilities as ``Logprob``
objects, and how much of all that previous outputs already carried.

Stop strings behave as in vLLM: they are checked on every new token once ``min_tokens`` exist
(also on the token that ends the request by length or EOS: a match makes ``finish_reason``
``stop``), the matched string is cut from the text (kept with ``include_stop_str_in_output``), and
until the sequence finishes the last ``max_stop_len - 1`` characters are held back, so streamed
text never shows a partial stop string that later disappears. The text of the token that stopped
a request (EOS or a ``stop_token_ids`` token) is left out unless ``include_stop_str_in_output``.
Invariant: the text a sequence has emitted is always a prefix of its final text, so
concatenating ``DELTA`` outputs gives exactly the ``FINAL_ONLY`` output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import RequestOutputKind
from pagedllm.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def to_logprob_dict(lp: TokenLogprobs, tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token first, then the top-k (most likely first)."""
    ids = [lp.token_id, *(t for t, _ in lp.top)]
    texts = tokenizer.decode_each(ids) if tokenizer is not None else [None] * len(ids)
    out = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
    ranks = lp.top_ranks or range(1, len(lp.top) + 1)
    for rank, (token, value), text in zip(ranks, lp.top, texts[1:], strict=True):
        out.setdefault(token, Logprob(value, rank, text))
    return out


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest (index, stop string) that overlaps the last ``num_new_chars`` characters of ``text``."""
    hits = []
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if idx >= 0:
            hits.append((idx, stop))
    return min(hits) if hits else None


@dataclass
class SequenceState:
    """One generated sequence: its text, finish state and what has been emitted so far."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_text: int = 0      # characters, tokens and logprob entries already emitted (DELTA)
    sent_tokens: int = 0
    sent_logprobs: int = 0
    hold_back: int = field(init=False)

    def __post_init__(self) -> None:
        params = self.request.sampling_params
        stops = params.stop_strings
        self.hold_back = max(map(len, stops)) - 1 if stops and not params.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token: int, logprobs: dict[int, Logprob] | None) -> str | None:
        """Account for the request's newest token; returns the stop string it completed, if any
        (the caller then finishes the request). Call after the scheduler's stop checks."""
        req = self.request
        params = req.sampling_params
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs, self.cumulative_logprob = [], 0.0
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token].logprob
        stop_string = None
        stopped_by_token = req.status is RequestStatus.FINISHED_STOPPED
        if self.detokenizer is not None and not (stopped_by_token and not params.include_stop_str_in_output):
            new = self.detokenizer.add(token)
            self.text += new
            if new and params.stop_strings and req.num_output_tokens > params.min_tokens:
                hit = find_stop_string(self.text, len(new), params.stop_strings)
                if hit is not None:
                    idx, stop_string = hit
                    self.text = self.text[:idx + len(stop_string) if params.include_stop_str_in_output else idx]
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif req.status.finished:
            self.finish_reason = req.status.value
            if req.status is RequestStatus.FINISHED_STOPPED:
                self.stop_reason = None if token in req.eos_token_ids and not params.ignore_eos else token
        return stop_string

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        """This sequence as an output of ``kind``; DELTA advances what counts as sent."""
        end = max(self.sent_text, len(self.text) - (0 if self.finished else self.hold_back))
        tokens = self.request.output_token_ids
        logprobs = self.logprobs
        if kind is RequestOutputKind.DELTA:
            out = CompletionOutput(self.index, self.text[self.sent_text:end], tokens[self.sent_tokens:],
                                   self.finish_reason, self.stop_reason, self.cumulative_logprob,
                                   None if logprobs is None else logprobs[self.sent_logprobs:])
            self.sent_text, self.sent_tokens = end, len(tokens)
            self.sent_logprobs = 0 if logprobs is None else len(logprobs)
            return out
        return CompletionOutput(self.index, self.text[:end], list(tokens), self.finish_reason, self.stop_reason,
                                self.cumulative_logprob, None if logprobs is None else list(logprobs))


@dataclass
class RequestState:
    """One user request: its prompt and its n sequences (n > 1 for parallel sampling)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]
    output_kind: RequestOutputKind
    arrival_time: float
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None
    prompt_logprobs_sent: bool = False
    changed: set[int] = field(default_factory=set)  # sequences with something new this step
    steps_always = False  # a request-owner attribute (engine/request_owner.py): only steps with tokens

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    # -- the request-owner interface (engine/request_owner.py) -------------------------------------
    def live_ids(self) -> list[str]:
        return [s.request.request_id for s in self.seqs if not s.finished]

    def take_token(self, host, req: Request, logprobs: TokenLogprobs | None) -> None:
        """A sequence's new token: through its grammar (if any), its stop checks and detokenizer."""
        seq = next(s for s in self.seqs if s.request is req)
        token = req.output_token_ids[-1]
        grammar_done = req.request_id in host.structured and self._accept_grammar(host, req, token)
        stop = seq.add_token(token, None if logprobs is None else to_logprob_dict(logprobs, host.tokenizer))
        if stop is not None and not req.status.finished:
            host.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        if grammar_done and not seq.finished:  # the grammar is complete: only EOS could follow
            host.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            seq.finish("stop")
        if seq.finished:
            host.release(req.request_id)
        self.changed.add(seq.index)

    def _accept_grammar(self, host, req: Request, token: int) -> bool:
        """Feed a structured-output sequence its new token; True when its grammar is complete. A token
        the grammar rejects fails this sequence alone (``finish_reason="error"``)."""
        completed, error = host.structured.accept(req.request_id, token)
        if error is not None:
            log.error("request %s: %s", req.request_id, error)
            self.error = error
            host.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
        return completed

    def take_logprobs(self, request_id: str, logprobs: TokenLogprobs) -> None:
        pass  # a sampled sequence gets its logprobs with its token (take_token)

    def end_step(self, host, outputs: list[RequestOutput]) -> None:
        changed, self.changed = self.changed, set()
        self._emit(host, outputs, changed)

    def _emit(self, host, outputs: list[RequestOutput], changed: set[int] | None = None) -> None:
        out = self.output(changed)
        if self.finished:
            host.retire(self)
        if out is not None:
            outputs.append(out)

    def abort(self, host) -> None:
        for rid in self.live_ids():
            host.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            host.release(rid)

    def fail(self, host, message: str, outputs: list[RequestOutput]) -> None:
        for rid in self.live_ids():
            host.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
            host.release(rid)
        host.retire(self)
        self.error = message
        for s in self.seqs:
            s.finish("error")
        self._emit(host, outputs)

    def take_prompt_logprobs(self, entries: list[tuple[int, TokenLogprobs]], tokenizer: Tokenizer | None) -> None:
        """Store log-probabilities of prompt tokens (entry (p, lp): of the token at position p + 1)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        for pos, lp in entries:
            self.prompt_logprobs[pos + 1] = to_logprob_dict(lp, tokenizer)

    def output(self, changed: set[int] | None = None) -> RequestOutput | None:
        """The output this request owes its caller now (None if its kind has nothing to say yet).
        ``changed``: indices of sequences with something new (DELTA carries only those)."""
        finished = self.finished
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        seqs = self.seqs
        if kind is RequestOutputKind.DELTA and changed is not None:
            seqs = [s for s in seqs if s.index in changed]
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = True
        first = min((s.request.first_token_time for s in self.seqs if s.request.first_token_time), default=None)
        metrics = RequestMetrics(self.arrival_time, first, time.monotonic() if finished else None,
                                 sum(s.request.num_preemptions for s in self.seqs),
                                 self.seqs[0].request.first_scheduled_time)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [s.completion(kind) for s in seqs],
                             finished, metrics, prompt_logprobs, self.seqs[0].request.num_cached_tokens, self.error)
