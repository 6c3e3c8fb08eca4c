"""Drafter: which decoding requests guess how many tokens in a step, and what speculation achieved.

Owns the proposer (``NgramProposer`` or ``SuffixProposer``), each live request's measured
acceptance, and the engine's counters (``SpecDecodeStats``: what ``pagedllm:spec_decode_*`` and
the bench reports show). Each step the scheduler hands it the decoding requests (``plan_step``)
and gets their guesses; after verification it is told how many were accepted (``record``); the
engine tells it when a request ends (``finish``).

It pays or it stays off. A step of R token rows costs ``step_cost(R)`` (relative to one row: at
few rows the weights' reading dominates, so extra rows are cheap until a kernel changes; the
table is measured, see ``STEP_COST``). Guess j (1-based) of a request is worth its acceptance
rate ``a`` to the power j (it counts only if the j - 1 before it were accepted). ``plan_step``
gives the step the R extra rows, best-valued guesses first, that maximise the expected tokens
per unit of cost, ``(n + sum of their values) / step_cost(n + R)`` for n decoding requests, and
none unless that beats ``n / step_cost(n)`` by ``MIN_GAIN``. So it guesses nothing:
- in a step with more than ``disable_by_batch_size`` running requests;
- in a step where a request prefills, waits or is swapped out: the scheduler does not ask
  (guesses would move a prompt's chunk boundaries, ``Scheduler._only_decoding``);
- for a request whose guesses are mostly rejected (its rate decays towards 0; after
  ``PROBE_INTERVAL`` steps without guesses it is reset to the prior, to notice text that turns
  repetitive);
- past ``row_limit`` rows when the step would stay within it without guesses: the small-step
  weight kernels (GGUF / AWQ / int8) compute each row alone, bit for bit, only up to their row
  limit, and beyond it a dense kernel rounds differently; kept within it, verifying a guess
  computes exactly what decoding it would have;
- for beam search, and for a request that opts out (``SamplingParams.speculative_decoding``).
No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.request import Request
from pagedllm.engine.speculative.ngram import NgramProposer
from pagedllm.engine.speculative.suffix import SuffixProposer

# The cost of a step of R rows (index R - 1) relative to one of a single row: the default model
# (SmolLM2-135M, GGUF Q4_1, bf16) on an AMD EPYC with AVX-512 BF16, whose BF16 tile kernels
# (csrc/bf16_tiles.h) run every step of up to 16 rows (8 rows per pass over a tile); the median of
# four runs of `python scripts/spec_step_cost.py --max-rows 16 --batches 1` (docs/speculative.md).
# Past the table each row adds what the last one did.
STEP_COST = (1.0, 1.13, 1.29, 1.35, 1.58, 1.78, 2.15, 2.26, 2.73, 3.01, 3.21, 3.27, 3.64, 3.78, 3.98, 4.28)
PRIOR_ACCEPTANCE = 0.7   # a request's acceptance rate before any guess of its own was verified
ACCEPTANCE_DECAY = 0.7   # weight of the past in the exponential average (per verified guess)
PROBE_INTERVAL = 16      # steps without guesses after which a request's rate returns to the prior
# guesses must promise this much more than the plain step's tokens per unit of cost: the table
# times the model's forward pass only, not the sampler's extra rows or the bookkeeping, and a rate
# is an estimate (at batch 4, guessing at break-even cost 2-8%: docs/speculative.md)
MIN_GAIN = 1.1


def step_cost(rows: int) -> float:
    if rows <= len(STEP_COST):
        return STEP_COST[max(rows, 1) - 1]
    last = STEP_COST[-1]
    return last + (rows - len(STEP_COST)) * (last - STEP_COST[-2])


def best_extra_rows(num_requests: int, values: Sequence[float], max_rows: int | None) -> int:
    """How many of ``values`` (the guesses' expected tokens, best first) to verify in a step of
    ``num_requests`` decoding requests: the count with the most expected tokens per unit of
    cost, 0 unless some count beats the plain step by ``MIN_GAIN``; at most ``max_rows`` rows in all."""
    plain = num_requests / step_cost(num_requests)
    best, best_rate = 0, plain * MIN_GAIN
    tokens = float(num_requests)
    for r, value in enumerate(values, start=1):
        if max_rows is not None and num_requests + r > max_rows:
            break
        tokens += value
        rate = tokens / step_cost(num_requests + r)
        if rate > best_rate:
            best, best_rate = r, rate
    return best


@dataclass
class SpecDecodeStats:
    """Counters since the engine started (vLLM's spec_decode metrics)."""

    num_drafts: int = 0           # verification chunks that carried at least one guess
    num_draft_tokens: int = 0     # guessed tokens verified
    num_accepted_tokens: int = 0  # of which the model agreed with
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at guess position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted guesses plus the model's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.acceptance_rate,
                "spec_decode_mean_accepted_length": self.mean_accepted_length}


@dataclass
class _RequestSpec:
    acceptance: float = PRIOR_ACCEPTANCE
    idle_steps: int = 0  # steps since its last guess


class Drafter:
    """Proposes each decoding request's guesses and learns from their verification."""

    def __init__(self, config: SpeculativeConfig, validate: Callable[[str, list[int]], int] | None = None,
                 row_limit: int | None = None) -> None:
        """``validate(request_id, guesses)``: how many leading guesses the request's constraints
        allow (structured output: the grammar's prefix); None: all. ``row_limit``: the rows up to
        which the step's weight kernels compute each row alone (None: no such limit kept)."""
        self.config = config
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                           config.suffix_decoding_max_cached_requests,
                                           config.suffix_decoding_max_spec_factor,
                                           config.suffix_decoding_min_token_prob)
        self.validate = validate
        self.row_limit = row_limit
        self.stats = SpecDecodeStats()
        self._requests: dict[str, _RequestSpec] = {}

    def may_guess(self, num_rows: int) -> bool:
        """Whether a step of ``num_rows`` running requests may guess at all (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_rows <= limit

    def plan_step(self, decoding: list[tuple[Request, int]], num_rows: int) -> dict[str, list[int]]:
        """The guesses of this step's decoding requests (``(request, limit)``: at most ``limit``
        guesses, what its max_tokens and max_model_len leave), by request id; only those that
        pay. ``num_rows``: the step's rows without guesses (its running requests)."""
        if not decoding or not self.may_guess(num_rows):
            return {}
        max_rows = self.row_limit if self.row_limit is not None and num_rows <= self.row_limit else None
        candidates: list[tuple[Request, int, _RequestSpec]] = []
        for req, most in decoding:
            most = min(most, self.config.num_speculative_tokens)
            if most <= 0 or req.external_tokens or not req.sampling_params.speculative_decoding:
                continue
            state = self._requests.get(req.request_id)
            if state is None:
                state = self._requests[req.request_id] = _RequestSpec()
            state.idle_steps += 1
            if state.idle_steps > PROBE_INTERVAL:
                state.acceptance = max(state.acceptance, PRIOR_ACCEPTANCE)
            candidates.append((req, most, state))
        # the proposers' lookups cost Python time every step: skip them when even full-length guesses
        # at every request's rate could not pay (the guesses' values can only be fewer)
        bound = sorted((state.acceptance ** j for _, most, state in candidates for j in range(1, most + 1)),
                       reverse=True)
        if not bound or best_extra_rows(len(decoding), bound, max_rows) == 0:
            return {}
        proposals: dict[str, list[int]] = {}
        values: list[tuple[float, int, str]] = []  # (expected tokens, position, request id)
        for req, most, state in candidates:
            guesses = self.proposer.propose(req.request_id, req.token_ids, most)
            if guesses and self.validate is not None:
                guesses = guesses[:self.validate(req.request_id, guesses)]
            if not guesses:
                continue
            proposals[req.request_id] = guesses
            value = 1.0
            for j in range(len(guesses)):
                value *= state.acceptance
                values.append((value, j, req.request_id))
        values.sort(key=lambda v: (-v[0], v[1]))
        chosen = values[:best_extra_rows(len(decoding), [v for v, _, _ in values], max_rows)]
        count: dict[str, int] = {}
        for _, _, rid in chosen:
            count[rid] = count.get(rid, 0) + 1
        for rid in count:
            self._requests[rid].idle_steps = 0
        return {rid: proposals[rid][:n] for rid, n in count.items()}

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verification: ``num_accepted`` of the ``num_drafted`` guesses were the model's tokens."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        per = stats.accepted_per_position
        per.extend([0] * (num_drafted - len(per)))
        for i in range(num_accepted):
            per[i] += 1
        state = self._requests.get(request_id)
        if state is not None:  # per guess tried: the accepted ones and the first rejected one
            rate = num_accepted / (num_accepted + (num_accepted < num_drafted))
            state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended: forget it (the suffix proposer keeps its output for later requests)."""
        self._requests.pop(request_id, None)
        self.proposer.finish(request_id, output_token_ids)

    def __len__(self) -> int:
        return len(self._requests)
