"""Finding tool calls in free output (``tool_choice: auto``, ``server/tools.py``): the Hermes and
JSON parsers, the streamed split (content as it comes, calls at the end) equal to the whole one for
any chunking; made calls (``required``, named) streamed as they are generated, their argument
deltas adding up to the whole body's arguments for any chunking; and the tools rendered by a
template that takes them or listed in a system prompt."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.tools import TOOLS_PROMPT, ToolPlan, ToolStream

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def plan(parser="hermes", choice=None) -> ToolPlan:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                **({"tool_choice": choice} if choice else {}))
    return ToolPlan.of(req, parser)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def names_and_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_blocks_become_calls_and_the_text_before_them_the_content():
    content, calls = plan().split("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content == "Let me look."
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert plan().split(CALL)[0] is None
    for text in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>["x"]</tool_call>'):
        assert plan().split(text) == (text, [])  # nothing that is not a well-formed call is taken


def test_the_json_parser_takes_a_whole_output_call_or_an_array():
    one = '{"name": "get_weather", "parameters": {"city": "Rome"}}'  # "parameters", as some models write
    assert names_and_args(plan("json").split(one)[1]) == [("get_weather", {"city": "Rome"})]
    assert len(plan("json").split(f"[{one}, {one}]")[1]) == 2
    assert plan("json").split("The weather is fine.") == ("The weather is fine.", [])
    assert plan("json", "none").split(one) == (one, [])  # tool_choice none: nothing is parsed


outputs = st.sampled_from(["Let me look.\n" + CALL, CALL, "plain text, no call", "a <tool_ almost", "x <tool_call",
                           "two\n" + CALL + "\n" + CALL, "<tool_call>{bad}</tool_call> trailing", "  spaced  \n"])


@given(text=outputs, cuts=st.lists(st.integers(0, 200), max_size=8), parser=st.sampled_from(["hermes", "json"]))
def test_streamed_content_and_calls_equal_the_whole_split(text, cuts, parser):
    p = plan(parser)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, sent = ToolStream(p), ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        sent += stream.feed(text[a:b])
        assert "<tool_call>" not in sent or not p.split(text)[1]  # never a call's text sent as content
    rest, calls = stream.finish()
    content, expected = p.split(text)
    assert names_and_args(calls) == names_and_args(expected)
    assert sent + rest == (text if not expected else content or "")


MADE = [  # outputs the grammar lets through for required (an array) and named (one object) calls
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '[ {"name":"get_weather","arguments":{"city":"Pa\\"ri}s{", "n": [1, {"name": "x"}]}} ,\n'
    ' {"arguments": {"city": "Oslo"}, "name": "get_time"} ]',
    '{"name": "get_time", "arguments": {}}',
    '{"name": "get_time", "arguments": {"a": {"b": {"c": "}]\\\\"}}, "d": -1.5e3}}',
]


@given(text=st.sampled_from(MADE), cuts=st.lists(st.integers(0, 120), max_size=10),
       choice=st.sampled_from(["required", {"type": "function", "function": {"name": "get_weather"}}]))
def test_made_calls_stream_deltas_that_add_up_to_the_whole_calls(text, cuts, choice):
    p = plan("hermes", choice)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, content, deltas = ToolStream(p), "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        content += stream.feed(text[a:b])
        got = stream.call_deltas()
        assert len({d["index"] for d in got}) == len(got)  # one entry per call in a chunk
        deltas += got
    rest, more = stream.finish()
    deltas += more
    assert content + rest == ""
    whole = p.split(text)[1]
    built: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in built:  # a call's first delta: id, type, name
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            built[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        built[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(built) == list(range(len(whole)))
    assert [(b["name"], b["arguments"]) for _, b in sorted(built.items())] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert [c["id"] for c in stream.calls] == [b["id"] for _, b in sorted(built.items())]
    for c in whole:  # the arguments are the model's own text of them, and they parse
        assert c["function"]["arguments"] in text and isinstance(json.loads(c["function"]["arguments"]), dict)


def test_a_made_call_cut_short_streams_what_was_generated():
    p = plan("hermes", "required")
    stream = ToolStream(p)
    stream.feed('[{"name": "get_weather", "arguments": {"city": "Pa')
    first = stream.call_deltas()
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert stream.finish() == ("", []) and stream.calls == []  # cut: no whole call, nothing more to send
    early = ToolStream(p)
    early.feed('[{"na')
    assert early.call_deltas() == [] and early.finish() == ('[{"na', [])  # no name yet: the text is content


class _Tok:
    def __init__(self, template):
        self.hf = type("HF", (), {"chat_template": template})()


def test_tools_go_to_a_template_that_takes_them_else_into_a_system_prompt():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}]},
                {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    same, extra = plan().render(_Tok("{% for t in tools %}{{ t }}{% endfor %}"), messages)
    assert same == messages and extra["tools"][0]["function"]["name"] == "get_weather"
    listed, extra = plan().render(_Tok("{{ messages }}"), messages)
    assert extra == {} and listed[0]["role"] == "system"
    assert listed[0]["content"] == TOOLS_PROMPT.format(tools=json.dumps(TOOLS[0]))
    assert listed[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>'
    assert "tool_calls" not in listed[2] and listed[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
