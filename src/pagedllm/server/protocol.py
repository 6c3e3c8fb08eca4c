"""Request bodies of the OpenAI-compatible routes (pydantic), and their mapping onto ``SamplingParams``.

Shapes follow the OpenAI API and vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``, ``structured_outputs``, ...).
``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` become a
``StructuredOutputsParams`` (``json_schema`` is enforced whether ``strict`` or not). Unknown fields are
ignored, as vLLM does, so clients that send newer OpenAI fields keep working; known ones are typed
strictly (no booleans as integers, no numbers as strings, no NaN or Infinity). A value that
``SamplingParams`` rejects becomes a 400 naming the field (see ``server/errors.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from pagedllm.errors import require_utf8

STRUCTURED_OUTPUTS_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))
NonNegInt = Annotated[int, Field(ge=0)]
MAX_N = 128  # most choices per request, as OpenAI


class _Request(BaseModel):
    # strict: a boolean is not an integer, "3" not a number; no NaN or Infinity (issue 21)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The engine's constraint for this format (None for ``text``). ``json_schema`` is always
        enforced, ``strict`` or not (as vLLM does); raises ValueError naming the field."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema.schema is required when response_format.type is "
                             "'json_schema'")
        return StructuredOutputsParams(json=self.json_schema.schema_)


class SamplingFields(_Request):
    """The sampling fields both routes share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # "" would equal no salt: refused
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: json / regex / choice / grammar / ...
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` (raises ValueError naming a bad field)."""
        optional = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                           "presence_penalty", "frequency_penalty",
                                                           "repetition_penalty")
                    if getattr(self, name) is not None}
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              logit_bias=self.logit_bias, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output, max_tokens=max_tokens,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_outputs=self.constraint(), **optional)

    def constraint(self) -> StructuredOutputsParams | None:
        """``response_format`` or vLLM's ``structured_outputs`` (not both) as the engine's constraint."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("response_format and structured_outputs cannot both be given")
            unknown = sorted(set(self.structured_outputs) - STRUCTURED_OUTPUTS_KEYS)
            if unknown:
                raise ValueError(f"structured_outputs: unknown key(s) {', '.join(unknown)}; expected some of "
                                 f"{', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))}")
            return StructuredOutputsParams(**self.structured_outputs)
        return None if self.response_format is None else self.response_format.constraint()

    @property
    def constraint_field(self) -> str:
        """The request field a constraint came from (how errors about it are named)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a list of content parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them; InvalidRequest naming a role or content that
    is not valid UTF-8 (the tokenizer would raise a TypeError on it)."""
    out = [{"role": m.role, "content": m.text()} for m in messages]
    for i, message in enumerate(out):
        for key, text in message.items():
            require_utf8(text, f"messages.{i}.{key}")
    return out
