"""The one interface between the engine's step and a user request, whatever its kind.

``RequestState`` (a sampled request: one sequence, or n for parallel sampling) and ``BeamGroup``
(a beam search: a changing set of beams) both implement ``RequestOwner``, so the step, aborts and
failures never ask which kind they hold. An owner is told what a model step produced for its
scheduler requests (``take_prompt_logprobs``, ``take_token`` for a sampled token, ``take_logprobs``
for every row's logprobs), then ``end_step`` lets it act on them and owe its caller an output.

The engine is the ``OwnerHost``: what an owner may touch (the scheduler, the structured-output
manager, the tokenizer) and three calls: ``release(rid)`` (a scheduler request of the owner left:
free its runner and grammar state), ``adopt(rid, owner)`` (a new scheduler request belongs to the
owner) and ``retire(owner)`` (the user request is over; it owes nothing more).
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.models.tokenizer import Tokenizer


class OwnerHost(Protocol):
    scheduler: Scheduler
    structured: StructuredOutputManager
    tokenizer: Tokenizer | None

    def release(self, request_id: str) -> None: ...
    def adopt(self, request_id: str, owner: RequestOwner) -> None: ...
    def retire(self, owner: RequestOwner) -> None: ...


class RequestOwner(Protocol):
    request_id: str
    steps_always: bool  # ``end_step`` after every step, not only those that gave it a token

    def live_ids(self) -> list[str]:
        """Its scheduler requests that have not finished."""

    def take_prompt_logprobs(self, entries: list[tuple[int, TokenLogprobs]], tokenizer: Tokenizer | None) -> None: ...

    def take_token(self, host: OwnerHost, request: Request, logprobs: TokenLogprobs | None) -> None:
        """``request`` (one of its) got a sampled token this step, with its logprobs if asked for."""

    def take_logprobs(self, request_id: str, logprobs: TokenLogprobs) -> None:
        """The logprobs of a row of its, whether or not the scheduler appended a token."""

    def end_step(self, host: OwnerHost, outputs: list[RequestOutput]) -> None:
        """Act on what this step gave it; append the output it owes its caller now, if any."""

    def abort(self, host: OwnerHost) -> None:
        """Finish every live scheduler request (aborted) and release it."""

    def fail(self, host: OwnerHost, message: str, outputs: list[RequestOutput]) -> None:
        """Finish every live scheduler request with an error, release it, and append its last output."""
