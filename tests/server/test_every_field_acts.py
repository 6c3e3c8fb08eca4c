"""The fields of docs/api.md's table that no other server test sent (``test_zz_every_field_is_sent``
found them), each sent here with a check that it does what the table says: on the real
``pagedllm serve`` of tests/server/conftest.py (SmolLM2 in float32, greedy = ``LLM.generate``)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm import SamplingParams

MODEL = "smollm"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
NO_OPS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
HISTORY = [  # a participant name, text parts, an assistant tool call and its result
    {"role": "user", "name": "ann", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=lambda c: next(iter(c)))
def test_a_sampling_cut_to_the_top_token_is_greedy_on_both_routes(client, cut):
    """At temperature 1 ``top_k`` 1, a tiny ``top_p`` and ``min_p`` 1 each leave only the most
    likely token, so the sample is the greedy answer (dropped, it would sample the vocabulary)."""
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
                                        extra_body=cut)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert sampled.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=5,
                                          extra_body=cut)
    chat_plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == chat_plain.choices[0].message.content
    hot = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=s)
           for s in range(4)]
    assert any(h.choices[0].message.content != chat_plain.choices[0].message.content for h in hot)  # it would


def test_special_tokens_are_kept_with_skip_special_tokens_false(client, smollm_fp32):
    """With ``ignore_eos`` the model runs past its end-of-turn token: ``skip_special_tokens``
    false keeps it in the text, on both routes, as ``LLM.generate`` does."""
    tok = smollm_fp32.get_tokenizer()
    chat_ids = tok.apply_chat_template(MESSAGES)
    for skip in (True, False):
        expected = greedy(smollm_fp32, {"prompt_token_ids": chat_ids}, max_tokens=30, ignore_eos=True,
                          skip_special_tokens=skip)
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                              extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert chat.choices[0].message.content == expected.text
        assert ("<|im_end|>" in expected.text) == (not skip)
        text = tok.decode(chat_ids)
        completion = client.completions.create(model=MODEL, prompt=text, max_tokens=30, temperature=0,
                                               extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert ("<|im_end|>" in completion.choices[0].text) == (not skip)


def test_chat_stop_strings_with_and_without_include_stop_str_in_output(client, smollm_fp32):
    ids = smollm_fp32.get_tokenizer().apply_chat_template(MESSAGES)
    full = greedy(smollm_fp32, {"prompt_token_ids": ids}, max_tokens=10).text
    stop = full.strip().split(" ")[1] if " " in full.strip() else full.strip()[1:3]
    for include in (False, True):
        expected = greedy(smollm_fp32, {"prompt_token_ids": ids}, max_tokens=10, stop=[stop],
                          include_stop_str_in_output=include)
        got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                             stop=[stop], extra_body={"include_stop_str_in_output": include})
        assert got.choices[0].message.content == expected.text and expected.text.endswith(stop) == include
        assert got.choices[0].finish_reason == "stop"


def test_a_chat_cache_salt_keeps_its_prefix_apart(client):
    """A salted chat hits only blocks cached under the same salt (``cached_tokens``)."""
    long = [{"role": "user", "content": "Describe the sea. " * 20}]

    def cached(**extra):
        r = client.chat.completions.create(model=MODEL, messages=long, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()  # the unsalted prefix is now cached
    assert cached(cache_salt="tenant-a") == 0 and cached(cache_salt="tenant-a") > 0 and cached() > 0


def test_the_no_ops_change_nothing_on_completions_and_responses(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    with_no_ops = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                            extra_body=NO_OPS)
    assert with_no_ops.choices[0].text == plain.choices[0].text
    r = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0)
    again = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0,
                                    user="u-1", service_tier="auto", metadata={"k": "v"})
    assert again.output_text == r.output_text and again.metadata == {"k": "v"}  # metadata: kept on the response


def test_responses_sampling_fields_and_a_named_tool_with_a_description(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY,
              "strict": True},
             {"type": "function", "name": "get_time", "description": "Local time in a city", "parameters": CITY}]
    named = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                    tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
                                    max_output_tokens=60, temperature=0)
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), CITY)
    cut = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=1.0,
                                  top_p=1e-6, extra_body={"seed": 9})
    plain = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0)
    assert cut.output_text == plain.output_text  # top_p leaves the top token only
    seeded = [client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=1.0,
                                      extra_body={"seed": 4}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1]
    described = client.responses.create(model=MODEL, input="Give a colour as JSON.", max_output_tokens=40,
                                        text={"format": {"type": "json_schema", "name": "colour", "schema": CITY,
                                                         "description": "a city, as JSON"}})
    jsonschema.validate(json.loads(described.output_text), CITY)


def test_responses_input_items_with_ids_statuses_annotations_and_a_call(client):
    """A replayed conversation as OpenAI's client sends it back: items with their ``id`` and
    ``status``, output text with ``annotations``, a ``function_call`` item (``name``,
    ``arguments``) and its output. The ids, statuses and (empty) annotations change nothing; the
    call's name and arguments are in the prompt (a longer city, more input tokens: SmolLM2's
    template renders no calls, so they are written as Hermes text, ``tools.history_for``)."""
    def items(city: str, replayed: bool) -> list[dict]:
        seen = {"id": "msg_1", "status": "completed"} if replayed else {}
        text = {"type": "output_text", "text": "Let me check.", **({"annotations": []} if replayed else {})}
        call = {"type": "function_call", "call_id": "call-1", "name": "get_weather",
                "arguments": json.dumps({"city": city}), **({"id": "fc_1", "status": "completed"} if replayed else {})}
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "message", "role": "assistant", "content": [text], **seen}, call,
                {"type": "function_call_output", "call_id": "call-1", "output": "sunny, 21 C"}]

    def answer(city: str, replayed: bool):
        return client.responses.create(model=MODEL, input=items(city, replayed), max_output_tokens=8, temperature=0)

    replayed, bare = answer("Paris", True), answer("Paris", False)
    assert replayed.output_text == bare.output_text and replayed.usage.input_tokens == bare.usage.input_tokens
    assert answer("Llanfairpwllgwyngyll", True).usage.input_tokens > replayed.usage.input_tokens


def test_tokenize_messages_with_every_part_and_add_special_tokens(client, server, smollm_fp32):
    """``/tokenize`` renders a history with a participant name, text parts, a tool call and its
    result as the chat route renders its prompt; ``add_special_tokens`` is the tokenizer's."""
    tok = smollm_fp32.get_tokenizer()
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": HISTORY}).json()
    chat = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=1,
                                          extra_body={"return_token_ids": True})
    assert got["tokens"] == chat.prompt_token_ids
    for add in (True, False):
        r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": add}).json()
        assert r["tokens"] == tok.encode(PROMPT, add_special_tokens=add)


def test_detokenize_checks_its_model(server, smollm_fp32):
    ids = smollm_fp32.get_tokenizer().encode(PROMPT)
    assert httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"] == PROMPT
    wrong = httpx.post(server.url + "/detokenize", json={"model": "other", "tokens": ids})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_a_strict_function_is_called_within_its_schema(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                       max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_a_history_call_and_its_result_are_in_the_prompt_without_tools(client, server, smollm_fp32):
    """An assistant turn's ``tool_calls`` and the ``tool`` result reach the prompt when the
    request lists no tools, on the chat route and ``/tokenize`` alike (SmolLM2's template renders
    neither, and the call was dropped: the prompt was the same whatever its arguments)."""
    def prompt_ids(city: str) -> list[int]:
        history = json.loads(json.dumps(HISTORY).replace("Paris\\\"", f"{city}\\\""))
        chat = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                              extra_body={"return_token_ids": True})
        assert httpx.post(server.url + "/tokenize", json={"messages": history}).json()["tokens"] == \
            chat.prompt_token_ids
        return chat.prompt_token_ids

    text = smollm_fp32.get_tokenizer().decode(prompt_ids("Paris"))
    assert '"arguments": {"city": "Paris"}' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert len(prompt_ids("Llanfairpwllgwyngyll")) > len(prompt_ids("Paris"))
