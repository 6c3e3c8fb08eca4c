"""vLLM's request extensions (issue 22, item 5) with the official ``openai`` client against the real
``pagedllm serve`` of tests/server/conftest.py (the embedded SmolLM2 in float32, so greedy answers
equal ``LLM.generate``'s): ``return_token_ids``, ``prompt_logprobs``, ``continuous_usage_stats``,
``truncate_prompt_tokens`` with ``truncation_side``, ``continue_final_message`` with chat ``echo``,
``/tokenize``'s ``return_token_strs``, ``allowed_token_ids``, ``logprob_token_ids``,
``return_tokens_as_token_ids`` and ``bad_words``. Each was accepted and ignored before (a 200
without what was asked), or, the last four and ``truncation_side``, refused until vLLM's own
entrypoint tests asked for them (scripts/vllm_entrypoint_tests.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedllm import SamplingParams

MODEL = "smollm"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def engine_greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def test_return_token_ids_on_completions(client, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    expected = engine_greedy(smollm_fp32, PROMPT, max_tokens=6).outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    (choice,) = r.choices
    assert choice.prompt_token_ids == tok.encode(PROMPT) and choice.token_ids == list(expected.token_ids)
    assert tok.decode(choice.token_ids).startswith(choice.text)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).model_dump()
    assert plain["choices"][0]["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == tok.encode(PROMPT)
    assert all("prompt_token_ids" not in c.choices[0].model_dump() for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == list(expected.token_ids)


def test_return_token_ids_on_chat(client, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    prompt_ids = tok.apply_chat_template(MESSAGES)
    expected = engine_greedy(smollm_fp32, {"prompt_token_ids": prompt_ids}, max_tokens=6).outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == prompt_ids and r.choices[0].token_ids == list(expected.token_ids)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert [t for c in chunks for t in (c.choices[0].model_dump().get("token_ids") or [])] == \
        list(expected.token_ids)


def test_prompt_logprobs_are_the_engines(client, smollm_fp32, server):
    expected = engine_greedy(smollm_fp32, PROMPT, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(expected)
    for entry, want in zip(got[1:], expected[1:], strict=True):
        assert list(entry) == [str(t) for t in want]  # the prompt's own token first, then the top 2
        for t, lp in want.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(t)]["rank"] == lp.rank and entry[str(t)]["decoded_token"] == lp.decoded_token
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"  # not the whole vocabulary


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    for create in (lambda **kw: client.completions.create(prompt=PROMPT, **kw),
                   lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw)):
        chunks = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks)  # every chunk, the chat route's first (its role) too
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5 and chunks[0].usage.prompt_tokens > 0
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        plain = list(create(model=MODEL, max_tokens=3, temperature=0, stream=True,
                            stream_options={"include_usage": True}))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    ids = tok.encode(PROMPT)
    expected = engine_greedy(smollm_fp32, {"prompt_token_ids": ids[-3:]}, max_tokens=4).outputs[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == tok.decode(ids[-3:]) + expected
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})  # -1: up to max_model_len
    assert whole.usage.prompt_tokens == len(ids)
    for side, kept in (("right", ids[:3]), ("left", ids[-3:])):  # vLLM's truncation_side: which end is cut
        cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, extra_body={
            "truncate_prompt_tokens": 3, "truncation_side": side, "return_token_ids": True})
        assert cut.choices[0].prompt_token_ids == kept
    with pytest.raises(openai.BadRequestError) as alone:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncation_side": "left"})
    assert alone.value.body["param"] == "truncation_side"


def test_continue_final_message_and_chat_echo(client, smollm_fp32, server):
    tok = smollm_fp32.get_tokenizer()
    partial = [*MESSAGES, {"role": "assistant", "content": "My favourite colour is"}]
    text = tok.hf.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    assert text.endswith("My favourite colour is")  # left open: no end-of-turn after it
    ids = tok.encode(text, add_special_tokens=False)
    assert httpx.post(server.url + "/tokenize", json={"messages": partial, "continue_final_message": True,
                                                      "add_generation_prompt": False}).json()["tokens"] == ids
    expected = engine_greedy(smollm_fp32, {"prompt_token_ids": ids}, max_tokens=5).outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True, "echo": True})
    assert r.choices[0].message.content == "My favourite colour is" + expected
    streamed = list(client.chat.completions.create(model=MODEL, messages=partial, max_tokens=5, temperature=0,
                                                   stream=True, extra_body={"continue_final_message": True,
                                                                            "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content
    body = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": partial, "continue_final_message": True, "add_generation_prompt": True}).json()
    assert body["error"]["param"] == "continue_final_message"


def test_tokenize_returns_token_strings(server, smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    body = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode(PROMPT)
    assert body["token_strs"] == tok.hf.convert_ids_to_tokens(body["tokens"])
    assert httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["token_strs"] is None  # as vLLM


def test_use_beam_search_returns_the_engines_beams(client, smollm_fp32, server):
    from pagedllm import BeamSearchParams

    expected = smollm_fp32.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5))[0].sequences
    prompt_len = len(smollm_fp32.get_tokenizer().encode(PROMPT))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=3,
                                  extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.token_ids for c in r.choices] == [s.tokens[prompt_len:] for s in expected]
    assert [c.text for c in r.choices] == [s.text for s in expected]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,
                                          extra_body={"use_beam_search": True})
    chat_ids = smollm_fp32.get_tokenizer().apply_chat_template(MESSAGES)
    beams = smollm_fp32.beam_search([{"prompt_token_ids": chat_ids}], BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c.message.content for c in chat.choices] == [s.text for s in beams[0].sequences]
    assert chat.usage.completion_tokens == sum(len(s.tokens) - len(chat_ids) for s in beams[0].sequences)
    for field, value in (("temperature", 0.8), ("top_p", 0.5), ("logprobs", 2)):
        body = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "n": 2,
                                                                 "use_beam_search": True, field: value}).json()
        assert body["error"]["param"] == field and "beam search" in body["error"]["message"]
    body = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "n": 11,
                                                             "use_beam_search": True}).json()
    assert body["error"]["param"] == "n"


def test_length_penalty_ranks_the_beams_and_is_refused_without_them(client, smollm_fp32, server):
    """``length_penalty`` reaches the engine's ``BeamSearchParams`` on both routes (the beams equal
    ``LLM.beam_search``'s with it, EOS allowed so lengths differ); without ``use_beam_search`` it
    has no use, so it is a 400 naming it rather than ignored."""
    from pagedllm import BeamSearchParams

    chat_ids = smollm_fp32.get_tokenizer().apply_chat_template(MESSAGES)
    default = smollm_fp32.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12))[0].sequences
    for penalty in (0.0, 3.0):
        params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty)
        expected = smollm_fp32.beam_search([PROMPT, {"prompt_token_ids": chat_ids}], params)
        assert [s.text for s in expected[0].sequences] != [s.text for s in default]  # it ranks these beams
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3,
                                      extra_body={"use_beam_search": True, "length_penalty": penalty})
        assert [c.text for c in r.choices] == [s.text for s in expected[0].sequences]
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, n=3,
                                              extra_body={"use_beam_search": True, "length_penalty": penalty})
        assert [c.message.content for c in chat.choices] == [s.text for s in expected[1].sequences]
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        error = httpx.post(server.url + route, json={**body, "max_tokens": 3, "length_penalty": 2.0}).json()["error"]
        assert error["param"] == "length_penalty" and "use_beam_search" in error["message"]


def test_allowed_token_ids_logprob_token_ids_and_tokens_as_ids(client, smollm_fp32):
    """vLLM's ``allowed_token_ids`` (only those are sampled), ``logprob_token_ids`` (the logprobs of
    exactly those tokens and the chosen one, in place of the top ones; the engine's raw values)
    and ``return_tokens_as_token_ids`` (``token_id:<id>``), on both routes, streamed or not."""
    tok = smollm_fp32.get_tokenizer()
    named = [5000, 42]
    expected = engine_greedy(smollm_fp32, PROMPT, max_tokens=2, allowed_token_ids=[42, 77],
                             logprob_token_ids=named).outputs[0]
    assert set(expected.token_ids) <= {42, 77}
    extra = {"logprob_token_ids": named, "allowed_token_ids": [42, 77], "return_tokens_as_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=5,
                                  extra_body=extra)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in expected.token_ids]
    for token, entry, top in zip(expected.token_ids, expected.logprobs, lp.top_logprobs, strict=True):
        assert top == pytest.approx({f"token_id:{t}": entry[t].logprob for t in {token, *named}}, abs=1e-5)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=5,
                                            stream=True, extra_body=extra))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True,
                                          extra_body=extra)
    for item in chat.choices[0].logprobs.content:
        assert item.token.startswith("token_id:") and int(item.token[9:]) in (42, 77)
        assert {e.token for e in item.top_logprobs} == {item.token, *(f"token_id:{t}" for t in named)}
    words = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": False})
    assert words.choices[0].logprobs.tokens == [words.choices[0].text] != [tok.decode([42])]
    for bad, param in (({"logprob_token_ids": named}, "logprob_token_ids"),  # needs logprobs
                       ({"logprob_token_ids": [10**7], "logprobs": 1}, "logprob_token_ids"),
                       ({"allowed_token_ids": []}, "allowed_token_ids")):
        got = httpx.post(client.base_url.join("completions").__str__(), json={"prompt": PROMPT, **bad})
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.json()


def test_bad_words_are_never_generated_as_the_engine_does(client, smollm_fp32):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    word = plain.split()[0]  # the greedy answer's first word, forbidden next
    expected = engine_greedy(smollm_fp32, PROMPT, max_tokens=4, bad_words=[word]).outputs[0].text
    for create in (lambda **kw: client.completions.create(prompt=PROMPT, **kw).choices[0].text,
                   lambda **kw: client.chat.completions.create(
                       messages=[{"role": "user", "content": PROMPT}], **kw).choices[0].message.content):
        got = create(model=MODEL, max_tokens=4, temperature=0, extra_body={"bad_words": [word]})
        assert word not in got.split()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"bad_words": [word]}).choices[0].text == expected != plain


def test_max_logprobs_bounds_every_count_and_minus_one_is_the_whole_vocabulary(client, tiny_folder):
    """``--max-logprobs`` (vLLM's, 20 by default): a count above it, or -1, is a 400 naming the
    field, as ``/openapi.json`` says; ``--max-logprobs -1`` lets -1 ask for the whole vocabulary."""
    from starlette.testclient import TestClient

    from pagedllm.server.app import build_app
    from tests.server.conftest import tiny_context

    for body in ({"prompt": PROMPT, "logprobs": 21}, {"prompt": PROMPT, "prompt_logprobs": -1},
                 {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}):
        route = "chat/completions" if "messages" in body else "completions"
        got = httpx.post(f"{client.base_url}{route}", json={**body, "max_tokens": 1})
        field = next(k for k in ("top_logprobs", "prompt_logprobs", "logprobs") if k in body)
        assert got.status_code == 400 and got.json()["error"]["param"] == field, got.json()
    ctx = tiny_context(tiny_folder, max_logprobs=-1)
    try:
        with TestClient(build_app(ctx)) as tiny:
            vocab = ctx.engine.engine.config.model.vocab_size
            chat = tiny.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                                           "top_logprobs": -1}).json()
            assert all(len(t["top_logprobs"]) == vocab for t in chat["choices"][0]["logprobs"]["content"])
            done = tiny.post("/v1/completions", json={"prompt": [5, 9, 17], "max_tokens": 1, "prompt_logprobs": -1,
                                                      "logprobs": -1, "return_tokens_as_token_ids": True}).json()
            done = done["choices"][0]
            assert [len(e) for e in done["prompt_logprobs"][1:]] == [vocab, vocab]
            # keyed by token_id:<id> (by text, tokens spelled alike would share a key)
            assert len(done["logprobs"]["top_logprobs"][0]) == vocab
            schema = tiny.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
            assert schema["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": -1}  # no maximum
    finally:
        ctx.engine.shutdown()
