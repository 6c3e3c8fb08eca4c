"""Strict requests (issue 22): a field a route does not implement is a 400 ``unsupported_parameter``
naming it, never silently ignored; the documented no-ops are accepted and change nothing; the
fields of every route are one list (``server/fields.py``) and docs/api.md's table is made from it.
The official ``openai`` client against the real ``pagedllm serve`` of tests/server/conftest.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.server.fields import ROUTES, fields_markdown, refused_fields, route_fields

MODEL = "smollm"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as bad:
        call()
    return bad.value.body


def test_an_unimplemented_field_is_a_400_naming_it(client):
    """These were accepted and ignored: a 200 that did something else than asked."""
    legacy = [w["function"] for w in WEATHER]  # OpenAI's deprecated function calling: not implemented
    body = refused(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, functions=legacy,
                                                          max_tokens=4))
    assert (body["code"], body["param"]) == ("unsupported_parameter", "functions")
    assert "'functions'" in body["message"] and "POST /v1/chat/completions" in body["message"]
    body = refused(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                                     extra_body={"guided_json": {"type": "object"}, "priority": 1}))
    assert body["code"] == "unsupported_parameter" and body["param"] == "guided_json"  # vLLM's old name
    assert "'guided_json', 'priority'" in body["message"] and "parameters" in body["message"]


def test_a_nested_unknown_field_is_named_with_its_path(client, server):
    messages = [{"role": "user", "content": "Hi", "audio": {"id": "a1"}}]
    body = refused(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4))
    assert (body["code"], body["param"]) == ("unsupported_parameter", "messages.0.audio")
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True,
                                                          "stream_options": {"include_usage": True, "x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x"
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hi", "chat_template": "{{ x }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_the_documented_no_ops_change_nothing(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    with_no_ops = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 user="u-1", metadata={"k": "v"}, store=False, service_tier="auto")
    assert with_no_ops.choices[0].message.content == plain.choices[0].message.content
    body = refused(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, store=True))
    assert body["param"] == "store"  # a stored completion could not be fetched back: refused, not ignored


def test_stream_options_need_a_stream(client):
    """OpenAI refuses ``stream_options`` without ``stream: true``; it was answered 200."""
    body = refused(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                     stream_options={"include_usage": True}))
    assert body["param"] == "stream_options" and "stream is true" in body["message"]
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def test_models_retrieve_names_the_served_model(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/other-model")
    assert missing.value.body["code"] == "model_not_found"


def test_the_docs_field_table_is_generated_from_the_route_models():
    text = DOCS.read_text()
    start, end = "<!-- fields:start -->\n", "<!-- fields:end -->"
    assert text[text.index(start) + len(start):text.index(end)] == fields_markdown(), \
        "regenerate it: python -m pagedllm.server.fields, paste into docs/api.md"


def test_every_listed_route_is_served_and_takes_exactly_its_fields(server):
    """Each route of ``ROUTES`` exists with that method, and its OpenAPI body schema (what clients
    see) has the listed top-level fields and refuses others (``additionalProperties: false``)."""
    schema = httpx.get(server.url + "/openapi.json").json()
    for route, model in ROUTES.items():
        method, path = route.split(" ")
        body = schema["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        ref = body["$ref"].rsplit("/", 1)[1]
        component = schema["components"]["schemas"][ref]
        top_level = {f for f in route_fields(model) if "." not in f} | set(refused_fields(model))  # narrowed
        assert set(component["properties"]) == top_level, route
        assert component.get("additionalProperties") is False, route


@pytest.fixture(scope="module")
def proxied(tiny_folder):
    """A server behind a path-based proxy (``--root-path /llm``) with a key and vLLM's metric names."""
    from tests.server.conftest import ServerProcess

    proc = ServerProcess(str(tiny_folder), "--dtype", "float32", "--num-kv-blocks", "64", "--root-path", "/llm",
                         "--api-key", "sk-proxy", "--metrics-prefix", "vllm", "--served-model-name", "tiny")
    yield proc
    proc.stop()


def test_root_path_serves_both_paths_and_keeps_the_key_guard(proxied):
    """As vLLM's ``--root-path`` test: ``/llm/v1`` and ``/v1`` both answer, and both need the key."""
    for base in ("/v1", "/llm/v1"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxied.url + base, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=proxied.url + base, api_key="sk-proxy", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["tiny"]
        assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.post(proxied.url + "/llm/tokenize", json={"prompt": "Hi"}).status_code == 401  # guarded too
    for path in ("/invocations", "/llm/invocations"):  # it generates: guarded here (vLLM leaves it open)
        assert httpx.post(proxied.url + path, json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
    assert httpx.get(proxied.url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_vllm_metric_names_carry_the_model_name(proxied):
    """Dashboards built for vLLM's ``vllm:*`` series (with its ``model_name`` label) read these."""
    text = httpx.get(proxied.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert f'vllm:{name}{{model_name="tiny"}}' in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text
    assert "pagedllm:" not in text


def test_tokenizer_info_describes_the_served_tokenizer(server, smollm_fp32):
    info = httpx.get(server.url + "/tokenizer_info").json()
    hf = smollm_fp32.get_tokenizer().hf
    assert info["tokenizer_class"] == type(hf).__name__ and info["chat_template"] == hf.chat_template
    assert info["vocab_size"] == len(hf) and info["eos_token"] == hf.eos_token


def test_invocations_route_a_chat_or_a_completion_body(server, client):
    """SageMaker's ``/invocations`` (as vLLM serves it) answers a body as its own route would."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    for body, route in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        via, direct = (httpx.post(server.url + path, json=body, timeout=60).json()
                       for path in ("/invocations", route))
        assert via["object"] == direct["object"] and via["choices"][0].get("text") == direct["choices"][0].get("text")
        assert via["choices"][0].get("message") == direct["choices"][0].get("message")
    for body, param in (({"neither": 1}, None), ({**completion, "tools": []}, "tools"), ({**chat, "n": 0}, "n")):
        r = httpx.post(server.url + "/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}  # idle: nothing admitted
