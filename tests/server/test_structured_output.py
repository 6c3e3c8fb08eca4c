"""Structured output through the server: ``response_format`` (``json_object``, ``json_schema``) on
both routes and vLLM's ``structured_outputs`` extension, with the official ``openai`` client.
Outputs must parse and validate against their schema (``jsonschema``) and finish with ``stop``;
a bad schema is a 400 naming ``response_format``; constrained and free requests share a batch
without changing the free ones' text."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "sky": {"enum": ["sunny", "cloudy", "rain"]},
                       "hot": {"type": "boolean"}},
        "required": ["city", "sky", "hot"], "additionalProperties": False,
    },
    "list_of_points": {
        "type": "array", "maxItems": 2, "minItems": 1,
        "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                  "required": ["x", "y"], "additionalProperties": False},
    },
}

PROMPTS = {
    "person": "Describe a fictional person as JSON with a name and an age.",
    "tags": "Give up to three short tags for a blog post about cooking pasta, as JSON.",
    "weather": "Report the weather in Paris as JSON.",
    "list_of_points": "Give two points on a line as a JSON list of objects with x and y.",
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_outputs_validate(client, name):
    r = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": PROMPTS[name]}],
                                       temperature=0, max_tokens=200, response_format=_json_schema_format(name))
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert r.usage.completion_tokens > 0


def test_completions_json_schema_sampled_n2_validate(client):
    r = client.completions.create(model="smollm", prompt="A person as JSON:", max_tokens=200, n=2, seed=7,
                                  temperature=0.8, extra_body={"response_format": _json_schema_format("person")})
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMAS["person"])


def test_streamed_json_schema_deltas_add_up_to_valid_json(client):
    stream = client.chat.completions.create(
        model="smollm", messages=[{"role": "user", "content": PROMPTS["weather"]}], temperature=0, max_tokens=200,
        response_format=_json_schema_format("weather"), stream=True)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["weather"])


def test_json_object_gives_an_object_on_both_routes(client):
    chat = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "A cat as JSON."}],
                                          temperature=0, max_tokens=120,
                                          response_format={"type": "json_object"})
    text = client.completions.create(model="smollm", prompt="A dog as JSON:", temperature=0, max_tokens=120,
                                     extra_body={"response_format": {"type": "json_object"}})
    for out, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                        (text.choices[0].text, text.choices[0].finish_reason)):
        if finish == "stop":  # an object can be unbounded: then it is cut by max_tokens, still a prefix
            assert isinstance(json.loads(out), dict)
        else:
            assert finish == "length" and out.lstrip().startswith("{")


def test_vllm_structured_outputs_choice(client):
    r = client.completions.create(model="smollm", prompt="Is the sky blue? Answer:", temperature=0, max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"


def test_text_format_is_unconstrained_and_equal_to_no_format(client):
    kwargs = dict(model="smollm", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kwargs)
    text = client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert plain.choices[0].message.content == text.choices[0].message.content


@pytest.mark.parametrize("body, fragment", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}}},
     "response_format.json_schema.schema is invalid"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a"}}},
     "response_format.json_schema.schema is invalid"),
    ({"type": "xml"}, "response_format.type"),
])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_bad_response_format_is_a_400_naming_it(server, route, body, fragment):
    payload = {"model": "smollm", "max_tokens": 5, "response_format": body}
    payload.update({"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"})
    r = httpx.post(f"{server.url}/v1/{route}", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"].startswith("response_format")
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("extension, fragment", [
    ({"regex": "[a-"}, "structured_outputs.regex is invalid"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": {"type": "object"}, "regex": "a+"}, "structured_outputs takes one constraint"),
    ({"shape": "round"}, "unknown key(s) shape"),
])
def test_bad_structured_outputs_is_a_400(server, extension, fragment):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "smollm", "prompt": "hi", "max_tokens": 5, "structured_outputs": extension})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"] and r.json()["error"]["param"] == "structured_outputs"


def test_free_requests_keep_their_text_next_to_constrained_ones(server, client):
    """Greedy free requests give the same text alone and sharing batches with schema-constrained ones."""
    free_prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    alone = [client.completions.create(model="smollm", prompt=p, temperature=0, max_tokens=24).choices[0].text
             for p in free_prompts]

    async def mixed():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        free = [aclient.completions.create(model="smollm", prompt=p, temperature=0, max_tokens=24)
                for p in free_prompts]
        constrained = [aclient.chat.completions.create(
            model="smollm", messages=[{"role": "user", "content": PROMPTS[n]}], temperature=0, max_tokens=200,
            response_format=_json_schema_format(n)) for n in sorted(SCHEMAS)]
        results = await asyncio.gather(*free, *constrained)
        await aclient.close()
        return results

    results = asyncio.run(mixed())
    assert [r.choices[0].text for r in results[:len(free_prompts)]] == alone
    for name, r in zip(sorted(SCHEMAS), results[len(free_prompts):], strict=True):
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
