"""What both OpenAI routes share: the server's context, admission checks, running several prompts
as engine requests with their deltas merged, usage, SSE framing and client disconnects.

``ServerContext`` is built once per server and holds the ``AsyncEngine``, the tokenizer, the
served model name, the queue limit and the metrics. ``add_prompts`` turns one HTTP request into
one engine request per prompt (validating them all first) and ``merge`` yields
``(prompt index, delta output)`` as they come; closing it (the client hung up, the handler was
cancelled) aborts every engine request still running, so their blocks are freed within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.structured_output import GRAMMAR_REJECTED
from pagedllm.errors import InvalidRequest
from pagedllm.server.errors import OpenAIError
from pagedllm.server.metrics import ServerMetrics


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    max_queue: int
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    admitted: int = 0  # sequences (prompts x n) admitted and not yet ended; see ``admit``
    _admit_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                              "model", "model_not_found")

    @property
    def capacity(self) -> int:
        """Most sequences admitted at once: a full batch running plus ``max_queue`` waiting."""
        return self.engine.engine.config.scheduler.max_num_seqs + self.max_queue

    def admit(self, num_seqs: int) -> Admission:
        """Admit a request of ``num_seqs`` sequences (prompts x ``n``) or refuse it: 429 with
        ``Retry-After`` when the admitted ones would exceed ``capacity``, 400 when the request alone
        does (no retry could succeed). Checked and counted in one step under a lock, so concurrent
        requests cannot all pass one check; the count falls as each stream ends (``Admission``)."""
        if not self.engine.healthy:
            raise OpenAIError(503, "the engine is not running", code="engine_dead")
        if num_seqs > self.capacity:
            raise OpenAIError(400, f"this request asks for {num_seqs} sequences (prompts x n), more than the "
                              f"{self.capacity} this server admits at once", "n")
        with self._admit_lock:
            if self.admitted + num_seqs > self.capacity:
                raise OpenAIError(429, f"the server is busy: {self.admitted} sequences admitted, at most "
                                  f"{self.capacity}; retry later", code="queue_full", headers={"Retry-After": "1"})
            self.admitted += num_seqs
        return Admission(self, num_seqs)

    def _release(self, num_seqs: int) -> None:
        with self._admit_lock:
            self.admitted -= num_seqs


class Admission:
    """The sequences one request was admitted with; each ``release`` gives some back, never more
    than were admitted (so a stream that ends twice, or an error path after it, cannot undercount)."""

    def __init__(self, ctx: ServerContext, num_seqs: int) -> None:
        self.ctx, self.remaining = ctx, num_seqs
        self._lock = threading.Lock()

    def release(self, num_seqs: int | None = None) -> None:
        with self._lock:
            k = self.remaining if num_seqs is None else min(num_seqs, self.remaining)
            self.remaining -= k
        if k:
            self.ctx._release(k)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_CONSTRAINT_NAMES = {"response_format": (("structured_outputs.json_object", "response_format"),
                                          ("structured_outputs.json", "response_format.json_schema.schema"))}


async def compile_constraint(ctx: ServerContext, params: SamplingParams, field: str) -> None:
    """Compile a structured-output constraint on a worker thread (within the engine's time limit),
    so the engine thread finds it compiled and never stalls the batch on it; a bad schema, regex or
    grammar is a 400 naming ``field`` (``response_format`` or ``structured_outputs``)."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(ctx.engine.engine.structured.compile, params.structured_outputs)
    except (InvalidRequest, ValueError) as e:
        message = str(e)
        for old, new in _CONSTRAINT_NAMES.get(field, ()):
            message = message.replace(old, new)
        raise OpenAIError(400, message, field, "invalid_response_format") from None


async def add_prompts(ctx: ServerContext, prompts: list, params: SamplingParams,
                      request_id: str, constraint_field: str = "response_format") -> list[RequestStream]:
    """Admit (``ServerContext.admit``), validate and queue one engine request per prompt: all of
    them, or none (the first error is raised, e.g. ``InvalidRequest`` -> 400, before any response
    starts). Each stream gives its ``n`` sequences back to the admission count when it ends."""
    admission = ctx.admit(len(prompts) * params.n)
    streams: list[RequestStream] = []
    try:
        await compile_constraint(ctx, params, constraint_field)
        for i, p in enumerate(prompts):
            stream = await ctx.engine.add_request(f"{request_id}-{i}", p, params)
            stream.on_done(lambda: admission.release(params.n))
            streams.append(stream)
    except BaseException:
        for stream in streams:
            stream.close()
        admission.release()
        raise
    return streams


async def merge(streams: list[RequestStream],
                constraint_field: str = "response_format") -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from every stream, in arrival order, until all have finished.
    A failed engine step raises ``OpenAIError(500)``. Closing it early aborts what still runs."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            if item.error is not None:
                if item.error.startswith(GRAMMAR_REJECTED):  # the request's constraint, not the server
                    raise OpenAIError(400, f"{item.error.splitlines()[0]} (the constraint cannot be met with "
                                      "this model's tokens)", constraint_field, "invalid_response_format")
                raise OpenAIError(500, item.error, code="engine_step_failed")
            yield i, item
    finally:
        for stream in streams:
            stream.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput, first: bool) -> None:
        if first:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable):
    """Await ``work``, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


def logprob_token(lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""
