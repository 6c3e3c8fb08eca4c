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
                                         ("use_beam_search", 0), ("length_penalty", 2.0),
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


TOOL_TURN = [
    {"role": "user", "name": "ann", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]
GREEDY = {"temperature": 0, "max_completion_tokens": 8}
# bodies that set every field the batch route takes; each conversation must get from the batch
# what the chat route gives it alone (whose own tests check each field's effect)
EVERY_FIELD = {
    "penalties, stops, bias, truncation, no-ops": {
        **GREEDY, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
        "logit_bias": {"198": -5.0}, "stop": [" the"], "stop_token_ids": [30], "min_tokens": 2,
        "ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True, "cache_salt": "s1",
        "seed": 3, "truncate_prompt_tokens": 40, "parallel_tool_calls": True, "n": 1, "user": "u-1",
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "max_tokens": 12},
    "json schema": {**GREEDY, "max_completion_tokens": 16, "response_format": {"type": "json_schema", "json_schema": {
        "name": "colour", "strict": True, "schema": {"type": "object", "properties": {"c": {"type": "string"}},
                                                     "required": ["c"]}}}},
    "choice": {**GREEDY, "structured_outputs": {"choice": ["red", "blue", "green"]}},
    "allowed and named tokens, cut from the right": {
        **GREEDY, "allowed_token_ids": [42, 77, 2], "logprobs": True, "logprob_token_ids": [42, 5000],
        "return_tokens_as_token_ids": True, "truncate_prompt_tokens": 30, "truncation_side": "right",
        "bad_words": ["blue"]},
}


@pytest.mark.parametrize("fields", list(EVERY_FIELD.values()), ids=list(EVERY_FIELD))
def test_every_field_reaches_each_conversation_as_on_the_chat_route(client, fields):
    conversations = [CONVERSATIONS[0], TOOL_TURN]
    got = batch(client, messages=conversations, **fields)
    for choice, messages in zip(got.choices, conversations, strict=True):
        alone = client.chat.completions.create(model=MODEL, messages=messages, extra_body=fields)
        assert (choice.message.content, choice.finish_reason) == \
            (alone.choices[0].message.content, alone.choices[0].finish_reason), fields


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_sampling_cut_to_the_top_token_equals_greedy_in_every_conversation(client, cut):
    """``top_k`` 1, a tiny ``top_p`` or ``min_p`` 1 leave only the most likely token: sampled at
    temperature 1, each conversation's answer is its greedy one (a field dropped on the way would
    sample from the whole vocabulary instead)."""
    sampled = batch(client, messages=CONVERSATIONS, temperature=1.0, seed=11, max_tokens=8, **cut)
    greedy = batch(client, messages=CONVERSATIONS, temperature=0, max_tokens=8)
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in greedy.choices]
