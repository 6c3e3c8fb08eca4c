"""Request bodies of the OpenAI-compatible routes (pydantic), and their mapping onto ``SamplingParams``.

Shapes follow the OpenAI API and vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``, ``structured_outputs``, ...).
``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` become a
``StructuredOutputsParams`` (``json_schema`` is enforced whether ``strict`` or not).

A field no model here declares is a 400 naming it (``unsupported_parameter``, ``server/errors.py``):
a request asking for something pagedllm does not do never gets a 200 that quietly does something
else. A few OpenAI fields that change nothing a server computes are declared and accepted as
no-ops (``no_op``: ``user``, ``metadata``, ...), each saying why; ``server/fields.py`` lists every
route's fields from these models, and docs/api.md's table is generated from it. Fields are typed
strictly (no booleans as integers, no numbers as strings, no NaN or Infinity). A value that
``SamplingParams`` rejects becomes a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.sampling_params import (
    MAX_LOGPROB_TOKEN_IDS,
    REPETITION_MAX,
    REPETITION_MIN,
    TOP_K_MAX,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedllm.errors import InvalidRequest, require_utf8

STRUCTURED_OUTPUTS_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))
MAX_N = 128  # most choices per request, as OpenAI
# The bounds ``SamplingParams`` enforces, stated here too so /openapi.json says them (a client or a
# schema fuzzer then knows which values are valid); what depends on the served model (token ids
# below the vocabulary size, max_tokens up to max_model_len) is added by ``server/openapi.py``.


def _integral(value: object) -> object:
    """A float with no fractional part as the integer it is: JSON Schema's ``integer`` includes
    ``120.0`` (and vLLM's lax models take it); booleans, strings and ``1.5`` stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds) -> type[int]:  # noqa: N802 - a type, as the annotations read it
    """An integer field (``_integral`` first) with pydantic ``Field`` bounds (the validator goes
    after them, or pydantic writes ``ge`` instead of ``minimum`` into the JSON schema)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _bool_only(value: object) -> object:
    """``Literal[False]`` takes ``0`` too (it compares by equality): a boolean field takes booleans."""
    if value is not None and not isinstance(value, bool):
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


NonNegInt = Int(ge=0)
TOKEN_ID_MARK = "x-token-id"  # how server/openapi.py finds the token ids to bound by the vocabulary
TokenId = Int(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
NonEmptyStr = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


NO_OP_MARK = "x-no-op"  # a field accepted and ignored; its value says why (server/fields.py lists them)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds: what OpenAI and vLLM (a torch long) take


def no_op(why: str) -> Any:
    """A field accepted and ignored, as documented: ``why`` says what it would mean and why nothing
    here depends on it."""
    return Field(None, json_schema_extra={NO_OP_MARK: why})


class _Request(BaseModel):
    # forbid: an unknown field is a 400 naming it, never silently ignored (issue 22)
    # strict: a boolean is not an integer, "3" not a number; no NaN or Infinity (issue 21)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


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
    n: Int(ge=1, le=MAX_N) = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int(ge=-1, le=TOP_K_MAX) | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Int(ge=INT64_MIN, le=INT64_MAX) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_MIN, le=REPETITION_MAX)] | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], float] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # "" would equal no salt: refused
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: json / regex / choice / grammar / ...
    # vLLM's extensions (docs/api.md): token ids in the answer, the prompt's logprobs, a prompt cut
    # to its last tokens
    return_token_ids: bool = False
    use_beam_search: bool = False  # n beams (n <= 10), the best n returned
    length_penalty: float = 1.0    # beam search: a beam's score is its logprob / length ** length_penalty
    prompt_logprobs: Int(ge=-1) | None = None  # -1: the whole vocabulary; at most --max-logprobs
    truncate_prompt_tokens: Int(ge=1) | Literal[-1] | None = None  # -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None  # with truncate_prompt_tokens: "right" keeps the first
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # only these are sampled
    # with logprobs: the logprobs of exactly these tokens (and the chosen one) in place of the top ones
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs' tokens written "token_id:<id>"
    bad_words: list[NonEmptyStr] | None = None  # never generated (as a word, or after a space)
    speculative_decoding: bool = True  # ours: false keeps this request from guessing tokens (docs/speculative.md)
    user: str | None = no_op("OpenAI's end-user id for abuse monitoring; this server monitors no users")
    metadata: dict[str, str] | None = no_op("OpenAI's tags for stored completions; this server stores none")
    store: Annotated[Literal[False] | None, BeforeValidator(_bool_only)] = no_op(
        "OpenAI's opt-in to store the completion; this server stores none, so only false is taken")
    service_tier: Literal["auto", "default"] | None = no_op("OpenAI's processing tier; this server has one")

    @model_validator(mode="after")
    def _cross_field_rules(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.length_penalty != 1.0 and not self.use_beam_search:  # sampling has no use for it: not ignored
            raise ValueError("length_penalty: only used with use_beam_search (it scores finished beams)")
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            raise ValueError("truncation_side: only used with truncate_prompt_tokens")
        logprobs = getattr(self, "logprobs", None)
        if self.logprob_token_ids is not None and (logprobs is None or logprobs is False):
            raise ValueError("logprob_token_ids: only used with logprobs (which tokens' logprobs to return)")
        return self

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt cut to ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``), as vLLM: its
        last ones, or its first with ``truncation_side`` ``right`` (the right side is cut off)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        keep = max_model_len if keep == -1 else keep
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[-keep:]

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: ``stream_options`` with ``include_usage`` and ``continuous_usage_stats``."""
        return self.include_usage and self.stream_options.continuous_usage_stats

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
                              logprobs=None if self.logprob_token_ids else logprobs, prompt_logprobs=prompt_logprobs,
                              allowed_token_ids=self.allowed_token_ids, logprob_token_ids=self.logprob_token_ids,
                              bad_words=self.bad_words, speculative_decoding=self.speculative_decoding,
                              structured_outputs=self.constraint(), **optional)

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """``use_beam_search``: the engine's ``BeamSearchParams`` (``n`` beams). A field beam search
        does not use is a 400 naming it (it would be ignored: ``BEAM_SEARCH_UNUSED``)."""
        given = {name: getattr(self, name) for name in BEAM_SEARCH_UNUSED if name in self.model_fields_set}
        used = [name for name, value in given.items() if value not in (None, False, 0, 0.0, [], {}, "")]
        if self.temperature not in (None, 0.0):
            used.insert(0, "temperature")
        if used:
            raise ValueError(f"{used[0]}: beam search (use_beam_search) does not use it; leave it out")
        if not 1 <= self.n <= MAX_BEAMS:
            raise ValueError(f"n must be 1..{MAX_BEAMS} with use_beam_search (the beam width), got {self.n}")
        if max_tokens is None:
            raise ValueError("max_tokens is needed with use_beam_search")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty)

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


MAX_BEAMS = 10  # BeamSearchParams' widest beam
# what beam search takes no account of: given with use_beam_search, each is a 400 naming it
BEAM_SEARCH_UNUSED = ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "response_format",
                      "structured_outputs", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
                      "include_stop_str_in_output", "allowed_token_ids", "logprob_token_ids",
                      "return_tokens_as_token_ids", "bad_words")
PositiveInt = Int(ge=1)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds \
        | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: PositiveInt | None = 16
    logprobs: Int(ge=-1) | None = None  # -1: the whole vocabulary; at most --max-logprobs
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Request):
    """A content part; only text ones are supported (an image part is a 400 naming it)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # a JSON object as a string, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None                # enforced whenever a call is (tool_choice required or named)


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None           # a role "tool" message: the call it answers

    def text(self) -> str:
        """The message's text: a string, or its text parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=-1) | None = None  # -1: the whole vocabulary; at most --max-logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model goes on with the last message
    echo: bool = False                    # vLLM's: the reply starts with the last message when it is the assistant's

    @model_validator(mode="after")
    def _continue_or_prompt(self):
        _template_flags(self)
        return self

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)

    def template_kwargs(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def echoed(self) -> str:
        """What ``echo`` puts in front of the reply: the last message, if it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's ``POST /v1/chat/completions/batch``: the chat fields, ``messages`` a list of
    conversations (at most ``MAX_N``), each answered as ``/v1/chat/completions`` would answer it
    alone, in one body: choice i is conversation i, the usage is their sum. As vLLM, no ``stream``,
    ``tools`` or ``tool_choice`` other than ``none``, beam search, or ``n`` above 1; and no
    ``prompt_logprobs`` (one body has no place for N prompts' logprobs)."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1, max_length=MAX_N)]

    # the chat fields this route does not take, each narrowed to its off value, so the schema says
    # it and anything else is a 400 naming the field (docs/api.md lists them)
    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = ("stream", "stream_options", "tools", "tool_choice",
                                                 "use_beam_search", "length_penalty", "prompt_logprobs")
    stream: Annotated[Literal[False], BeforeValidator(_bool_only)] = False
    stream_options: None = None
    tools: None = None
    tool_choice: Literal["none"] | None = None
    use_beam_search: Annotated[Literal[False], BeforeValidator(_bool_only)] = False
    length_penalty: Annotated[float, Field(ge=1.0, le=1.0)] = 1.0
    prompt_logprobs: None = None
    n: Int(ge=1, le=1) = 1

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with every other field as given (already validated)."""
        shared = {k: getattr(self, k) for k in ChatCompletionRequest.model_fields if k != "messages"}
        return [ChatCompletionRequest.model_construct(self.model_fields_set, messages=m, **shared)
                for m in self.messages]


def _template_flags(req) -> None:
    """``continue_final_message`` with ``add_generation_prompt`` left at its default turns the
    latter off (they cannot both hold, as vLLM); both given true is a 400."""
    if req.continue_final_message:
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise ValueError("continue_final_message: cannot be true together with add_generation_prompt")
        req.add_generation_prompt = False


class TokenizeRequest(_Request):
    # exactly one of ``prompt`` or ``messages``, given and not null (the route checks it; the schema says it)
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # with messages: rendered as the chat route renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM's: each token's string (the vocabulary's spelling) as token_strs

    @model_validator(mode="after")
    def _continue_or_prompt(self):
        _template_flags(self)
        return self

    def template_kwargs(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them; InvalidRequest naming a role or content that
    is not valid UTF-8 (the tokenizer would raise a TypeError on it). A participant's ``name``, an
    assistant's ``tool_calls`` (arguments parsed from their JSON text, as templates take them) and
    a tool message's ``tool_call_id`` go to the template too: templates that render them do."""
    out = []
    for i, m in enumerate(messages):
        message: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        for key, text in list(message.items()):
            require_utf8(text, f"messages.{i}.{key}")
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": tool_arguments(c.function.arguments, f"messages.{i}")}}
                for c in m.tool_calls]
        out.append(message)
    return out


def tool_arguments(text: str, where: str) -> dict:
    """A tool call's ``arguments`` string as the JSON object it must be (InvalidRequest otherwise)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}.tool_calls: arguments must be a JSON object as a string, got {text[:80]!r}")
    return value
