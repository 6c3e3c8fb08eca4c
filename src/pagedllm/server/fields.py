"""Which fields each route takes: the one list, read from the request models of ``protocol.py``.

A route's fields are its model's, nested models included (``stream_options.include_usage``,
``messages[].content``); anything else in a request is a 400 ``unsupported_parameter``. A field
marked ``no_op`` is accepted and ignored, and says why. docs/api.md's field table is
``fields_markdown()`` (``python -m pagedllm.server.fields`` prints it; a test keeps the two equal).
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel

from pagedllm.server.protocol import (
    NO_OP_MARK,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.server.responses import ResponsesRequest

ROUTES: dict[str, type[BaseModel]] = {
    "POST /v1/completions": CompletionRequest,
    "POST /v1/chat/completions": ChatCompletionRequest,
    "POST /v1/chat/completions/batch": BatchChatCompletionRequest,
    "POST /v1/responses": ResponsesRequest,
    "POST /tokenize": TokenizeRequest,
    "POST /detokenize": DetokenizeRequest,
}


def _models_in(annotation) -> list[tuple[type[BaseModel], int]]:
    """The request models inside an annotation, each with how many lists it sits in."""
    found: list[tuple[type[BaseModel], int]] = []

    def walk(a, lists: int) -> None:
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append((a, lists))
            return
        origin = typing.get_origin(a)
        if origin is typing.Annotated:
            walk(typing.get_args(a)[0], lists)
        elif origin in (list, tuple):
            for arg in typing.get_args(a):
                walk(arg, lists + 1)
        elif origin is typing.Union or isinstance(a, types.UnionType):
            for arg in typing.get_args(a):
                walk(arg, lists)

    walk(annotation, 0)
    return list(dict.fromkeys(found))


def refused_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """Fields a route's model inherits but refuses (``BatchChatCompletionRequest.REFUSED_FIELDS``)."""
    return getattr(model, "REFUSED_FIELDS", ())


def route_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    """``{"stream_options.include_usage": None, "user": "why it is a no-op", ...}``: every field
    of ``model`` by its JSON name (None: implemented; a string: accepted as a no-op, why), less
    those it refuses."""
    out: dict[str, str | None] = {}
    for name, info in model.model_fields.items():
        if name in refused_fields(model):
            continue
        key = prefix + (info.alias or name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        out[key] = extra.get(NO_OP_MARK)
        for inner, lists in _models_in(info.annotation):
            out.update(route_fields(inner, f"{key}{'[]' * lists}."))
    return out


def fields_markdown() -> str:
    """The per-route field table of docs/api.md."""
    lines = []
    for route, model in ROUTES.items():
        fields = route_fields(model)
        implemented = [f"`{f}`" for f, why in fields.items() if why is None]
        lines += [f"**`{route}`** ({len(implemented)} fields): {', '.join(implemented)}.", ""]
        if refused_fields(model):
            lines += ["Not taken here (a 400 naming the field unless left at its default): "
                      f"{', '.join(f'`{f}`' for f in refused_fields(model))}.", ""]
        no_ops = {f: why for f, why in fields.items() if why is not None}
        if no_ops:
            lines += ["| accepted, no effect | why |", "|---|---|"]
            lines += [f"| `{f}` | {why} |" for f, why in no_ops.items()]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(fields_markdown(), end="")
