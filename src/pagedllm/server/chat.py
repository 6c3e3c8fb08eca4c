"""``POST /v1/chat/completions``: messages through the model's chat template -> OpenAI chat
completion objects, streamed as ``chat.completion.chunk`` SSE events or returned whole. A stream
starts each choice with a ``{"role": "assistant"}`` delta, then content deltas; the finish reason
rides on the last one. ``logprobs`` + ``top_logprobs`` give OpenAI's per-token ``content`` list."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.outputs import CompletionOutput, Logprob
from pagedllm.server.errors import OpenAIError, error_chunk
from pagedllm.server.protocol import BatchChatCompletionRequest, ChatCompletionRequest
from pagedllm.server.serving import (
    ServerContext,
    Usage,
    add_prompts,
    logprob_token,
    merge,
    new_id,
    prompt_logprobs_body,
    sse,
    unless_disconnected,
)
from pagedllm.server.tools import ToolPlan, ToolStream, history_for


async def chat_prompt_ids(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    """The conversation through the chat template (with the tools, ``server/tools.py``; without,
    a history's calls and results as the template can show them, ``history_for``), as token
    ids (400 if the model has none), sized and rendered off the event loop
    (``ServerContext.apply_chat_template``)."""
    if ctx.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer, so no chat template; use /v1/completions", "messages")
    try:
        messages, kwargs = req.conversation(), req.template_kwargs()
        if plan is not None:
            messages, tools = plan.render(ctx.tokenizer, messages)
            kwargs |= tools
        else:
            messages = history_for(ctx.tokenizer, messages)
        return await ctx.apply_chat_template(messages, **kwargs)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "messages") from None


def _entry(token_id: int, lp: Logprob, as_id: bool) -> dict:
    token = f"token_id:{token_id}" if as_id else logprob_token(lp)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, top: int, as_ids: bool = False) -> list[dict]:
    """OpenAI's ``logprobs.content`` entries for a completion's (new) tokens; ``as_ids``: vLLM's
    ``return_tokens_as_token_ids`` (each token written ``token_id:<id>``)."""
    content = []
    for token, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        item = _entry(token, entry[token], as_ids)
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda e: e[1].rank)
        item["top_logprobs"] = [_entry(t, lp, as_ids) for t, lp in ranked[:top]]
        content.append(item)
    return content


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    outputs, head, top, plan = await start_chat(ctx, req, raw)
    if req.stream:
        return StreamingResponse(_stream(req, outputs, {**head, "object": "chat.completion.chunk"}, top, plan),
                                 media_type="text/event-stream")
    return await unless_disconnected(raw, collect_chat(req, outputs, head, top, plan))


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, raw: Request, request_id: str | None = None):
    """Validate, render and queue a chat request: (its merged outputs, the response head, the
    top-logprobs count, its ``ToolPlan`` or None). Shared with ``/v1/responses``."""
    ctx.check_model(req.model)
    ctx.check_costs(req)
    req = ctx.resolve_logprobs(req)
    plan = ToolPlan.of(req, ctx.tool_call_parser)  # a bad tool_choice: InvalidRequest, a 400
    prompt_ids = req.truncated(await chat_prompt_ids(ctx, req, plan), ctx.engine.engine.max_model_len)
    params, top = _chat_params(ctx, req, plan)
    request_id = request_id or new_id("chatcmpl")
    prompt = {"prompt_token_ids": prompt_ids, **_salt(ctx, req, raw)}
    outputs = merge(await add_prompts(ctx, [prompt], params, request_id, req.constraint_field), req.constraint_field)
    return outputs, _head(ctx, request_id), top, plan


def _head(ctx: ServerContext, request_id: str) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model_name}


def _chat_params(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan | None):
    """(the engine's sampling or beam-search params for ``req``, its top-logprobs count)."""
    limit = ctx.engine.engine.max_model_len
    # the top-logprobs count; with logprob_token_ids, those tokens and the chosen one (ranked)
    top = len(req.logprob_token_ids) + 1 if req.logprob_token_ids else req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.max_tokens is not None and req.max_tokens >= limit:  # checked even when max_completion_tokens rules
        raise OpenAIError(400, f"max_tokens ({req.max_tokens}) must be below max_model_len ({limit})", "max_tokens",
                          "context_length_exceeded")
    if max_tokens is None:  # --default-chat-max-tokens, else the rest of the context
        max_tokens = ctx.limits.default_chat_max_tokens
    if req.use_beam_search:
        return req.beam_search_params(max_tokens), top
    params = req.sampling_params(max_tokens, top if req.logprobs else None, prompt_logprobs=req.prompt_logprobs)
    if plan is not None and plan.constraint() is not None:  # tool_choice required or named: the calls are made
        params = dataclasses.replace(params, structured_outputs=plan.constraint())
    return params, top


async def create_batch_chat_completion(ctx: ServerContext, batch: BatchChatCompletionRequest, raw: Request) -> dict:
    """vLLM's ``POST /v1/chat/completions/batch``: every conversation rendered (a 400 names the
    one that fails, or cannot fit, ``messages.i``) and queued together, or none; one body, choice i answering
    conversation i, each as ``/v1/chat/completions`` would alone."""
    ctx.check_model(batch.model)
    ctx.check_costs(batch)
    batch = ctx.resolve_logprobs(batch)
    requests = batch.conversations()
    limit = ctx.engine.engine.max_model_len
    salt = _salt(ctx, batch, raw)
    prompts = []
    for i, req in enumerate(requests):
        try:
            prompts.append({"prompt_token_ids": req.truncated(await chat_prompt_ids(ctx, req), limit), **salt})
        except OpenAIError as exc:
            raise OpenAIError(exc.status, f"messages.{i}: {exc.message}", f"messages.{i}", exc.code) from None
    params, top = _chat_params(ctx, batch, None)
    request_id = new_id("chatcmpl")
    outputs = merge(await add_prompts(ctx, prompts, params, request_id, batch.constraint_field,
                                      prompt_param=lambda i: f"messages.{i}"), batch.constraint_field)
    return await unless_disconnected(raw, _collect_batch(requests, outputs, _head(ctx, request_id), top))


def _salt(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> dict:
    salt = ctx.cache_salt(req.cache_salt, raw)
    return {"cache_salt": salt} if salt is not None else {}


def _prompt_extras(req: ChatCompletionRequest, out) -> dict:
    """vLLM's response-level ``prompt_token_ids`` / ``prompt_logprobs``, where asked for."""
    extras = {}
    if req.return_token_ids:
        extras["prompt_token_ids"] = list(out.prompt_token_ids)
    if req.prompt_logprobs is not None:
        extras["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)
    return extras


def _message(text: str, plan: ToolPlan | None, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice (its tool calls split out) and its finish reason."""
    if plan is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = plan.split(text)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls" if reason == "stop" else reason


class _Choices:
    """What a whole chat body's choices gather from the outputs, keyed by (prompt index, choice
    index): text (after the request's ``echo``), token ids, logprobs, finish reasons, the usage,
    and each prompt's first output (its prompt token ids and logprobs)."""

    def __init__(self, requests: list[ChatCompletionRequest], top: int) -> None:
        self.requests, self.top = requests, top
        self.texts: dict[tuple[int, int], str] = {}
        self.token_ids: dict[tuple[int, int], list[int]] = {}
        self.logprobs: dict[tuple[int, int], list] = {}
        self.finish: dict[tuple[int, int], tuple] = {}
        self.first: dict[int, object] = {}
        self.usage = Usage()

    async def gather(self, outputs) -> _Choices:
        async for i, out in outputs:
            req = self.requests[i]
            self.usage.add(out, i not in self.first)
            self.first.setdefault(i, out)
            for c in out.outputs:
                key = (i, c.index)
                self.texts[key] = self.texts.get(key, req.echoed()) + c.text
                self.token_ids.setdefault(key, []).extend(c.token_ids)
                if req.logprobs:
                    self.logprobs.setdefault(key, []).extend(chat_logprobs(c, self.top, req.return_tokens_as_token_ids))
                if c.finish_reason is not None:
                    self.finish[key] = (c.finish_reason, c.stop_reason)
        return self

    def choice(self, key: tuple[int, int], index: int, plan: ToolPlan | None) -> dict:
        req = self.requests[key[0]]
        reason, stop_reason = self.finish.get(key, (None, None))
        message, reason = _message(self.texts[key], plan, reason)
        return {"index": index, "message": message,
                "logprobs": {"content": self.logprobs.get(key, [])} if req.logprobs else None,
                "finish_reason": reason, "stop_reason": stop_reason,
                "token_ids": self.token_ids[key] if req.return_token_ids else None}


async def collect_chat(req: ChatCompletionRequest, outputs, head: dict, top: int, plan: ToolPlan | None) -> dict:
    """The whole chat completion body, once every choice has finished (shared with /v1/responses)."""
    got = await _Choices([req], top).gather(outputs)
    extras = {"prompt_token_ids": None, "prompt_logprobs": None}  # vLLM's keys, null unless asked for
    if 0 in got.first:
        extras |= _prompt_extras(req, got.first[0])
    choices = [got.choice(key, key[1], plan) for key in sorted(got.texts)]
    return {**head, "choices": choices, "usage": got.usage.body(), **extras}


async def _collect_batch(requests: list[ChatCompletionRequest], outputs, head: dict, top: int) -> dict:
    """The batch body: choice i for conversation i; with ``return_token_ids``, each choice also
    carries its conversation's ``prompt_token_ids`` (one body, N prompts)."""
    got = await _Choices(requests, top).gather(outputs)
    choices = []
    for i, req in enumerate(requests):
        choice = got.choice((i, 0), i, None)
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(got.first[i].prompt_token_ids)
        choices.append(choice)
    return {**head, "choices": choices, "usage": got.usage.body(), "prompt_token_ids": None, "prompt_logprobs": None}


async def _stream(req: ChatCompletionRequest, outputs, head: dict, top: int,
                  plan: ToolPlan | None) -> AsyncIterator[str]:
    usage = Usage()
    started: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}
    first = True
    try:
        async for _, out in outputs:
            counted = usage.completion_tokens
            usage.add(out, first)
            extras = _prompt_extras(req, out) if first else {}  # the first chunk only, as vLLM
            first = False
            for c in out.outputs:
                if c.index not in started:
                    started.add(c.index)
                    if req.continuous_usage:  # every chunk, this one too: the tokens before this output
                        extras["usage"] = usage.body(completion_tokens=counted)
                    yield sse({**head, "choices": [{"index": c.index,
                                                    "delta": {"role": "assistant", "content": req.echoed()},
                                                    "logprobs": None, "finish_reason": None}], **extras})
                    extras = {}
                text, calls, reason = c.text, [], c.finish_reason
                if plan is not None:  # content as it comes, until a call may start (server/tools.py)
                    split = tool_streams.setdefault(c.index, ToolStream(plan))
                    text = split.feed(c.text)
                    calls = split.call_deltas()
                    if c.finish_reason is not None:
                        rest, more = split.finish()
                        text, calls = text + rest, calls + more
                        reason = "tool_calls" if split.calls and reason == "stop" else reason
                if not text and not calls and c.finish_reason is None and not c.token_ids:
                    continue
                delta = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = calls
                chunk = {"index": c.index, "delta": delta,
                         "logprobs": {"content": chat_logprobs(c, top, req.return_tokens_as_token_ids)} if req.logprobs
                         else None,
                         "finish_reason": reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    chunk["token_ids"] = list(c.token_ids)
                usage_now = {"usage": usage.body()} if req.continuous_usage else {}
                yield sse({**head, "choices": [chunk], **usage_now})
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage.body()})
        yield sse("[DONE]")
    except Exception as exc:  # noqa: BLE001 - after the stream started: an error chunk, then [DONE]
        yield error_chunk(exc)
        yield sse("[DONE]")
    finally:
        await outputs.aclose()
