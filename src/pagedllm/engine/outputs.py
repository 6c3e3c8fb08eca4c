"""What generation returns: vLLM-shaped ``RequestOutput``, ``CompletionOutput`` and ``Logprob``.

Log-probabilities come as vLLM gives them: per generated token a ``dict[int, Logprob]`` holding the
chosen token and the top ``logprobs`` tokens (``SampleLogprobs``); per prompt token the same, with
``None`` for the first token, which has no context (``PromptLogprobs``). With
``RequestOutputKind.DELTA`` the ``text``, ``token_ids`` and ``logprobs`` of a ``CompletionOutput``
are only what is new since the request's previous output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence. ``finish_reason``: ``stop``, ``length``, ``abort``, ``error`` or None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's prompt and its completion(s), as of the latest step. ``error`` says why a request
    finished with ``finish_reason="error"``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
