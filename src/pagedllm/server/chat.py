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
from pagedllm.server.protocol import ChatCompletionRequest
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
from pagedllm.server.tools import ToolPlan, ToolStream


async def chat_prompt_ids(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    """The conversation through the chat template (with the tools, ``server/tools.py``), as token
    ids (400 if the model has none), sized and rendered off the event loop
    (``ServerContext.apply_chat_template``)."""
    if ctx.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer, so no chat template; use /v1/completions", "messages")
    try:
        messages, kwargs = req.conversation(), req.template_kwargs()
        if plan is not None:
            messages, tools = plan.render(ctx.tokenizer, messages)
            kwargs |= tools
        return await ctx.apply_chat_template(messages, **kwargs)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "messages") from None


def _entry(lp: Logprob) -> dict:
    token = logprob_token(lp)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, top: int) -> list[dict]:
    """OpenAI's ``logprobs.content`` entries for a completion's (new) tokens."""
    content = []
    for token, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        item = _entry(entry[token])
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        item["top_logprobs"] = [_entry(lp) for lp in ranked[:top]]
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
    limit = ctx.engine.engine.config.scheduler.max_model_len
    plan = ToolPlan.of(req, ctx.tool_call_parser)  # a bad tool_choice: InvalidRequest, a 400
    prompt_ids = req.truncated(await chat_prompt_ids(ctx, req, plan), limit)
    top = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.max_tokens is not None and req.max_tokens >= limit:  # checked even when max_completion_tokens rules
        raise OpenAIError(400, f"max_tokens ({req.max_tokens}) must be below max_model_len ({limit})", "max_tokens",
                          "context_length_exceeded")
    if max_tokens is None:  # --default-chat-max-tokens, else the rest of the context
        max_tokens = ctx.limits.default_chat_max_tokens
    if req.use_beam_search:
        params = req.beam_search_params(max_tokens)
    else:
        params = req.sampling_params(max_tokens, top if req.logprobs else None, prompt_logprobs=req.prompt_logprobs)
        if plan is not None and plan.constraint() is not None:  # tool_choice required or named: the calls are made
            params = dataclasses.replace(params, structured_outputs=plan.constraint())
    request_id = request_id or new_id("chatcmpl")
    prompt = {"prompt_token_ids": prompt_ids, **_salt(ctx, req, raw)}
    outputs = merge(await add_prompts(ctx, [prompt], params, request_id, req.constraint_field), req.constraint_field)
    head = {"id": request_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model_name}
    return outputs, head, top, plan


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


async def collect_chat(req: ChatCompletionRequest, outputs, head: dict, top: int, plan: ToolPlan | None) -> dict:
    """The whole chat completion body, once every choice has finished (shared with /v1/responses)."""
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    finish: dict[int, tuple] = {}
    usage = Usage()
    first = True
    extras = {"prompt_token_ids": None, "prompt_logprobs": None}  # vLLM's keys, null unless asked for
    async for _, out in outputs:
        usage.add(out, first)
        if first:
            extras |= _prompt_extras(req, out)
        first = False
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, req.echoed()) + c.text
            token_ids.setdefault(c.index, []).extend(c.token_ids)
            if req.logprobs:
                logprobs.setdefault(c.index, []).extend(chat_logprobs(c, top))
            if c.finish_reason is not None:
                finish[c.index] = (c.finish_reason, c.stop_reason)
    choices = []
    for k in sorted(texts):
        reason, stop_reason = finish.get(k, (None, None))
        message, reason = _message(texts[k], plan, reason)
        choices.append({"index": k, "message": message,
                        "logprobs": {"content": logprobs.get(k, [])} if req.logprobs else None,
                        "finish_reason": reason, "stop_reason": stop_reason,
                        "token_ids": token_ids[k] if req.return_token_ids else None})
    return {**head, "choices": choices, "usage": usage.body(), **extras}


async def _stream(req: ChatCompletionRequest, outputs, head: dict, top: int,
                  plan: ToolPlan | None) -> AsyncIterator[str]:
    usage = Usage()
    started: set[int] = set()
    tool_streams: dict[int, ToolStream] = {}
    first = True
    try:
        async for _, out in outputs:
            usage.add(out, first)
            extras = _prompt_extras(req, out) if first else {}  # the first chunk only, as vLLM
            first = False
            for c in out.outputs:
                if c.index not in started:
                    started.add(c.index)
                    yield sse({**head, "choices": [{"index": c.index,
                                                    "delta": {"role": "assistant", "content": req.echoed()},
                                                    "logprobs": None, "finish_reason": None}], **extras})
                    extras = {}
                text, calls, reason = c.text, [], c.finish_reason
                if plan is not None:  # content as it comes, until a call may start; calls at the end
                    split = tool_streams.setdefault(c.index, ToolStream(plan))
                    text = split.feed(c.text)
                    if c.finish_reason is not None:
                        rest, calls = split.finish()
                        text += rest
                        reason = "tool_calls" if calls and reason == "stop" else reason
                if not text and c.finish_reason is None and not c.token_ids:
                    continue
                delta = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
                chunk = {"index": c.index, "delta": delta,
                         "logprobs": {"content": chat_logprobs(c, top)} if req.logprobs else None,
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
