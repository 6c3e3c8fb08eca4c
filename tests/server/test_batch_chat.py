"""vLLM's ``POST /v1/chat/completions/batch`` (issue 22, item 3) with the official ``openai`` client
against the real ``pagedllm serve`` of tests/server/conftest.py (the embedded SmolLM2 in float32):
``messages`` a list of conversations, one choice per conversation, each the answer
``/v1/chat/completions`` gives it alone; what the route does not take is a 400 naming the field,
and a batch with one bad conversation queues none of them."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

MODEL = "smollm"
CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a fruit."}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One,"}],
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def batch(client, **body) -> ChatCompletion:
    return client.post("/chat/completions/batch", body={"model": MODEL, **body}, cast_to=ChatCompletion)


def test_each_conversation_is_answered_as_alone(client):
    common = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    got = batch(client, messages=CONVERSATIONS, return_token_ids=True, **common)
    alone = [client.chat.completions.create(model=MODEL, messages=m, extra_body={"return_token_ids": True}, **common)
             for m in CONVERSATIONS]
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, single in zip(got.choices, alone, strict=True):
        (expected,) = single.choices
        assert choice.message.content == expected.message.content and choice.message.role == "assistant"
        assert choice.finish_reason == expected.finish_reason
        assert choice.token_ids == expected.token_ids and choice.token_ids
        assert choice.prompt_token_ids == single.prompt_token_ids  # per choice: one body, N prompts
        assert [t.token for t in choice.logprobs.content] == [t.token for t in expected.logprobs.content]
        assert [len(t.top_logprobs) for t in choice.logprobs.content] == [2] * len(choice.token_ids)
    assert got.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)
    completion = sum(s.usage.completion_tokens for s in alone)
    assert got.usage.completion_tokens == completion and got.usage.total_tokens == got.usage.prompt_tokens + completion
    assert len({c.message.content for c in got.choices}) == 3  # three different conversations, three answers


def test_the_chat_fields_apply_to_every_conversation(client):
    """``echo`` and ``continue_final_message`` act per conversation as on the chat route; without
    ``return_token_ids`` no ids are sent."""
    continued = CONVERSATIONS[2]
    got = batch(client, messages=[CONVERSATIONS[0], continued], max_tokens=4, temperature=0, echo=True,
                add_generation_prompt=False, continue_final_message=True)
    alone = client.chat.completions.create(model=MODEL, messages=continued, max_tokens=4, temperature=0,
                                           extra_body={"echo": True, "add_generation_prompt": False,
                                                       "continue_final_message": True})
    assert got.choices[1].message.content == alone.choices[0].message.content
    assert got.choices[1].message.content.startswith("One,")
    assert got.choices[0].model_dump().get("token_ids") is None and got.choices[1].logprobs is None


@pytest.mark.parametrize("field,value", [("stream", True), ("n", 2), ("n", True), ("use_beam_search", True),
                                         ("use_beam_search", 0),
                                         ("tool_choice", "auto"), ("prompt_logprobs", 1),
                                         ("stream_options", {"include_usage": True}),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_what_the_route_does_not_take_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as bad:
        batch(client, messages=CONVERSATIONS[:1], max_tokens=2, **{field: value})
    assert bad.value.body["param"] == field


def test_a_bad_conversation_names_its_index_and_queues_none(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        batch(client, messages=[CONVERSATIONS[0], [{"role": "user", "content": "Hi " * 10000}]], max_tokens=2)
    assert bad.value.body["param"] == "messages.1" and bad.value.body["message"].startswith("messages.1: ")
    assert bad.value.body["code"] == "context_length_exceeded"
    for messages, param in (([], "messages"), ([[]], "messages.0"), ([CONVERSATIONS[0], [{"content": "x"}]],
                                                                     "messages.1.0.role")):
        with pytest.raises(openai.BadRequestError) as bad:
            batch(client, messages=messages, max_tokens=2)
        assert bad.value.body["param"] == param, messages
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}  # nothing was left queued
