"""Errors the OpenAI way: every failure is ``{"error": {"message", "type", "param", "code"}}``.

The one place where exceptions become HTTP statuses: ``InvalidRequest``/``ValueError`` and bad
JSON or fields -> 400 naming the field (never FastAPI's bare 422; a field no route model declares
-> 400 ``unsupported_parameter`` naming it), a missing or wrong API key ->
401, an unknown model or route -> 404, a wrong method -> 405, a body over the limit -> 413, a full
queue -> 429 with ``Retry-After``, a dead engine or shutdown -> 503, anything unexpected -> 500
with a generic message (the traceback goes to the log, never into the response).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import EngineDeadError, EngineShutdown
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.errors import EngineStopped, InvalidRequest, PagedLLMError, ReplicaLost, RequestTooLong

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


ENGINE_DEAD = "the engine has stopped, so no request can be served until the server restarts"


class OpenAIError(Exception):
    """An error with its HTTP status and OpenAI fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        # a message quoting client input may hold a lone surrogate: escape it, or rendering fails
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages", "max_completion_tokens",
                                                                  "top_logprobs", "response_format", "stream_options",
                                                                  "continue_final_message", "n", "echo",
                                                                  "structured_outputs", "tool_choice",
                                                                  "length_penalty", "truncation_side"}


def _param_of(message: str) -> str | None:
    """The request field a ValueError message starts with (``top_p must be ...`` -> ``top_p``)."""
    m = re.match(r"([a-z][a-z_]*)\b", message)
    return m.group(1) if m and m.group(1) in _FIELDS else None


def as_openai_error(exc: BaseException) -> OpenAIError:
    """Map any exception onto the OpenAI error it should be returned as."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestTooLong):
        return OpenAIError(400, str(exc), "prompt", "context_length_exceeded")
    if isinstance(exc, InvalidRequest | ValueError):
        return OpenAIError(400, str(exc), _param_of(str(exc)))
    if isinstance(exc, EngineShutdown):
        return OpenAIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):  # its text names the internal exception: kept for the log
        return OpenAIError(503, ENGINE_DEAD, code="engine_dead")
    if isinstance(exc, EngineStopped):  # a tensor-parallel engine after a failed step or a dead worker
        return OpenAIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ReplicaLost):  # a cluster replica died under the request: retrying goes elsewhere
        return OpenAIError(503, str(exc), code="replica_lost", headers={"Retry-After": "1"})
    if isinstance(exc, PagedLLMError):
        return OpenAIError(500, str(exc))
    log.error("unexpected error while serving a request", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}")


def error_chunk(exc: BaseException) -> str:
    """The final SSE event of a stream that failed after it started."""
    return f"data: {json.dumps(as_openai_error(exc).body())}\n\n"


_FIELD_SEGMENT = re.compile(r"^[A-Za-z0-9_]+$")


def _field_of(error: dict) -> str | None:
    """The request field an error is about: its location without ``body`` and without the tags
    pydantic adds for the member of a union that failed (``constrained-str``, ``list[int]``)."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in loc if _FIELD_SEGMENT.match(p)) or None


UNSUPPORTED = "unsupported_parameter"


def _validation_error(exc: RequestValidationError, route: str) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}")
    unknown = [_field_of(e) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # before any bad value: the request asks for something this server does not do
        names = ", ".join(f"'{f}'" for f in dict.fromkeys(unknown))
        return OpenAIError(400, f"unsupported parameter{'s' if len(set(unknown)) > 1 else ''} {names}: pagedllm "
                                f"does not implement {'them' if len(set(unknown)) > 1 else 'it'} on {route} "
                                "(docs/api.md lists the fields of each route)", unknown[0], UNSUPPORTED)
    if first.get("type") == "value_error" and _field_of(first) is None:  # a model validator's ValueError
        message = str(first.get("ctx", {}).get("error") or first.get("msg", "invalid request"))
        return OpenAIError(400, message, _param_of(message))
    message, field = _validation_message(errors)
    return OpenAIError(400, message, field)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0]
    field = _field_of(first)
    # a value no member of a union takes fails each member: say what was wrong with the value
    # ("at least 1 item") rather than that it is not of the first member's type ("a valid string")
    same_field = [e for e in errors if _field_of(e) == field]
    chosen = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    where = f"{field}: " if field else ""
    kind = f" [type={chosen['type']}]" if chosen.get("type") else ""  # pydantic's error type, as vLLM's messages hold
    return f"{where}{chosen.get('msg', 'invalid value')}{kind}", field


class OpenAIRoute(APIRoute):
    """A route whose errors become OpenAI error responses right where they happen (Starlette's
    catch-all handler would answer and then re-raise, which resets the client's connection)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request):
            try:
                return await handler(request)
            except (RequestValidationError, StarletteHTTPException):
                raise  # answered by the handlers below
            except Exception as exc:  # noqa: BLE001 - every other error, OpenAI-shaped
                return as_openai_error(exc).response()

        return handle


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for what happens outside a route's own code: bad bodies, unknown routes."""
    app.router.route_class = OpenAIRoute

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _validation_error(exc, f"{request.method} {request.url.path}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        headers = exc.headers
        if exc.status_code == 405:  # Allow: the methods of every route on this path (Starlette names the first's)
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return OpenAIError(exc.status_code, message if exc.detail in (None, "Not Found", "Method Not Allowed")
                           else str(exc.detail), headers=headers).response()


def _allowed_methods(request: Request) -> str:
    methods: set[str] = set()
    for route in request.app.router.routes:
        pattern, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if pattern is not None and route_methods and pattern.match(request.url.path):
            methods |= set(route_methods)
    return ", ".join(sorted(methods))

