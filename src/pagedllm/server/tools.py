"""Tool calling on ``/v1/chat/completions``: rendering the tools, making or finding the calls.

What a request's ``tools`` and ``tool_choice`` become (``ToolPlan.of``):

- **rendering**: a chat template that takes ``tools`` (Qwen2.5's does) renders them, and the
  history's ``tool_calls`` and ``role: tool`` messages, itself. One that does not (SmolLM2's) gets
  a system prompt listing the tools in the Hermes format (``TOOLS_PROMPT``), the history's calls
  written into the assistant turns as ``<tool_call>`` blocks, and tool results wrapped in
  ``<tool_response>``; ``--chat-template`` may replace the template.
- **``required`` / a named function**: the calls are *made*: the output is constrained by the
  grammar engine to a JSON array of calls (``required``; one call when ``parallel_tool_calls`` is
  false) or to the one named call, each ``{"name", "arguments"}`` with the arguments following
  the function's JSON schema, so every call parses and validates.
- **``auto``**: the output is free and the calls are *found* in it by the tool-call parser
  (``--tool-call-parser``): ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks, as Qwen2.5 and Hermes models write them; text before them is the content) or ``json``
  (the whole output one call object or an array of them). A block that does not parse stays text.
- **``none``** (the default without tools): the tools are rendered, nothing is parsed.

A call's ``arguments`` are sent as a JSON string, as OpenAI sends them; the finish reason of a
choice with calls is ``tool_calls``. Streamed (``ToolStream``), content is sent as it comes until
a call may be starting; calls are sent whole at the end, one ``tool_calls`` delta each.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedllm.engine.sampling_params import StructuredOutputsParams
from pagedllm.errors import InvalidRequest
from pagedllm.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool

TOOL_CALL_PARSERS = ("hermes", "json")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

# The system prompt that lists the tools where the chat template cannot (our own words, in the
# Hermes layout that instruction-tuned models know: the signatures in <tools>, calls in <tool_call>)
TOOLS_PROMPT = (
    "You can call functions to help answer the user. Their signatures, one JSON object per line, are "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with a JSON object holding "
    "the function's name and its arguments inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>')


def template_takes_tools(tokenizer) -> bool:
    """Whether the chat template renders a ``tools`` list itself."""
    return "tools" in (getattr(tokenizer.hf, "chat_template", None) or "")


def call_block(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def hermes_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """The conversation for a template without tools: the tools listed in the system prompt,
    calls and results written as text in the Hermes layout (``hermes_turns``)."""
    listed = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                                                 for t in tools))
    out = hermes_turns(messages)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listed}"}
    else:
        out.insert(0, {"role": "system", "content": listed})
    return out


def hermes_turns(messages: list[dict]) -> list[dict]:
    """An assistant turn's ``tool_calls`` as ``<tool_call>`` blocks after its content, and a
    ``tool`` message's content in ``<tool_response>``: for a template that renders neither."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    return out


def history_for(tokenizer, messages: list[dict]) -> list[dict]:
    """A conversation without ``tools`` in the request, for this tokenizer's template: as it is
    where the template renders tools (and so their calls), else its calls and results as Hermes
    text (``hermes_turns``), so that no turn of the history is dropped from the prompt (SmolLM2's
    template renders neither ``tool_calls`` nor their arguments)."""
    if template_takes_tools(tokenizer) or not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    return hermes_turns(messages)


def _call_schema(tool: Tool) -> dict:
    parameters = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools make of the generation and its answer."""

    tools: tuple[Tool, ...]
    choice: str            # "none", "auto", "required" or "named"
    named: str | None      # the function a named tool_choice forces
    parallel: bool
    parser: str            # the tool-call parser for "auto"

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: str) -> ToolPlan | None:
        """The plan of a request, None without tools (a ``tool_choice`` then is a 400)."""
        if not req.tools:
            if req.tool_choice not in (None, "none"):
                raise InvalidRequest("tool_choice: needs tools")
            return None
        choice = req.tool_choice or "auto"
        named = None
        if isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in {t.function.name for t in req.tools}:
                raise InvalidRequest(f"tool_choice: the function {named!r} is not among the tools")
            choice = "named"
        if choice in ("required", "named") and (req.response_format is not None or req.structured_outputs):
            raise InvalidRequest("tool_choice: a required or named tool call cannot be combined with "
                                 "response_format or structured_outputs")
        return cls(tuple(req.tools), choice, named, req.parallel_tool_calls, parser)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the calls (``required``, named), or None (the output is free)."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return StructuredOutputsParams(json=_call_schema(tool))
        if self.choice == "required":
            items = {"anyOf": [_call_schema(t) for t in self.tools]}
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": items,
                                                 **({} if self.parallel else {"maxItems": 1})})
        return None

    def render(self, tokenizer, messages: list[dict]) -> tuple[list[dict], dict]:
        """(messages, extra template arguments) that show the tools to the model."""
        if template_takes_tools(tokenizer):
            return messages, {"tools": [t.model_dump(exclude_none=True) for t in self.tools]}
        return hermes_messages(messages, list(self.tools)), {}

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a finished output; calls as OpenAI's ``tool_calls`` entries."""
        if self.choice == "none":
            return text, []
        if self.choice in ("required", "named"):
            found = _calls_from_json(text)
            return (None, found) if found else (text, [])
        if self.parser == "json":
            found = _calls_from_json(text)
            return (None, found) if found else (text, [])
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            found = _calls_from_json(block)
            if not found:
                return text, []  # a block that does not parse: the whole output stays text
            calls += found
        if not calls:
            return text, []
        content = text[:text.index(CALL_OPEN)].rstrip()
        return content or None, calls


def _calls_from_json(text: str) -> list[dict]:
    """OpenAI ``tool_calls`` from a JSON call object or an array of them; [] if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls


class ToolStream:
    """One streamed choice's text, split into content sent as it comes and calls sent at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0

    def feed(self, delta: str) -> str:
        """Add generated text; returns the content that can be sent now (never part of a call)."""
        self.text += delta
        if self.plan.choice in ("required", "named"):
            return ""  # the whole output is the calls
        if self.plan.choice == "auto" and self.plan.parser == "json" and self.text.lstrip()[:1] in ("{", "["):
            return ""  # may be a call: held to the end
        safe = self._safe_end()
        if self.plan.choice != "none":  # trailing whitespace waits: before a call it is not content
            while safe > self.sent and self.text[safe - 1].isspace():
                safe -= 1
        out = self.text[self.sent:safe]
        self.sent = max(self.sent, safe)
        return out

    def _safe_end(self) -> int:
        """How far the text is surely content: up to a call's opening tag, or to a tail that
        could still become one."""
        if self.plan.choice == "none":
            return len(self.text)
        opened = self.text.find(CALL_OPEN)
        if opened >= 0:
            return opened
        for keep in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
            if CALL_OPEN.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def finish(self) -> tuple[str, list[dict]]:
        """(the content still to send, the calls) once the choice has finished."""
        content, calls = self.plan.split(self.text)
        if not calls:
            return self.text[self.sent:], []
        rest = (content or "")[self.sent:] if content and len(content) > self.sent else ""
        return rest, calls
