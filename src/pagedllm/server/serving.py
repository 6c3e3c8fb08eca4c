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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request

from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams, logprobs_count
from pagedllm.engine.structured_output import GRAMMAR_REJECTED
from pagedllm.errors import InvalidRequest, require_utf8
from pagedllm.server.dashboard_state import dashboard_state
from pagedllm.server.errors import ENGINE_DEAD, OpenAIError, as_openai_error
from pagedllm.server.limits import ServerLimits
from pagedllm.server.metrics import ServerMetrics, engine_snapshot

STEP_FAILED = ("the engine step running this request failed, so it was not completed; other requests are "
               "unaffected and a retry may succeed (the cause is in the server's log)")


# the key under which the API-key middleware leaves a request's tenant salt in the ASGI scope's state
TENANT = "pagedllm_tenant"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    max_queue: int
    metrics: ServerMetrics
    api_keys: tuple[str, ...] = ()  # --api-key (each one a tenant); empty: no key required
    guard_metrics: bool = False  # --api-key guards /metrics too
    salt_per_key: bool = False  # --cache-salt-per-key: tenants never share prefix-cache blocks
    created: int = field(default_factory=lambda: int(time.time()))
    limits: ServerLimits = field(default_factory=ServerLimits)
    tool_call_parser: str = "hermes"  # --tool-call-parser: how tool_choice "auto" finds calls (server/tools.py)
    admitted: int = 0  # sequences (prompts x n) admitted and not yet ended; see ``admit``
    _admit_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def health_problem(self) -> str | None:
        """Why ``/health`` is 503, or None: here, an engine that has stopped (never the exception's
        text: it may quote a request's input)."""
        return None if self.engine.healthy else ENGINE_DEAD

    def check_model(self, name: str | None) -> None:
        if name is not None:
            try:
                require_utf8(name, "model")
            except InvalidRequest as exc:
                raise OpenAIError(400, str(exc), "model") from None
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                              "model", "model_not_found")

    def check_costs(self, req) -> None:
        """400 for per-request work past ``ServerLimits``: too many ``logit_bias`` entries, stop
        strings, or too long a stop string (each costs work on every step of the request)."""
        limits = self.limits
        if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias:
            raise OpenAIError(400, f"logit_bias has {len(req.logit_bias)} entries; at most {limits.max_logit_bias} "
                              "are accepted", "logit_bias")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > limits.max_stop:
            raise OpenAIError(400, f"stop has {len(stops)} strings; at most {limits.max_stop} are accepted", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_chars:
            raise OpenAIError(400, f"a stop string is {longest} characters long; at most {limits.max_stop_chars} "
                              "are accepted", "stop")

    def resolve_logprobs(self, req):
        """``req`` with its logprobs counts (``logprobs`` on completions, ``top_logprobs``,
        ``prompt_logprobs``) as the engine takes them (``logprobs_count``: -1 is the whole
        vocabulary; past ``--max-logprobs`` a 400 naming the field)."""
        engine = self.engine.engine
        changed = {}
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if value is None or isinstance(value, bool):  # chat's logprobs is a switch, not a count
                continue
            try:
                count = logprobs_count(name, value, engine.max_logprobs, engine.vocab_size)
            except InvalidRequest as exc:
                raise OpenAIError(400, str(exc), name) from None
            if count != value:
                changed[name] = count
        return req.model_copy(update=changed) if changed else req

    def cache_salt(self, requested: str | None, raw: Request) -> str | None:
        """The salt a request's blocks are hashed with: its ``cache_salt``, under its API key's
        tenant salt when ``salt_per_key`` (so no key's requests can hit, or time, another's cached
        prefixes, whatever salt they send)."""
        tenant = raw.scope.get("state", {}).get(TENANT) if self.salt_per_key else None
        if tenant is None:
            return requested
        return tenant if requested is None else f"{tenant}/{requested}"

    @property
    def max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes of prompt text worth tokenizing (``ServerLimits.max_prompt_bytes``,
        or derived: ``max_model_len`` x the vocabulary's longest token, in bytes)."""
        if self.limits.max_prompt_bytes is not None:
            return self.limits.max_prompt_bytes
        if self.tokenizer is None:
            return None
        return self.engine.engine.max_model_len * self.tokenizer.max_token_bytes  # cached

    def check_prompt_bytes(self, num_bytes: int, field: str) -> None:
        """400 ``context_length_exceeded`` for prompt text too long to fit, before tokenizing it."""
        limit = self.max_prompt_bytes
        if limit is not None and num_bytes > limit:
            max_len = self.engine.engine.max_model_len
            raise OpenAIError(400, f"{field} is {num_bytes} bytes of text, more than the {limit} that "
                              f"{max_len} tokens (max_model_len) can hold; it was not tokenized", field,
                              "context_length_exceeded")

    async def tokenize(self, text: str, field: str = "prompt", **kwargs) -> list[int]:
        """``text`` as token ids, checked for UTF-8 and size first, encoded on a worker thread
        (never the event loop, nor the engine thread between two steps)."""
        try:
            require_utf8(text, field)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), field) from None
        self.check_prompt_bytes(len(text.encode("utf-8")), field)
        return await asyncio.to_thread(self.tokenizer.encode, text, **kwargs)

    async def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> list[int]:
        """A conversation through the chat template, size-checked first, on a worker thread."""
        self.check_prompt_bytes(sum(len(m["content"].encode("utf-8")) + len(m["role"].encode("utf-8"))
                                    for m in messages) + len(json.dumps(kwargs.get("tools") or [])), "messages")
        return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, **kwargs)

    @property
    def capacity(self) -> int:
        """Most sequences admitted at once: a full batch running plus ``max_queue`` waiting."""
        return self.engine.engine.max_num_seqs + self.max_queue

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

    async def render_metrics(self) -> bytes:
        """``/metrics``: the engine's state read between two steps, and the request metrics."""
        engine = self.engine.engine
        snapshot = await asyncio.wrap_future(self.engine.call(lambda: engine_snapshot(engine)))
        return self.metrics.render(snapshot)

    async def dashboard_state(self) -> dict:
        """``/dashboard/state``: the KV pool, queues and counters at one engine step."""
        engine = self.engine.engine
        return await asyncio.wrap_future(self.engine.call(lambda: dashboard_state(engine, self.metrics)))

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
    if getattr(params, "structured_outputs", None) is None:  # BeamSearchParams have none
        return
    try:
        await asyncio.to_thread(ctx.engine.engine.compile_grammar, params.structured_outputs)
    except (InvalidRequest, ValueError) as e:
        message = str(e)
        for old, new in _CONSTRAINT_NAMES.get(field, ()):
            message = message.replace(old, new)
        raise OpenAIError(400, message, field, "invalid_response_format") from None


async def add_prompts(ctx: ServerContext, prompts: list, params: SamplingParams,
                      request_id: str, constraint_field: str = "response_format",
                      truncate: Callable[[list[int]], list[int]] | None = None,
                      prompt_param: Callable[[int], str] | None = None) -> list[RequestStream]:
    """Admit (``ServerContext.admit``), validate and queue one engine request per prompt: all of
    them, or none (the first error is raised, e.g. ``InvalidRequest`` -> 400, before any response
    starts). Each stream gives its ``n`` sequences back to the admission count when it ends.
    ``truncate`` cuts each tokenized prompt (``truncate_prompt_tokens``); a cut text prompt is then
    its token ids only, so an echo gives back what the model saw. ``prompt_param(i)`` names the
    field of prompt i in an error about it (the batch chat route's ``messages.i``)."""
    width = params.n if isinstance(params, SamplingParams) else params.beam_width  # BeamSearchParams: beams
    admission = ctx.admit(len(prompts) * width)
    streams: list[RequestStream] = []
    try:
        prompts = [await _tokenized(ctx, p) for p in prompts]
        if truncate is not None:
            prompts = [_truncated(p, truncate) for p in prompts]
        await compile_constraint(ctx, params, constraint_field)
        for i, p in enumerate(prompts):
            try:
                stream = await ctx.engine.add_request(f"{request_id}-{i}", p, params)
            except InvalidRequest as exc:
                if prompt_param is None:
                    raise
                error = as_openai_error(exc)
                raise OpenAIError(error.status, f"{prompt_param(i)}: {error.message}", prompt_param(i),
                                  error.code) from None
            stream.on_done(lambda: admission.release(width))
            streams.append(stream)
    except BaseException:
        for stream in streams:
            stream.close()
        admission.release()
        raise
    return streams


def _truncated(prompt, truncate: Callable[[list[int]], list[int]]):
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    ids = prompt.get("prompt_token_ids")
    if ids is None:
        return prompt
    cut = truncate(list(ids))
    if len(cut) == len(ids):
        return prompt
    return {k: v for k, v in prompt.items() if k != "prompt"} | {"prompt_token_ids": cut}


def prompt_logprobs_body(entries) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}``, the prompt's own token first, then the top ones."""
    if entries is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token}
                                        for t, lp in entry.items()} for entry in entries]


async def _tokenized(ctx: ServerContext, prompt):
    """A text prompt (alone or in a prompt dict) with its token ids added, so the engine thread
    never tokenizes: the text is size-checked first and encoded on a worker thread."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif not isinstance(prompt, dict) or "prompt_token_ids" in prompt:
        return prompt
    text = prompt.get("prompt")
    if not isinstance(text, str) or ctx.tokenizer is None:
        return prompt
    return {**prompt, "prompt_token_ids": await ctx.tokenize(text)}


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
                # the cause (an internal exception's text) is in the server's log, never the reply
                raise OpenAIError(500, STEP_FAILED, code="engine_step_failed")
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

    def body(self, completion_tokens: int | None = None) -> dict:
        """The usage object; ``completion_tokens`` in place of the count so far (a stream's first
        chunk, sent before its tokens, counts none of them)."""
        done = self.completion_tokens if completion_tokens is None else completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
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
