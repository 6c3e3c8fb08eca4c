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

A call's ``arguments`` are sent as a JSON string, as OpenAI sends them: the model's own text of
the arguments object (``CallScanner`` finds its span; it parses, or the output is no call). The
finish reason of a choice with calls is ``tool_calls``. Streamed (``ToolStream``), content is sent
as it comes until a call may be starting. ``required`` and named calls stream as OpenAI streams
them: a call's first delta holds its ``id``, ``type`` and ``function.name`` once the name has been
generated, then each chunk adds the new text of its ``function.arguments`` (the grammar guarantees
they parse; a call cut by ``max_tokens`` ends with finish reason ``length`` and its arguments
unfinished, where the whole body, not streamed, gives the cut text as ``content``). ``auto`` calls
are sent whole at the end, one ``tool_calls`` delta each: a Hermes block is only known to be a
call once it has closed and parsed, and a block that does not parse is content.
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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_from_json(text: str) -> list[dict]:
    """OpenAI ``tool_calls`` from a JSON call object or an array of them; [] if it is not one.
    Each call's ``arguments`` is the model's own text of them (``CallScanner``), so a streamed
    call's argument deltas add up to exactly what the whole body holds."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    scanner = CallScanner()
    scanner.feed(text)
    spans = scanner.calls if len(scanner.calls) == len(items) else []
    calls = []
    for j, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        raw = scanner.arguments(j, text) if spans and spans[j].args_end is not None else ""
        calls.append({"id": _call_id(), "type": "function", "function": {
            "name": item["name"], "arguments": raw if raw else json.dumps(arguments, ensure_ascii=False)}})
    return calls


@dataclass
class ScannedCall:
    """Where one call's parts lie in the text: its name once its string has closed, and the span of
    its arguments value (``args_end`` None while that value is still open)."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


class CallScanner:
    """Reads a JSON call object, or an array of them, as it is generated, a character at a time
    and each character once: the state of strings, escapes and nesting, and per call the name and
    the span of the ``arguments`` (or ``parameters``) value. It finds where things are and does not
    validate: ``_calls_from_json`` parses the finished text."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.pos = 0
        self.stack: list[str] = []
        self.call_depth: int | None = None  # the nesting of a call object: 1 alone, 2 in an array
        self.in_string = self.escape = False
        self.string_start = 0
        self.expect: str | None = None      # in a call object: "key", "value" or None (":" or "," next)
        self.key: str | None = None
        self.value_key: str | None = None   # the key whose value is being read at the call's level
        self.calls: list[ScannedCall] = []

    def arguments(self, index: int, text: str, skip: int = 0) -> str:
        """Call ``index``'s arguments text so far (the whole value once it has closed), from its
        ``skip``-th character on (what a stream has not sent yet)."""
        call = self.calls[index]
        if call.args_start is None:
            return ""
        return text[call.args_start + skip:call.args_end if call.args_end is not None else self.pos]

    def _at_call_level(self) -> bool:
        return self.call_depth is not None and len(self.stack) == self.call_depth

    def feed(self, text: str) -> None:
        """Reads ``text`` (all generated so far) from where the last call stopped."""
        for i in range(self.pos, len(text)):
            self._char(text, i, text[i])
        self.pos = len(text)

    def _char(self, text: str, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self._string_closed(text, i)
            return
        if c.isspace():
            return
        if self.call_depth is None:
            self.call_depth = 2 if c == "[" else 1
        level = self._at_call_level()
        if level and self.expect == "value":
            self.expect = None
            if self.value_key in self.ARGUMENT_KEYS and self.calls and self.calls[-1].args_start is None:
                self.calls[-1].args_start = i
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.stack.append(c)
            if c == "{" and self._at_call_level():
                self.calls.append(ScannedCall())
                self.expect = "key"
        elif c in "}]":
            if level and self.value_key in self.ARGUMENT_KEYS:  # a bare value ends at the call's close
                self._end_arguments(i)
            if self.stack:
                self.stack.pop()
            if self._at_call_level() and self.value_key in self.ARGUMENT_KEYS:  # an object value closed
                self._end_arguments(i + 1)
        elif level and c == ":":
            self.expect, self.value_key = "value", self.key
        elif level and c == ",":
            if self.value_key in self.ARGUMENT_KEYS:
                self._end_arguments(i)
            self.expect, self.value_key = "key", None

    def _string_closed(self, text: str, i: int) -> None:
        if not self._at_call_level():
            return
        value = text[self.string_start:i + 1]
        if self.expect == "key":
            self.key, self.expect = json.loads(value), None
        elif self.value_key == "name" and self.calls and self.calls[-1].name is None:
            self.calls[-1].name = json.loads(value)
        elif self.value_key in self.ARGUMENT_KEYS:
            self._end_arguments(i + 1)

    def _end_arguments(self, end: int) -> None:
        call = self.calls[-1] if self.calls else None
        if call is not None and call.args_start is not None and call.args_end is None:
            call.args_end = end
        self.value_key = None


class ToolStream:
    """One streamed choice's text, split into content sent as it comes and calls: made calls
    (``required``, named) streamed as they are generated (``call_deltas``), found ones (``auto``)
    sent at the end. ``calls`` holds the whole calls once ``finish`` has run."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0
        self.scanner = CallScanner() if plan.choice in ("required", "named") else None
        self.ids: list[str] = []         # the calls streamed so far, by index
        self.args_sent: list[int] = []   # how much of each one's arguments has been sent
        self.calls: list[dict] = []

    def call_deltas(self) -> list[dict]:
        """The ``tool_calls`` delta entries for what has been generated since the last call (made
        calls only): a call's first holds its id, type and name, later ones the new arguments text."""
        if self.scanner is None:
            return []
        self.scanner.feed(self.text)
        out = []
        for j, call in enumerate(self.scanner.calls):
            if call.name is None:
                break  # the calls go out in order, each once its name is known
            first = j == len(self.ids)
            if first:
                self.ids.append(_call_id())
                self.args_sent.append(0)
            new = self.scanner.arguments(j, self.text, skip=self.args_sent[j])  # only what is not sent yet
            self.args_sent[j] += len(new)
            if first:
                out.append({"index": j, "id": self.ids[j], "type": "function",
                            "function": {"name": call.name, "arguments": new}})
            elif new:
                out.append({"index": j, "function": {"arguments": new}})
        return out

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
        """(the content still to send, the ``tool_calls`` delta entries still to send) once the
        choice has finished; ``calls`` then holds the whole calls."""
        content, calls = self.plan.split(self.text)
        if self.scanner is not None:
            deltas = self.call_deltas()
            if not self.ids:  # no call was started (cut before a name): the text is content
                return self.text[self.sent:], []
            for call, call_id in zip(calls, self.ids, strict=False):
                call["id"] = call_id
            self.calls = calls
            return "", deltas
        self.calls = calls
        if not calls:
            return self.text[self.sent:], []
        rest = (content or "")[self.sent:] if content and len(content) > self.sent else ""
        return rest, [{"index": j, **call} for j, call in enumerate(calls)]
