"""Continuous batching: which requests run in the next step, and with how many tokens.

Every step spends one token budget (``max_num_batched_tokens``): running requests first (oldest
first), then waiting ones (FCFS) while there are sequence slots (``max_num_seqs``) and the free
pool holds the request's whole prompt. A prompt that does not fit the budget is prefilled in
chunks over several steps; prefill and decode share a step. When the KV pool runs out, a running
request is preempted (the eviction policy chooses: the newest under the default ``lru``; see
``kvcache/eviction.py``). With ``preemption_mode="recompute"`` its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed (prompt + tokens
so far; the prefix cache usually still holds most of it). With ``"swap"`` its blocks are copied to
the host tier (recompute if that is full) and it waits in ``swapped``; swapped requests come back
before any new one is admitted, their blocks copied in while the step that brings them back runs.
Forks (parallel-sampling siblings, beams) share their parent's blocks when a sequence slot is free
and otherwise wait to be recomputed, so ``max_num_seqs`` always holds. ``preempt`` lets a caller
release a running request (a beam whose siblings wait for memory). No torch here: the output is
plain data (``SchedulerOutput``).

Invariants: a request is in exactly one of ``waiting``/``running``/``swapped`` until it finishes;
finished, aborted and preempted requests hold no device blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.speculative.drafter import Drafter
from pagedllm.errors import RequestTooLong
from pagedllm.kvcache.interface import KVCacheManagerProtocol


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute ``token_ids`` at positions ``start_pos...``."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    fork_ids: list[str] = field(default_factory=list)  # siblings sampled from the same logits
    # speculative decoding: the last ``len(draft_token_ids)`` of token_ids are guesses, verified by
    # sampling at each of their positions too (engine/speculative/)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before any write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks, first of all
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device): prefetched during the step
    swapped_in: list[str] = field(default_factory=list)  # requests whose blocks swap_in brings back

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no KV blocks to move."""
        return not (self.chunks or self.copies or self.swap_out or self.swap_in)


class Scheduler:
    """Iteration-level scheduler over a ``KVCacheManager``."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManagerProtocol) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # preempted by swap, oldest arrival first
        self.requests: dict[str, Request] = {}
        self.empty_steps = 0  # consecutive steps that scheduled nothing while requests were unfinished
        self.observers: list[Callable[[SchedulerOutput], None]] = []  # told each step's output (engine replay)
        self.drafter: Drafter | None = None  # speculative decoding: guesses for decoding requests

    # -- admission -------------------------------------------------------------------------
    def add(self, request: Request, forks: list[Request] = ()) -> None:
        """Queue a request; ``forks`` are its parallel-sampling siblings, which share its prompt's
        blocks: they start running when the request's prompt has been computed."""
        for r in (request, *forks):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        self.requests[request.request_id] = request
        for f in forks:
            f.parent_id = request.request_id
            self.requests[f.request_id] = f
        request.pending_forks = list(forks)
        self.waiting.append(request)

    def check_admissible(self, num_prompt: int, max_tokens: int | None) -> int:
        """The admission rule (the engine's and the simulator's): a request's max_tokens (filled in
        up to max_model_len when None); ``RequestTooLong`` if it cannot fit max_model_len or the
        whole block pool."""
        limit = self.config.max_model_len
        if num_prompt >= limit:
            raise RequestTooLong(f"prompt ({num_prompt} tokens) must be shorter than max_model_len ({limit}) "
                                 "to leave room for at least one generated token")
        if max_tokens is None:
            max_tokens = limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise RequestTooLong(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} tokens "
                f"exceeds max_model_len ({limit})")
        need = self.kv.max_blocks_for_request(num_prompt + max_tokens)
        if need > self.kv.num_blocks:
            raise RequestTooLong(
                f"prompt + max_tokens = {num_prompt + max_tokens} tokens needs {need} KV blocks of "
                f"{self.kv.block_size} ({self.kv.layout} layout), more than the whole pool "
                f"(num_kv_blocks={self.kv.num_blocks})")
        return max_tokens


    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def stalled(self) -> bool:
        """Two steps in a row scheduled nothing with requests unfinished: nothing ever will (a bug,
        never expected). The engine fails those requests, the simulator rejects them."""
        return self.empty_steps >= 2

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's work; counts the steps in a row that scheduled nothing (``stalled``)."""
        out = self._schedule()
        self.empty_steps = self.empty_steps + 1 if out.is_empty and self.has_unfinished() else 0
        for observe in self.observers:
            observe(out)
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.kv.begin_step()

        drafter = self.drafter
        guesses = {}
        if drafter is not None and drafter.may_guess(len(self.running)) and self._only_decoding():
            guesses = self._plan_guesses(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:  # nothing to compute until its next token is chosen (beam search)
                i += 1
                continue
            mine = guesses.get(req.request_id)
            if mine and len(mine) < budget and self.kv.allocate_slots(
                    req.request_id, req.num_tokens + len(mine), num_computed=req.num_computed_tokens):
                # its next token and the guesses after it (lookahead slots); without room, it decodes as usual
                out.chunks.append(self._chunk(req, 1, mine))
                budget -= 1 + len(mine)
                i += 1
                continue
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                             num_computed=req.num_computed_tokens):
                # only requests not yet scheduled in this step (index >= i) can be preempted
                victim = self.running.pop(i + self.kv.choose_victim([r.request_id for r in self.running[i:]]))
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break  # running[i] is now the next request: it may still fit
            else:
                out.chunks.append(self._chunk(req, num_new))
                budget -= num_new
                i += 1

        if not out.preempted:
            # swapped requests come back first; their blocks are copied in while this step runs,
            # and they compute from the next step on
            while self.swapped and len(self.running) < self.config.max_num_seqs:
                req = self.swapped[0]
                if not self.kv.swap_in(req.request_id, req.num_computed_tokens):
                    break
                self.swapped.pop(0)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.swapped_in.append(req.request_id)
        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                cached = self.kv.cached_prefix(req.request_id, req.token_ids, req.cache_salt) \
                    if req.use_prefix_cache else []
                num_cached = len(cached) * self.kv.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                if not self._whole_prompt_fits(req, cached):
                    break
                if not self.kv.allocate_slots(req.request_id, num_cached + num_new, cached,
                                              max_total_tokens=req.num_prompt_tokens + req.max_tokens):
                    break
                if req.num_preemptions == 0:  # count each prompt once, not its recomputations
                    self.kv.record_prefix_query(req.num_tokens, num_cached)
                    req.num_cached_tokens = num_cached
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_cached
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.chunks.append(self._chunk(req, num_new))
                budget -= num_new
        out.copies = self.kv.take_copies()
        out.swap_out, out.swap_in = self.kv.take_swaps()
        return out

    def _whole_prompt_fits(self, req: Request, cached) -> bool:
        """Admission control: a request starts only if the free pool holds its whole prompt (and
        tokens so far), though this step allocates only its first chunk. Otherwise a long prompt
        admitted on its first chunk runs the pool dry on a later one and preempts a request that
        is part-way through its own prefill (with recompute, that work is lost), or is preempted
        itself: requests would take turns destroying each other's prefills."""
        reclaimed = sum(1 for b in cached if b.ref_count == 0)  # free cached blocks a hit takes back
        need = self.kv.blocks_for_tokens(req.num_tokens) - len(cached)
        return need + reclaimed <= self.kv.num_free_blocks

    def _only_decoding(self) -> bool:
        """Whether every request of this step decodes: none prefills, waits or is swapped out. Only
        then may it guess: guesses take step budget and lookahead blocks, so beside a prompt they
        would move its chunk boundaries (or its admission), and a chunk's length changes how the
        dense GEMMs round its rows: outputs would no longer equal plain decoding's."""
        if self.waiting or self.swapped:
            return False
        return all(req.num_tokens - req.num_computed_tokens <= 1 for req in self.running)

    def _plan_guesses(self, budget: int) -> dict[str, list[int]]:
        """The drafter's guesses for this step's decoding requests (speculative decoding), at most
        what each one's max_tokens, max_model_len and the step's budget leave."""
        decoding = []
        for req in self.running:
            if req.num_tokens - req.num_computed_tokens == 1 and not req.pending_forks:
                most = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                           self.config.max_model_len - req.num_tokens - 1)
                if most > 0:
                    decoding.append((req, most))
        return self.drafter.plan_step(decoding, len(self.running))

    def _chunk(self, req: Request, num_new: int, guesses: list[int] = ()) -> ScheduledChunk:
        start = req.num_computed_tokens
        sample = start + num_new == req.num_tokens
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids[start:start + num_new] + list(guesses),
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=sample,
            fork_ids=[f.request_id for f in req.pending_forks] if sample else [],
            draft_token_ids=list(guesses),
        )

    def preempt(self, request_id: str) -> None:
        """Release a running request's blocks now and requeue it at the back, to be recomputed (a beam
        that has delivered its log-probabilities while its siblings wait for memory)."""
        req = self.requests[request_id]
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._preempt(req, to_back=True)

    def _preempt(self, req: Request, to_back: bool = False) -> None:
        self.kv.record_preemption()
        req.num_preemptions += 1
        if not to_back and self.config.preemption_mode == "swap" and self.kv.swap_out(req.request_id):
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            self.swapped.sort(key=lambda r: r.arrival_time)
            return
        self.kv.free(req.request_id, keep_hashes=True)  # recompute (also the fallback when the host tier is full)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if to_back:
            self.waiting.append(req)
        else:
            self.waiting.appendleft(req)

    # -- after the model ran -------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int] | int],
               on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled ones, finish what stopped.

        ``sampled[rid]``: the tokens a chunk's request gets, in order: one (a list, or an int), or for a chunk with
        guesses the accepted guesses (each equal to the guess at its position) and the model's next
        token. Each token is appended and checked (stop tokens, lengths) in turn, and
        ``on_token(request, i)`` told of the i-th (it may finish the request: a stop string); the
        rest are dropped once the request finishes. The guesses the model rejected are rolled back:
        computed tokens count only the verified ones, blocks reserved past them return to the pool
        (``trim``), and only blocks full of verified tokens enter the prefix cache.

        Returns the requests that got a new token this step (finished ones included).
        """
        progressed = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status.finished:
                continue
            guesses = chunk.draft_token_ids
            req.num_computed_tokens += chunk.num_tokens - len(guesses)
            tokens = sampled.get(chunk.request_id)
            if isinstance(tokens, int):
                tokens = [tokens]
            self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens, req.cache_salt)
            if not tokens or req.external_tokens:
                continue
            accepted = len(tokens) - 1
            if guesses:
                self.drafter.record(req.request_id, len(guesses), accepted)
            for j, token in enumerate(tokens):
                req.append_output(token)
                if j < accepted:  # the guess at this position was the model's token: its KV is verified
                    req.num_computed_tokens += 1
                    self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens,
                                              req.cache_salt)
                if j == 0:
                    for fid in chunk.fork_ids:
                        fork = self.requests.get(fid)
                        if fork is not None and fid in sampled:
                            first = sampled[fid]
                            first = first if isinstance(first, int) else first[0]
                            progressed.append(self._start_fork(req, fork, first))
                            if on_token is not None:
                                on_token(fork, 0)
                    req.pending_forks = [f for f in req.pending_forks if f.request_id not in chunk.fork_ids]
                status = req.check_stop(self.config.max_model_len)
                if status is not None:
                    self.finish(req.request_id, status)
                if on_token is not None:
                    on_token(req, j)
                if req.status.finished:
                    break
            if guesses and not req.status.finished:
                self.kv.trim(req.request_id, req.num_computed_tokens)
            progressed.append(req)
        return progressed

    def append_token(self, request_id: str, token: int) -> Request:
        """Append a token chosen outside the sampler (beam search); finishes the request at its limit."""
        req = self.requests[request_id]
        req.append_output(token)
        status = req.check_stop(self.config.max_model_len)
        if status is not None:
            self.finish(request_id, status)
        return req

    def fork(self, parent_id: str, child: Request) -> None:
        """Start ``child`` (same tokens as the parent) sharing the parent's computed blocks; if the
        parent holds none right now (preempted), the child recomputes from the waiting queue."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        self._join(self.requests[parent_id], child)

    def _join(self, parent: Request, child: Request) -> None:
        """Run ``child`` on the parent's computed blocks (shared) if the parent holds them and a
        sequence slot is free (``max_num_seqs``); else queue it to be recomputed (its full prompt
        blocks are usually still prefix-cache hits)."""
        if (parent.status is RequestStatus.RUNNING and len(self.running) < self.config.max_num_seqs
                and parent.request_id in self.kv.tables
                and self.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens)):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)

    def _start_fork(self, parent: Request, fork: Request, token: int) -> Request:
        """A sibling takes the parent's computed prompt blocks (shared) and its own first token."""
        self._join(parent, fork)
        fork.append_output(token)
        status = fork.check_stop(self.config.max_model_len)
        if status is not None:
            self.finish(fork.request_id, status)
        return fork

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.parent_id is not None and (parent := self.requests.get(req.parent_id)) is not None:
            parent.pending_forks = [f for f in parent.pending_forks if f is not req]
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
        req.status = status
        self.kv.free(request_id)
        if self.drafter is not None:
            self.drafter.finish(request_id, req.output_token_ids)
        return req
