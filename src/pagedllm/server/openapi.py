"""The OpenAPI schema the server publishes (``/openapi.json``): what FastAPI derives from the request
models, completed with what it cannot know, so that the schema describes every answer we send and a
client or a schema fuzzer (schemathesis) can trust it:

- the errors, in the OpenAI shape (``ErrorResponse``), each route may answer: 400 (a bad body or
  field: never FastAPI's 422, which we do not send), 401 (``--api-key``), 404 (an unknown
  ``model``, in a body or in ``GET /v1/models/{id}``; a response not stored, in
  ``GET``/``DELETE /v1/responses/{id}``), 408 / 413 (a body too slow or too large),
  429 (admission full, with ``Retry-After``), 503 (the engine stopped or shutting down);
- the content types: Server-Sent Events for ``stream: true``, Prometheus text for ``/metrics``;
- bearer authentication on the guarded routes when the server has API keys;
- the bounds that depend on the served model: token ids below its vocabulary size, ``max_tokens``
  up to ``max_model_len``, and the server's cost limits (``logit_bias`` entries, stop strings).

What no JSON Schema can state is checked by the server and answered with a 400 naming the field:
rules across fields (the prompt and ``max_tokens`` together within ``max_model_len``, ``min_tokens``
at most ``max_tokens``, exactly one of ``prompt`` or ``messages`` on ``/tokenize``, prompts x ``n``
within the admission capacity, ``stream_options`` only with ``stream: true``), ``logit_bias`` keys
below the vocabulary size, a text prompt that tokenizes to at least one token (the tokenizer drops
some control characters), and the validity of a structured-output constraint (a JSON schema, regex
or grammar). docs/api.md lists them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedllm.server.protocol import TOKEN_ID_MARK
from pagedllm.server.serving import ServerContext

ERROR_DESCRIPTIONS = {
    400: "the request is invalid: a malformed body, a field out of range, or a rule across fields broken "
         "(the error's param names the field)",
    401: "a missing or wrong API key",
    404: "the model named is not the one served",
    408: "the body did not arrive in time",
    413: "the body is larger than the server accepts",
    429: "the server is at capacity: retry after Retry-After seconds",
    503: "the engine has stopped or is shutting down",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def _errors(codes: tuple[int, ...]) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    out = {}
    for code in codes:
        out[str(code)] = {"description": ERROR_DESCRIPTIONS[code], "content": {"application/json": {"schema": ref}}}
    if "429" in out:
        out["429"]["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "string"}}}
    return out


def _route_errors(path: str, method: str, guarded: bool) -> tuple[int, ...]:
    codes: list[int] = []
    if method == "post":
        codes += [400, 404, 408, 413]  # every body has a ``model`` field
    if guarded:
        codes.append(401)
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        codes += [429, 503]
    if path.startswith("/v1/models/"):  # GET /v1/models/{id}: another model's id, or one not UTF-8
        codes += [400, 404]
    if path.startswith("/v1/responses/"):  # GET / DELETE /v1/responses/{id}: not stored; a query parameter
        codes += [400, 404]
    if path == "/tokenizer_info":  # a model without a tokenizer
        codes.append(400)
    if path in ("/health", "/dashboard/state", "/metrics"):
        codes.append(503)
    return tuple(sorted(codes))


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


# vLLM's ``structured_outputs`` as ``StructuredOutputsParams`` checks it: known keys only, exactly one
# constraint given (not null; ``json_object`` only when true), each of its type. The request model
# keeps it a plain dict (the engine's dataclass is the one check), so the schema is written here.
_GIVEN = {"json": {"anyOf": [{"type": "object"}, {"type": "string"}]}, "regex": {"type": "string"},
          "choice": {"type": "array"}, "grammar": {"type": "string"}, "json_object": {"const": True}}
STRUCTURED_OUTPUTS_SCHEMA = {
    "type": "object",
    "properties": {
        "json": _nullable({"anyOf": [{"type": "object"}, {"type": "string"}]}),
        "regex": _nullable({"type": "string", "minLength": 1}),
        "choice": _nullable({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
        "grammar": _nullable({"type": "string", "minLength": 1}),
        "json_object": _nullable({"type": "boolean"}),
        "disable_any_whitespace": {"type": "boolean"},
    },
    "additionalProperties": False,
    "oneOf": [{"required": [kind], "properties": {kind: given}} for kind, given in _GIVEN.items()],
}


def _bound_integers(schema: dict | list, vocab_size: int) -> None:
    """Integer bounds under ``schema`` as integers, and every ``TokenId`` (marked ``TOKEN_ID_MARK``)
    bounded by the vocabulary's last id. Integer bounds stay integers (FastAPI writes ``0.0``, which
    would make a generator send a float where the strict models take only integers)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(schema.get(key), float) and schema[key].is_integer():
                    schema[key] = int(schema[key])
            if schema.get(TOKEN_ID_MARK):
                schema["maximum"] = vocab_size - 1
        for value in schema.values():
            _bound_integers(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value, vocab_size)


def _nullable_variant(prop: dict) -> dict:
    """The non-null branch of an ``X | None`` property (the property itself when it has none)."""
    branches = [b for b in prop.get("anyOf", ()) if b.get("type") != "null"]
    return branches[0] if len(branches) == 1 else prop


def _apply_model_bounds(schemas: dict, ctx: ServerContext) -> None:
    engine = ctx.engine.engine
    _bound_integers(schemas, engine.vocab_size)
    max_model_len = engine.max_model_len
    limits = ctx.limits
    for name in ("CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["structured_outputs"] = _nullable(STRUCTURED_OUTPUTS_SCHEMA)
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if field in props:
                _nullable_variant(props[field])["maximum"] = max_model_len - 1
        max_logprobs = engine.max_logprobs
        whole = max_logprobs == -1 or max_logprobs >= engine.vocab_size  # -1 (all) within the limit
        for field in ("logprobs", "top_logprobs", "prompt_logprobs"):  # within --max-logprobs
            count = _nullable_variant(props[field]) if field in props else {}
            if count.get("type") == "integer":
                count["minimum"] = -1 if whole else 0
                if max_logprobs != -1:
                    count["maximum"] = max_logprobs
        bias = _nullable_variant(props["logit_bias"])
        bias["maxProperties"] = limits.max_logit_bias
        bias["additionalProperties"] = False  # keys are token ids: only those patternProperties allows
        for branch in props["stop"]["anyOf"]:
            if branch.get("type") == "string":
                branch["maxLength"] = limits.max_stop_chars
            elif branch.get("type") == "array":
                branch["maxItems"] = limits.max_stop
                branch["items"]["maxLength"] = limits.max_stop_chars


def install_openapi(app: FastAPI, ctx: ServerContext, guarded_prefixes: tuple[str, ...]) -> None:
    """Replace ``app.openapi`` with the completed schema (built once, on the first request for it)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs"), ErrorResponse=error)
        _apply_model_bounds(schemas, ctx)
        if ctx.api_keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            guarded = bool(ctx.api_keys) and path.startswith(guarded_prefixes)
            for method, operation in operations.items():
                responses = operation["responses"]
                responses.pop("422", None)
                responses.update(_errors(_route_errors(path, method, guarded)))
                ok = responses["200"]
                if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
                    # OpenAPI 3.1: the schema of a text/event-stream describes each event
                    ok["content"]["text/event-stream"] = {"schema": {
                        "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}
                    ok["description"] = "the completion; with stream: true, Server-Sent Events ending in [DONE]"
                elif path == "/metrics":
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                    ok["description"] = "Prometheus text exposition"
                if guarded:
                    operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
