"""Tool calling (issue 22, item 2) with the official ``openai`` client against the real ``pagedllm
serve`` (SmolLM2, whose template renders no tools, so they go in a Hermes system prompt):
``required`` and named calls are made by the grammar engine, so each parses and validates against
its function's schema, streamed or not; a two-step call -> result -> answer; refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": CITY}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_valid_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_a_required_call_is_made_and_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=60, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, temperature=0.9, seed=3, n=3)
    for c in single.choices:
        assert len(c.message.tool_calls) == 1
        assert_valid_calls(c.message.tool_calls)


def test_a_named_call_streams_its_arguments_as_they_come_and_adds_up_to_the_whole(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=0).choices[0]
    assert_valid_calls(whole.message.tool_calls, names=("get_time",))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=60, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    first, *more = deltas
    assert (first.index, first.type, first.function.name) == (0, "function", "get_time") and first.id
    assert len(more) > 2 and all(d.index == 0 and d.id is None and d.function.name is None for d in more)
    (call,) = whole.message.tool_calls
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_a_call_its_result_and_the_answer(client, server):
    """The two steps of a tool call: the model's call, then the history with it and the tool's
    result, rendered into the prompt (Hermes blocks for this template)."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=12,
                                            temperature=0, extra_body={"return_token_ids": True})
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": answer.prompt_token_ids}).json()["prompt"]
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the tools, listed in the system prompt
    arguments = json.dumps(json.loads(call.function.arguments))  # the model's text of them, re-written
    assert f'"name": "{call.function.name}", "arguments": {arguments}' in prompt  # the call
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt  # its result


def test_tool_choice_refusals(client, server):
    for body, param in (({"tool_choice": "required"}, "tool_choice"),  # no tools
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad_history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": bad_history, "tools": TOOLS})
    assert r.status_code == 400 and "arguments must be a JSON object" in r.json()["error"]["message"]


def test_tokenize_with_tools_counts_the_prompt_the_chat_route_sends(client, server):
    """``/tokenize`` with ``tools`` renders them as the chat route does (here: the Hermes system
    prompt), so its count is the prompt's; it was a 400 (no such field)."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=strict, max_tokens=1, temperature=0,
                                          extra_body={"return_token_ids": True})
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": ASK, "tools": strict})
    assert got.status_code == 200 and got.json()["tokens"] == chat.prompt_token_ids
    plain = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": ASK}).json()
    assert plain["count"] < got.json()["count"]
