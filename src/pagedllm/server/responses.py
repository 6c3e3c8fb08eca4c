"""``POST /v1/responses``: OpenAI's Responses API over the chat machinery (``chat.start_chat``).

A request becomes a chat: ``instructions`` a system message, ``input`` (text, or items: messages
with text content, ``function_call`` and ``function_call_output``) the conversation after the one
``previous_response_id`` names, ``max_output_tokens`` the token limit, ``text.format`` the
``response_format``, function ``tools`` and ``tool_choice`` the chat's (``server/tools.py``). The
answer is a ``response`` object whose ``output`` holds a ``message`` item (``output_text``) and/or
``function_call`` items; ``status`` ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the limit cut it. Streamed, the events are OpenAI's:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` (and a function call's items), then
``response.completed`` with the whole response, each with its ``sequence_number``.

``store`` is false unless asked for. A stored response (its conversation and output, and the
response object) lives in a bounded in-memory store (``ResponseStore``: the newest ``STORE_SIZE``,
lost on restart), which is what ``previous_response_id`` continues from (an id not in it is a 400
saying so), what ``GET /v1/responses/{id}`` returns and what ``DELETE /v1/responses/{id}`` removes
(an id not in it: a 404, as OpenAI answers).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from pagedllm.server.chat import collect_chat, start_chat
from pagedllm.server.errors import OpenAIError, error_chunk
from pagedllm.server.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    Int,
    JsonSchemaFormat,
    _Request,
    no_op,
)
from pagedllm.server.serving import ServerContext, Usage, unless_disconnected
from pagedllm.server.tools import ToolStream

STORE_SIZE = 1024  # responses kept for previous_response_id (the newest; an in-memory, per-process store)


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's, sent back: none are made here


class _InputItem(_Request):
    """What every input item may carry back from an earlier response's output (unused here)."""

    id: str | None = None
    status: str | None = None


class MessageItem(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(_InputItem):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_InputItem):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[MessageItem | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Int(ge=1) | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Int(ge=INT64_MIN, le=INT64_MAX) | None = None  # not OpenAI's; vLLM takes it
    stream: bool = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back in the response, as OpenAI does
    user: str | None = no_op("OpenAI's end-user id for abuse monitoring; this server monitors no users")
    service_tier: Literal["auto", "default"] | None = no_op("OpenAI's processing tier; this server has one")


class ResponseStore:
    """The newest ``size`` stored responses: id -> (the conversation with its output, the response body)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        with self._lock:
            self._items[response_id] = (messages, body)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict]:
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise OpenAIError(400, f"previous_response_id: no stored response {response_id!r} (responses are kept "
                                   f"only with store: true, the newest {self.size}, until the server restarts)",
                              "previous_response_id", "previous_response_not_found")
        return [dict(m) for m in item[0]]

    def _not_found(self, response_id: str) -> OpenAIError:
        return OpenAIError(404, f"Response with id {response_id!r} not found (responses are kept only with "
                                f"store: true, the newest {self.size}, until the server restarts)",
                           "response_id", "response_not_found")

    def body(self, response_id: str) -> dict:
        """``GET /v1/responses/{id}``: the stored response object."""
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise self._not_found(response_id)
        return item[1]

    def delete(self, response_id: str) -> dict:
        """``DELETE /v1/responses/{id}``: forgets it (a later ``previous_response_id`` is a 400)."""
        with self._lock:
            item = self._items.pop(response_id, None)
        if item is None:
            raise self._not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _messages(req: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The request as chat messages (OpenAI's chat message dicts, as ``ChatCompletionRequest`` takes)."""
    messages = store.conversation(req.previous_response_id) if req.previous_response_id else []
    if req.instructions is not None:  # this request's instructions only (as OpenAI: not carried over)
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": req.instructions})
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": messages, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("model", "temperature", "top_p", "seed"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": JsonSchemaFormat(name=fmt.name, schema=fmt.schema_,
                                                                   strict=fmt.strict).model_dump(by_alias=True)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as exc:  # e.g. a history call whose arguments are not JSON
        raise OpenAIError(400, str(exc).splitlines()[-1].strip(), "input") from None


def _ids() -> tuple[str, str]:
    return f"msg_{uuid.uuid4().hex[:24]}", f"fc_{uuid.uuid4().hex[:24]}"


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _text_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


class _Response:
    """One response's fixed fields, its output items as they finish, and what it stores."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, messages: list[dict], store: ResponseStore) -> None:
        self.req, self.messages, self.store = req, messages, store
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.created_at = int(time.time())
        self.model = ctx.model_name

    def body(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "incomplete_details": incomplete, "error": None, "output": output,
                "usage": usage, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                                else req.tool_choice.model_dump()) or ("auto" if req.tools else "none"),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
                "previous_response_id": req.previous_response_id, "store": req.store,
                "metadata": req.metadata or {}}

    def keep(self, text: str | None, calls: list[dict], body: dict) -> dict:
        """With ``store: true``, the conversation and this output (for a later ``previous_response_id``)
        and the finished response ``body`` (for ``GET``); returns the body."""
        if self.req.store:
            turn = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = calls
            self.store.put(self.id, [*self.messages, turn], body)
        return body


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request, store: ResponseStore):
    messages = _messages(req, store)
    chat = _chat_request(req, messages)
    response = _Response(ctx, req, messages, store)
    outputs, head, top, plan = await start_chat(ctx, chat, raw, request_id=response.id)
    if req.stream:
        return StreamingResponse(_events(response, outputs, plan), media_type="text/event-stream")
    return await unless_disconnected(raw, _whole(response, chat, outputs, head, top, plan))


async def _whole(response: _Response, chat, outputs, head, top, plan) -> dict:
    body = await collect_chat(chat, outputs, head, top, plan)
    (choice,) = body["choices"]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(_text_item(_ids()[0], message["content"]))
    output += [_call_item(c) for c in message.get("tool_calls") or []]
    return response.keep(message.get("content"), message.get("tool_calls") or [],
                         response.body("completed", output, _usage(body["usage"]), choice["finish_reason"]))


def _event(kind: str, seq: int, **fields) -> str:
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


async def _events(response: _Response, outputs, plan) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    yield event("response.created", response=response.body("in_progress", [], None, None))
    yield event("response.in_progress", response=response.body("in_progress", [], None, None))
    usage, first, text, finish = Usage(), True, "", None
    message_id, opened = _ids()[0], False
    split = ToolStream(plan) if plan is not None else None
    calls: list[dict] = []
    try:
        async for _, out in outputs:
            usage.add(out, first)
            first = False
            for c in out.outputs:
                delta = split.feed(c.text) if split is not None else c.text
                if c.finish_reason is not None:
                    finish = c.finish_reason
                    if split is not None:
                        rest, _ = split.finish()
                        delta, calls = delta + rest, split.calls
                if delta:
                    if not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0,
                                    item={**_text_item(message_id, ""), "status": "in_progress", "content": []})
                        yield event("response.content_part.added", item_id=message_id, output_index=0,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text += delta
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                                delta=delta, logprobs=[])
        output = []
        if opened:
            item = _text_item(message_id, text)
            yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0,
                        part=item["content"][0])
            yield event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for call in calls:
            item = _call_item(call)
            index = len(output)
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                               "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
            yield event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        finished = response.keep(text or None, calls, response.body("completed", output, _usage(usage.body()),
                                                                    "stop" if calls else finish))
        kind = "response.incomplete" if finished["status"] == "incomplete" else "response.completed"
        yield event(kind, response=finished)
    except Exception as exc:  # noqa: BLE001 - after the stream started: an error event, OpenAI's way
        body = json.loads(error_chunk(exc)[len("data: "):])["error"]
        yield event("error", code=body.get("code"), message=body["message"], param=body.get("param"))
    finally:
        await outputs.aclose()
