"""Request: the scheduler's view of one sequence being generated.

Holds token ids (prompt then output), how many of them are already in the KV cache
(``num_computed_tokens``), status and timestamps. No torch, no text: detokenization lives in the
engine's output processor.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its step failed (see Engine.step); its blocks were freed

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """One sequence: prompt + generated tokens, and its progress through the KV cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    sampling_seed: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when it was first admitted to the running set
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # parallel sampling (n > 1): siblings that fork from this request when its prompt is computed
    pending_forks: list[Request] = field(default_factory=list)
    parent_id: str | None = None
    # beam search: the next token is chosen by the beam group from the logprobs, not by the sampler
    external_tokens: bool = False
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # tokenized SamplingParams.bad_words
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    @property
    def use_prefix_cache(self) -> bool:
        """False for requests that need logits at every prompt position (``prompt_logprobs``)."""
        return self.sampling_params.prompt_logprobs is None

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Finish status implied by the last generated token, or None to keep going. EOS and stop
        token ids never end a request with fewer than ``min_tokens`` output tokens."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens and (
                (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
