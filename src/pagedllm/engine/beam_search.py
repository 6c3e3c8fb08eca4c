"""Beam search (vLLM's ``LLM.beam_search`` API) whose beams share KV blocks by fork / copy-on-write.

Every live beam is a request in the scheduler whose next token is chosen here, not by the
sampler: each step the model returns the top ``2 * beam_width`` log-probabilities of every beam;
once all live beams of a prompt have theirs, the ``beam_width`` best extensions (by cumulative
log-probability) are kept. A beam kept k times continues itself and forks k - 1 children that
share all its blocks (ref counts); the partly filled last block is copied only when a child
writes into it. Beams not kept are finished and their blocks released. A kept extension that
ends in EOS is complete and stops (unless ``ignore_eos``). After ``max_tokens`` steps, complete
and live beams are ranked by ``cum_logprob / len(tokens) ** length_penalty`` (tokens include the
prompt; a final EOS is not counted), as vLLM does.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.errors import InvalidRequest

_ids = itertools.count()


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


@dataclass
class BeamSearchSequence:
    tokens: list[int]              # prompt + generated, as in vLLM
    cum_logprob: float
    text: str | None = None        # the generated part
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    request: Request
    cum_logprob: float


@dataclass
class _Prompt:
    prompt_ids: list[int]
    live: dict[str, _Beam]
    done: list[BeamSearchSequence] = field(default_factory=list)
    pending: dict[str, TokenLogprobs] = field(default_factory=dict)


def beam_score(seq: BeamSearchSequence, eos: frozenset[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos else 0)
    return seq.cum_logprob / (n ** length_penalty)


def beam_search(engine, prompts: list, params: BeamSearchParams, stats: dict | None = None) -> list[BeamSearchOutput]:
    """Run beam search for each prompt to completion; ``stats`` (optional) receives the peak
    number of blocks used and what the beams would hold without sharing."""
    sched, runner, kv = engine.scheduler, engine.runner, engine.kv_manager
    width = params.beam_width
    eos = engine.eos_token_ids
    sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=2 * width, ignore_eos=True)
    limit = engine.config.scheduler.max_model_len
    groups: list[_Prompt] = []
    owner: dict[str, _Prompt] = {}

    def new_request(prompt_ids: list[int]) -> Request:
        return Request(f"beam{next(_ids)}", prompt_ids, sp, max_tokens=params.max_tokens, external_tokens=True)

    for prompt in prompts:
        _, ids, _ = engine.tokenize_prompt(prompt)
        if len(ids) + params.max_tokens > limit:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                 f"max_model_len ({limit})")
        groups.append(_Prompt(ids, {}))
    for g in groups:
        root = new_request(g.prompt_ids)
        g.live[root.request_id] = _Beam(root, 0.0)
        owner[root.request_id] = g
        sched.add(root)

    peak_used = peak_unshared = 0
    try:
        while any(g.live for g in groups):
            out = sched.schedule()
            result = runner.execute(out, sched.requests)
            sched.update(out, result.tokens)
            for rid, lp in result.logprobs.items():
                if rid in owner:
                    owner[rid].pending[rid] = lp
            peak_used = max(peak_used, kv.num_blocks - kv.num_free_blocks)
            peak_unshared = max(peak_unshared, sum(len(t.blocks) for t in kv.tables.values()))
            for g in groups:
                if g.live and all(rid in g.pending for rid in g.live):
                    _advance(g, sched, owner, width, eos, params, new_request)
    finally:
        for rid in list(owner):
            sched.finish(rid, RequestStatus.FINISHED_ABORTED)
            runner.release(rid)
    if stats is not None:
        stats.update(peak_blocks_used=peak_used, peak_blocks_without_sharing=peak_unshared)
    tok = engine.tokenizer
    outputs = []
    for g in groups:
        ranked = sorted(g.done, key=lambda s: beam_score(s, eos, params.length_penalty), reverse=True)[:width]
        for s in ranked:
            s.text = tok.decode(s.tokens[len(g.prompt_ids):]) if tok is not None else None
        outputs.append(BeamSearchOutput(ranked))
    return outputs


def _advance(g: _Prompt, sched, owner, width, eos, params, new_request) -> None:
    """All live beams of ``g`` have their candidates: keep the best ``width`` extensions."""
    cands = []
    for rid, beam in g.live.items():
        for token, lp in g.pending[rid].top.items():
            cands.append((beam.cum_logprob + lp, rid, token))
    cands.sort(key=lambda c: c[0], reverse=True)
    g.pending.clear()
    keep: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for cum, rid, token in cands[:width]:
        beam = g.live[rid]
        if token in eos and not params.ignore_eos:
            g.done.append(BeamSearchSequence(beam.request.token_ids + [token], cum, finish_reason="stop"))
        else:
            keep[rid].append((cum, token))
    new_live: dict[str, _Beam] = {}
    for rid, beam in g.live.items():
        exts = keep.get(rid, [])
        reqs = [beam.request]
        for _ in exts[1:]:  # forks first, while they still match the parent
            child = new_request(g.prompt_ids)
            child.token_ids = list(beam.request.token_ids)
            child.output_token_ids = list(beam.request.output_token_ids)
            sched.fork(rid, child)
            owner[child.request_id] = g
            reqs.append(child)
        if not exts:
            sched.finish(rid, RequestStatus.FINISHED_ABORTED)
            owner.pop(rid, None)
            continue
        for req, (cum, token) in zip(reqs, exts, strict=True):
            sched.append_token(req.request_id, token)
            if req.status.finished:  # reached max_tokens
                g.done.append(BeamSearchSequence(list(req.token_ids), cum, finish_reason="length"))
                owner.pop(req.request_id, None)
            else:
                new_live[req.request_id] = _Beam(req, cum)
    g.live = new_live
