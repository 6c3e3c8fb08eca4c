"""``POST /v1/responses`` (issue 22, item 3) with the official ``openai`` client against the real
``pagedllm serve`` (SmolLM2 in float32: greedy answers equal the chat route's): text or item input,
instructions, max_output_tokens, text.format json_schema, function tools, streaming events, and
previous_response_id over the bounded store."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm"
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
          "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_text_input_answers_as_the_chat_route(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    cut = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_json_schema_format_and_item_input(client):
    r = client.responses.create(model=MODEL, max_output_tokens=40, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Give a colour as JSON."}]}],
        text={"format": {"type": "json_schema", "name": "colour", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_streamed_events_add_up_to_the_response(client):
    events = list(client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    whole = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0)
    assert deltas == done.text == events[-1].response.output_text == whole.output_text
    for kind in ("response.output_item.added", "response.content_part.added", "response.content_part.done",
                 "response.output_item.done"):
        assert kind in kinds


def test_function_calls_and_their_output_continue_a_stored_response(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", max_output_tokens=60, temperature=0, store=True)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, max_output_tokens=10,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"celsius": 21}'}], temperature=0)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens  # the first exchange is in its prompt
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)  # store: false by default
    with pytest.raises(openai.BadRequestError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(model=MODEL, input="Hi", extra_body={"reasoning": {"effort": "low"}})
    assert unknown.value.body["code"] == "unsupported_parameter"


def test_a_stored_response_is_retrieved_and_deleted(client):
    stored = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0,
                                     store=True)
    again = client.responses.retrieve(stored.id)
    assert again.model_dump() == stored.model_dump()
    streamed = [e for e in client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=4,
                                                   temperature=0, store=True, stream=True)]
    final = streamed[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    deleted = client.responses.delete(stored.id)  # the SDK returns None; the body is checked raw below
    assert deleted is None
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(stored.id)
    assert gone.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError):  # nor can a conversation continue from it
        client.responses.create(model=MODEL, input="Hi", previous_response_id=stored.id)
    raw = client.with_raw_response.responses.delete(final.id)
    assert raw.http_response.json() == {"id": final.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(final.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True)
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.responses.retrieve(stored.id, include=["message.output_text.logprobs"])
    assert (unsupported.value.body["code"], unsupported.value.body["param"]) == ("unsupported_parameter",
                                                                                   "include")


def test_a_method_the_stored_response_path_lacks_is_a_405_naming_both(server):
    r = httpx.request("PUT", server.url + "/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["Allow"] == "DELETE, GET"  # Starlette named only the first route's
