"""The FastAPI application: OpenAI-compatible routes, health, version, metrics and the dashboard.

``build_app(ctx)`` wires the routes of ``completions.py`` and ``chat.py`` to one ``ServerContext``.
Two pure-ASGI middlewares guard every request before FastAPI sees it: a body-size limit (413,
checked on ``Content-Length`` and while the body streams in) and the API key (401 on ``/v1/*``
routes when the server has one, as vLLM does). Errors are OpenAI-shaped (``server/errors.py``).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagedllm
from pagedllm.errors import InvalidRequest, require_utf8
from pagedllm.server.chat import create_chat_completion
from pagedllm.server.completions import create_completion
from pagedllm.server.dashboard import install_dashboard
from pagedllm.server.errors import OpenAIError, install_error_handlers
from pagedllm.server.metrics import engine_snapshot
from pagedllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from pagedllm.server.serving import ClientDisconnected, ServerContext

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class _BodyLimit:
    """413 for a body over ``limit`` bytes (declared or streamed)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        too_big = OpenAIError(413, f"the request body is larger than {self.limit} bytes", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_big
            return message

        return await self.app(scope, limited_receive, send)


class _ApiKey:
    """401 on /v1/* without ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = OpenAIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                    code="invalid_api_key")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(ctx: ServerContext, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    if ctx.api_key:
        app.add_middleware(_ApiKey, key=ctx.api_key)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    install_dashboard(app, ctx)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        try:
            return await create_completion(ctx, req, raw)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        try:
            return await create_chat_completion(ctx, req, raw)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "pagedllm",
                                            "max_model_len": ctx.engine.engine.config.scheduler.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        try:
            if req.messages is not None:
                tokens = ctx.tokenizer.apply_chat_template(conversation(req.messages),
                                                           add_generation_prompt=req.add_generation_prompt)
            else:
                require_utf8(req.prompt, "prompt")
                tokens = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), "messages" if req.messages is not None else "prompt") from None
        limit = ctx.engine.engine.config.scheduler.max_model_len
        return {"tokens": tokens, "count": len(tokens), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        vocab = ctx.engine.engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if not ctx.engine.healthy:
            return JSONResponse({"status": "error", "error": repr(ctx.engine.dead)}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def metrics():
        engine = ctx.engine.engine
        snapshot = await asyncio.wrap_future(ctx.engine.call(lambda: engine_snapshot(engine)))
        return Response(ctx.metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
