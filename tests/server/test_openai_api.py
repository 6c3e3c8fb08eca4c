"""The official ``openai`` client (sync and async) against a real ``pagedllm serve`` process:
both routes, streaming and not, n > 1, stop strings, seeds, logprobs, usage, echo, token-id
prompts, tokenize/detokenize; greedy text equals ``LLM.generate`` for the same prompt."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedllm import SamplingParams

MODEL = "smollm"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_llm_generate_with_usage(client, smollm_fp32):
    expected = greedy(smollm_fp32, PROMPT, max_tokens=12)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected.outputs[0].text
    assert got.choices[0].finish_reason == expected.outputs[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids) and got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_streamed_completion_adds_up_and_ends_with_usage(client, smollm_fp32):
    expected = greedy(smollm_fp32, PROMPT, max_tokens=12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_llm_chat_streamed_or_not(client, smollm_fp32):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = smollm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_n_samples_with_a_seed_are_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, seed=42)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 24


def test_several_prompts_token_ids_and_echo(client, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    ids = tok.encode("1, 2, 3,")
    got = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[1].text == greedy(smollm_fp32, PROMPT, max_tokens=5).outputs[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == greedy(smollm_fp32, {"prompt_token_ids": ids}, max_tokens=5).outputs[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + got.choices[0].text


def test_stop_strings_and_stop_reason(client, smollm_fp32):
    expected = greedy(smollm_fp32, "Count: 1, 2, 3,", max_tokens=16, stop=[" 6"])
    got = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0, stop=[" 6"])
    assert got.choices[0].text == expected.outputs[0].text
    assert got.choices[0].finish_reason == expected.outputs[0].finish_reason == "stop"


def test_logprobs_match_the_engine(client, smollm_fp32):
    expected = greedy(smollm_fp32, PROMPT, max_tokens=4, logprobs=2).outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(expected.logprobs, expected.token_ids,
                                                                                strict=True)], abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == expected.text and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy takes the top token
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_cached_prompt_tokens_are_reported(client):
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_async_client_streams_concurrently(server, smollm_fp32):
    prompts = ["Hello", "The sky is", "1, 2, 3,"]
    expected = [greedy(smollm_fp32, p, max_tokens=8).outputs[0].text for p in prompts]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(p: str) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == expected


def test_tokenize_detokenize_health_version(server, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(PROMPT) and r.json()["count"] == 5
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode(PROMPT)})
    assert r.json() == {"prompt": PROMPT}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json()["version"]


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt=[[7] * 9000], max_tokens=4)
    assert long.value.body["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_echoed_prompt_logprobs_line_up_with_the_echoed_text(client, smollm_fp32):
    """The first prompt token had "" as its string and every offset was shifted by it; an echoed
    token-id prompt lost its special tokens from ``text`` but kept them in ``logprobs``."""
    tok = smollm_fp32.get_tokenizer()
    prompt = "Hello, my name is"
    ids = tok.encode(prompt)
    for sent, echoed_prefix in ((prompt, prompt), ([1, *ids], tok.decode([1, *ids], skip_special_tokens=False))):
        r = client.completions.create(model=MODEL, prompt=sent, max_tokens=3, temperature=0, echo=True, logprobs=1)
        choice = choice_of(r)
        lp, n = choice.logprobs, len(ids) + (0 if isinstance(sent, str) else 1)
        assert choice.text.startswith(echoed_prefix) and len(lp.tokens) == n + 3
        assert "".join(lp.tokens[:n]) == echoed_prefix and lp.tokens[0] != ""
        assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert "".join(lp.tokens) == choice.text  # the generated tokens continue the same text
    assert echoed_prefix.startswith("<|im_start|>")  # token 1, a special token, echoed in text and logprobs


def choice_of(r):
    (choice,) = r.choices
    return choice


# sampling fields reach the engine as the same SamplingParams fields: greedy text equal to
# LLM.generate's with them; each set changes this prompt's greedy text (" Paris.\n\nThe answer is:"
# without them), so a field the server dropped would show
SAMPLING_FIELDS = [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.8},
    {"stop_token_ids": [198]},                     # "\n": stops after " Paris."
    {"stop_token_ids": [198], "min_tokens": 4},    # not before 4 tokens
]


@pytest.mark.parametrize("fields", SAMPLING_FIELDS, ids=lambda f: "+".join(f))
def test_sampling_fields_reach_the_engine(client, smollm_fp32, fields):
    plain = greedy(smollm_fp32, PROMPT, max_tokens=8).outputs[0]
    expected = greedy(smollm_fp32, PROMPT, max_tokens=8, **fields).outputs[0]
    assert (expected.text, expected.finish_reason) != (plain.text, plain.finish_reason)  # the fields matter here
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body=fields).choices[0]
    assert got.text == expected.text and got.finish_reason == expected.finish_reason
    # the chat route too, with a participant name and text parts (they reach the template)
    ids = smollm_fp32.get_tokenizer().apply_chat_template([{"role": "user", "content": PROMPT, "name": "ann"}])
    chat_expected = greedy(smollm_fp32, {"prompt_token_ids": ids}, max_tokens=8, **fields).outputs[0]
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_body=fields,
                                          messages=[{"role": "user", "name": "ann",
                                                     "content": [{"type": "text", "text": PROMPT}]}])
    assert chat.choices[0].message.content == chat_expected.text


def test_stop_strings_stay_in_the_text_with_include_stop_str_in_output(client, smollm_fp32):
    full = greedy(smollm_fp32, PROMPT, max_tokens=8).outputs[0].text
    stop = full.strip().split(" ")[0]
    for include in (False, True):
        expected = greedy(smollm_fp32, PROMPT, max_tokens=8, stop=[stop], include_stop_str_in_output=include)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"include_stop_str_in_output": include}).choices[0]
        assert got.text == expected.outputs[0].text and got.text.endswith(stop) == include
