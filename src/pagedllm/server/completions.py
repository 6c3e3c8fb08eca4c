"""``POST /v1/completions``: prompts (text, token ids, or lists of either) -> OpenAI completion
objects, streamed as SSE chunks or returned whole. Choice ``k`` of a request with several prompts
is prompt ``k // n``, sample ``k % n``; ``echo`` puts the prompt in front of the text (and, with
``logprobs``, its log-probabilities in front of the generated ones: each prompt token's string is
its part of the echoed text, the first one's log-probability null, so ``text_offset`` indexes the
text; an echoed token-id prompt keeps its special tokens in both, as vLLM's)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.server.errors import error_chunk
from pagedllm.server.protocol import CompletionRequest
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


class _Choice:
    """Accumulates one choice's text, tokens and legacy-format logprobs."""

    def __init__(self, tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>" for each token
        self.text, self.finish_reason, self.stop_reason = "", None, None
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.offset = 0
        self.prompt_token_ids: list[int] | None = None  # return_token_ids
        self.token_ids: list[int] = []
        self.prompt_logprobs: list | None = None        # prompt_logprobs

    def add_logprobs(self, entries: list[dict[int, Logprob] | None], token_ids: list[int],
                     texts: list[str] | None = None, top: int | None = None) -> dict:
        """Append legacy logprobs for these tokens (``texts``: each token's string, where the
        caller has them; else the entry's decoded token; ``top``: keep only the top that many
        besides the token itself, where the entries hold more); returns just the new part."""
        new = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        def name(token: int, lp: Logprob | None) -> str:
            return f"token_id:{token}" if self.tokens_as_ids else logprob_token(lp) if lp is not None else ""

        for i, (token, entry) in enumerate(zip(token_ids, entries, strict=True)):
            text = texts[i] if texts is not None else logprob_token(entry[token]) if entry else ""
            new["tokens"].append(name(token, None) if self.tokens_as_ids else text)
            new["token_logprobs"].append(entry[token].logprob if entry else None)
            kept = entry and {t: lp for t, lp in entry.items()
                              if top is None or t == token or (lp.rank is not None and lp.rank <= top)}
            new["top_logprobs"].append({name(t, lp): lp.logprob for t, lp in kept.items()} if entry else None)
            new["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in new.items():
            getattr(self, key).extend(values)
        return new

    def logprobs_body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def prompt_token_texts(tokenizer, prompt_ids: list[int]) -> list[str]:
    """Each prompt token's part of the detokenized prompt, special tokens included (as vLLM echoes
    them): joined they are the prompt's text, so ``text_offset`` indexes the echoed text. A
    character split over several tokens belongs to the token that completes it (the others: "")."""
    stream = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=False)
    return [stream.add(t) for t in prompt_ids]


def _echo(ctx: ServerContext, out: RequestOutput) -> tuple[str, list[str] | None]:
    """The echoed prompt text, and each prompt token's string in it (None without a tokenizer).
    A text prompt is echoed as sent; token ids as their detokenized text, special tokens kept."""
    texts = prompt_token_texts(ctx.tokenizer, out.prompt_token_ids) if ctx.tokenizer is not None else None
    if out.prompt is not None:
        return out.prompt, texts
    return ("".join(texts) if texts is not None else ""), texts


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request):
    ctx.check_model(req.model)
    ctx.check_costs(req)
    req = ctx.resolve_logprobs(req)
    prompts = req.prompts()  # never empty: the model takes no empty prompt or list
    salt = ctx.cache_salt(req.cache_salt, raw)
    if salt is not None:
        prompts = [{"prompt" if isinstance(p, str) else "prompt_token_ids": p, "cache_salt": salt} for p in prompts]
    want_logprobs = req.logprobs is not None
    # the prompt's logprobs: for an echo with logprobs, and vLLM's prompt_logprobs (the larger count)
    wanted = [k for k in (req.logprobs if req.echo and want_logprobs else None, req.prompt_logprobs) if k is not None]
    if req.use_beam_search:
        params = req.beam_search_params(req.max_tokens)
    else:
        params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs=max(wanted) if wanted else None)
    request_id = new_id("cmpl")
    field = req.constraint_field
    limit = ctx.engine.engine.max_model_len
    streams = await add_prompts(ctx, prompts, params, request_id, field,
                                truncate=lambda ids: req.truncated(ids, limit))  # bad: 400
    outputs = merge(streams, field)
    head = {"id": request_id, "object": "text_completion", "created": ctx.created, "model": ctx.model_name}
    if req.stream:
        return StreamingResponse(_stream(ctx, req, outputs, head, want_logprobs), media_type="text/event-stream")
    return await unless_disconnected(raw, _collect(ctx, req, outputs, head, want_logprobs))


def _start(ctx: ServerContext, req: CompletionRequest, choice: _Choice, out: RequestOutput, want: bool) -> tuple:
    """Echoed prompt text (and prompt logprobs) for a choice's first delta."""
    text, logprobs = "", None
    if req.return_token_ids:
        choice.prompt_token_ids = list(out.prompt_token_ids)
    if req.prompt_logprobs is not None:
        choice.prompt_logprobs = _top(out.prompt_logprobs, req.prompt_logprobs)
    if req.echo:
        text, token_texts = _echo(ctx, out)
        if want and out.prompt_logprobs is not None:
            logprobs = choice.add_logprobs(out.prompt_logprobs, out.prompt_token_ids, token_texts, req.logprobs)
    return text, logprobs


def _top(entries, top: int) -> list | None:
    """vLLM's ``prompt_logprobs`` body with the top ``top`` besides each prompt token (the engine
    computed the larger of this and an echo's ``logprobs``)."""
    if entries is None:
        return None
    return prompt_logprobs_body([None if e is None else {t: lp for i, (t, lp) in enumerate(e.items())
                                                         if i == 0 or (lp.rank is not None and lp.rank <= top)}
                                 for e in entries])


def _delta(ctx, req, choice: _Choice, out: RequestOutput, c: CompletionOutput, started: bool, want: bool):
    text, logprobs = ("", None) if started else _start(ctx, req, choice, out, want)
    text += c.text
    choice.text += text
    choice.token_ids += c.token_ids
    if want and c.logprobs is not None:
        new = choice.add_logprobs(c.logprobs, c.token_ids)
        if logprobs is None:
            logprobs = new
        else:
            for key in logprobs:
                logprobs[key] = logprobs[key] + new[key]
    if c.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    return text, logprobs


class _Choices:
    """Every choice of a request, fed with (prompt index, delta output) pairs."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, want_logprobs: bool) -> None:
        self.ctx, self.req, self.want = ctx, req, want_logprobs
        self.choices: dict[int, _Choice] = {}
        self.usage = Usage()
        self.seen: set[int] = set()

    def take(self, i: int, out: RequestOutput) -> list[tuple[int, str, dict | None, CompletionOutput]]:
        """Account for a delta; returns (choice index, new text, new logprobs, completion) per sequence."""
        self.usage.add(out, first=i not in self.seen)
        self.seen.add(i)
        new = []
        for c in out.outputs:
            k = i * self.req.n + c.index
            started = k in self.choices
            choice = self.choices.setdefault(k, _Choice(self.req.return_tokens_as_token_ids))
            text, logprobs = _delta(self.ctx, self.req, choice, out, c, started, self.want)
            new.append((k, text, logprobs, c))
        return new


async def _collect(ctx, req, outputs, head, want) -> dict:
    acc = _Choices(ctx, req, want)
    async for i, out in outputs:
        acc.take(i, out)
    body = dict(head)
    body["choices"] = [{"index": k, "text": ch.text, "logprobs": ch.logprobs_body() if want else None,
                        "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                        # vLLM's keys, null unless asked for (return_token_ids, prompt_logprobs)
                        "prompt_token_ids": ch.prompt_token_ids,
                        "token_ids": ch.token_ids if req.return_token_ids else None,
                        "prompt_logprobs": ch.prompt_logprobs}
                       for k, ch in sorted(acc.choices.items())]
    body["usage"] = acc.usage.body()
    return body


async def _stream(ctx, req, outputs, head, want) -> AsyncIterator[str]:
    acc = _Choices(ctx, req, want)
    try:
        announced: set[int] = set()  # choices whose first chunk (prompt ids, prompt logprobs) was sent
        async for i, out in outputs:
            for k, text, logprobs, c in acc.take(i, out):
                if text or c.finish_reason is not None or c.token_ids:
                    chunk = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}
                    if k not in announced:
                        announced.add(k)
                        choice = acc.choices[k]
                        if req.return_token_ids:
                            chunk["prompt_token_ids"] = choice.prompt_token_ids
                        if req.prompt_logprobs is not None:
                            chunk["prompt_logprobs"] = choice.prompt_logprobs
                    if req.return_token_ids:
                        chunk["token_ids"] = list(c.token_ids)
                    usage = {"usage": acc.usage.body()} if req.continuous_usage else {}
                    yield sse({**head, "choices": [chunk], **usage})
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": acc.usage.body()})
        yield sse("[DONE]")
    except Exception as exc:  # noqa: BLE001 - after the stream started: an error chunk, then [DONE]
        yield error_chunk(exc)
        yield sse("[DONE]")
    finally:
        await outputs.aclose()
