"""The FastAPI application: OpenAI-compatible routes, health, version, metrics and the dashboard.

``build_app(ctx)`` wires the routes of ``completions.py`` and ``chat.py`` to one ``ServerContext``.
Two pure-ASGI middlewares guard every request before FastAPI sees it: the body, read whole
first (413 past the size limit, declared or streamed; 408 when it arrives too slowly), and the API
key (401 on the OpenAI, tokenizer and dashboard-data routes when the server has one).
Errors are OpenAI-shaped (``server/errors.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

import pagedllm
from pagedllm.errors import InvalidRequest
from pagedllm.server.chat import create_batch_chat_completion, create_chat_completion
from pagedllm.server.completions import create_completion
from pagedllm.server.dashboard import install_dashboard
from pagedllm.server.errors import OpenAIError, install_error_handlers
from pagedllm.server.openapi import install_openapi
from pagedllm.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from pagedllm.server.responses import ResponsesRequest, ResponseStore, create_response
from pagedllm.server.serving import TENANT, ClientDisconnected, ServerContext
from pagedllm.server.tools import ToolPlan, history_for

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class _Body:
    """Reads each request's whole body before the app sees it: 413 past ``limit`` bytes (declared
    in Content-Length or streamed in chunks), 408 when it has not all arrived ``timeout_s`` after
    the headers. The app then reads the buffered body (what FastAPI would buffer anyway)."""

    def __init__(self, app, limit: int, timeout_s: float) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        too_big = OpenAIError(413, f"the request body is larger than {self.limit} bytes", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big.response()(scope, receive, send)
        chunks: list[bytes] = []
        seen = 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                late = OpenAIError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                   code="body_timeout")
                return await late.response()(scope, receive, send)
            if message["type"] == "http.disconnect":
                return None  # the client left before sending its body: nothing to answer
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await too_big.response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def buffered_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, buffered_receive, send)


# What ``--api-key`` guards: the OpenAI routes, the tokenizer routes and the dashboard's data (the
# page and its assets hold none, so a browser can load them and send the key from ``#key=``).
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations", "/load",
                    "/dashboard/state", "/cluster")


def route_path(scope) -> str:
    """The path the routes match: the ASGI path without ``root_path`` (uvicorn puts ``--root-path``
    in front of every path, as the ASGI spec has it), as Starlette's routing takes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class _RootPath:
    """``--root-path /llm``: a request for ``/llm/v1/...`` (a proxy that keeps the prefix, or a
    client calling it directly) is served as ``/v1/...``, as one for ``/v1/...`` (a proxy that
    strips it) is; the OpenAPI schema names the prefix. Runs first: the API-key guard and the
    routes then see one path, ``route_path``, whichever way the request came."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        root = scope.get("root_path", "") if scope["type"] == "http" else ""
        if root:
            inner = route_path(scope)
            if inner == root or inner.startswith(root + "/"):  # the client's own copy of the prefix
                inner = inner[len(root):] or "/"
                scope = {**scope, "path": root + inner, "raw_path": (root + inner).encode()}
        return await self.app(scope, receive, send)


def tenant_salt(key: str) -> str:
    """The cache salt of one API key's tenant: a digest (the key itself never enters a block hash)."""
    return "tenant:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


class _ApiKey:
    """401 without ``Authorization: Bearer <key>`` (one of ``keys``) on the routes under ``prefixes``
    (``GUARDED_PREFIXES``, and ``/metrics`` with ``--guard-metrics``); ``/health``, ``/version`` and
    ``/metrics`` stay open, as vLLM's do. A request that passes carries its key's ``tenant_salt``
    in the scope's state."""

    def __init__(self, app, keys: tuple[str, ...], prefixes: tuple[str, ...]) -> None:
        self.app, self.prefixes = app, prefixes
        self.expected = [(f"Bearer {key}".encode(), tenant_salt(key)) for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and route_path(scope).startswith(self.prefixes):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            tenant = None
            for expected, salt in self.expected:  # every key compared, in constant time each
                if hmac.compare_digest(given, expected):
                    tenant = salt
            if tenant is None:
                error = OpenAIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                    code="invalid_api_key")
                return await error.response()(scope, receive, send)
            scope.setdefault("state", {})[TENANT] = tenant
        return await self.app(scope, receive, send)


def tokenizer_description(hf) -> dict:
    """``/tokenizer_info``'s body: ``tokenizer_class``, ``chat_template``, ``vocab_size``, the special
    tokens, then every other init setting that is plain JSON (strings, numbers, booleans)."""
    plain = {k: v for k, v in getattr(hf, "init_kwargs", {}).items()
             if isinstance(v, str | int | float | bool) and not k.endswith("_file")}
    special = {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    return {**plain, **special, "tokenizer_class": type(hf).__name__, "chat_template": hf.chat_template,
            "vocab_size": len(hf), "model_max_length": plain.get("model_max_length")}


async def _answer(work: Awaitable):
    """A generating route's answer, or 499 when its client hung up before it (its requests aborted)."""
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)


def build_app(ctx: ServerContext, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    guarded = GUARDED_PREFIXES + (("/metrics",) if ctx.guard_metrics else ())
    if ctx.api_keys:
        app.add_middleware(_ApiKey, keys=ctx.api_keys, prefixes=guarded)
    install_openapi(app, ctx, guarded)
    app.add_middleware(_Body, limit=max_body_bytes, timeout_s=ctx.limits.body_timeout_s)
    app.add_middleware(_RootPath)  # the last added runs first
    install_dashboard(app, ctx)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await _answer(create_completion(ctx, req, raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await _answer(create_chat_completion(ctx, req, raw))

    @app.post("/v1/chat/completions/batch")
    async def chat_completions_batch(req: BatchChatCompletionRequest, raw: Request):
        """vLLM's batch route: ``messages`` a list of conversations, one choice each (docs/api.md)."""
        return await _answer(create_batch_chat_completion(ctx, req, raw))

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "pagedllm",
                "max_model_len": ctx.engine.engine.max_model_len}

    responses_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await _answer(create_response(ctx, req, raw, responses_store))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request):
        """A stored response (``store: true``), as ``client.responses.retrieve`` reads it. Its query
        parameters (``include``, ``stream``: replaying a background response's events) are not
        implemented: each is a 400 naming it."""
        for name in raw.query_params:
            name = name.removesuffix("[]")  # a list parameter, as the openai client spells it
            raise OpenAIError(400, f"{name}: not supported when retrieving a response on this server", name,
                              "unsupported_parameter")
        return responses_store.body(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        """Forgets a stored response, as ``client.responses.delete`` asks."""
        return responses_store.delete(response_id)

    # not in /openapi.json: its body is either route's, a union schemathesis cannot generate; the
    # answers are theirs (tests/server/test_strict_requests.py checks the route)
    @app.post("/invocations", include_in_schema=False)
    async def invocations(raw: Request):
        """SageMaker's route, as vLLM serves it: a chat body (``messages``) or a completion one
        (``prompt``), answered as that route answers it; anything else is a 400."""
        try:
            body = await raw.json()
        except ValueError:
            raise OpenAIError(400, "the body is not valid JSON") from None
        kind = (ChatCompletionRequest if isinstance(body, dict) and "messages" in body
                else CompletionRequest if isinstance(body, dict) and "prompt" in body else None)
        if kind is None:
            raise OpenAIError(400, "invocations: give a chat body (messages) or a completion body (prompt)")
        try:
            req = kind.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        handler = chat_completions if kind is ChatCompletionRequest else completions
        return await handler(req, raw)

    @app.get("/load")
    async def load():
        """vLLM's ``/load``: how many sequences (prompts x n) the server holds now, running or queued."""
        return {"server_load": ctx.admitted}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # :path: a model id may hold slashes ("org/name")
    async def retrieve_model(model_id: str):
        ctx.check_model(model_id)  # 404 model_not_found for any other id
        return model_card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        try:
            if req.messages is not None:  # rendered as the chat route renders it, tools included
                messages, kwargs = conversation(req.messages), req.template_kwargs()
                if req.tools:
                    messages, shown = ToolPlan(tuple(req.tools), "none", None, True, "hermes").render(
                        ctx.tokenizer, messages)
                    kwargs |= shown
                else:
                    messages = history_for(ctx.tokenizer, messages)
                tokens = await ctx.apply_chat_template(messages, **kwargs)
            else:
                tokens = await ctx.tokenize(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), "messages" if req.messages is not None else "prompt") from None
        limit = ctx.engine.engine.max_model_len
        strs = ctx.tokenizer.hf.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": limit, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's ``/tokenizer_info``: the tokenizer's class, chat template, special tokens and the
        JSON-representable part of its configuration, so a client can tokenize as the server does."""
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        return tokenizer_description(ctx.tokenizer.hf)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        vocab = ctx.engine.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        problem = ctx.health_problem()
        if problem is not None:
            return JSONResponse({"status": "error", "error": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(await ctx.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
