"""Structured output end to end on the embedded SmolLM2 (float32): JSON schemas, json_object, choice
and regex outputs that parse and validate; n > 1; free requests unaffected by constrained ones in
the same batch; bad specs rejected before queueing; preemption; a rejected token; raw logprobs."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.errors import InvalidRequest
from tests.integration.test_engine import assert_all_free

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            "genres": {"type": "array", "maxItems": 3,
                       "items": {"type": "string", "enum": ["fiction", "science", "history", "poetry"]}},
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    },
    "todo list": {
        "type": "object",
        "properties": {
            "owner": {"type": "string", "maxLength": 16},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {"task": {"type": "string", "maxLength": 24}, "done": {"type": "boolean"}},
                "required": ["task", "done"], "additionalProperties": False}},
        },
        "required": ["owner", "items"],
        "additionalProperties": False,
    },
}
FREE_PROMPTS = ["The capital of France is", "def fib(n):"]
FREE = SamplingParams(temperature=0, max_tokens=24)


def chat(llm: LLM, text: str) -> dict:
    return {"prompt_token_ids": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])}


def json_request(kind: str, **params) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 160, **params},
                          structured_outputs=StructuredOutputsParams(json=SCHEMAS[kind]))


def assert_valid(completion, schema: dict) -> dict:
    assert completion.finish_reason == "stop" and completion.stop_reason is None, completion
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def mixed(smollm_fp32):
    """One batch: a greedy request per schema, json_object, n = 2 sampled, and two free greedy requests."""
    llm = smollm_fp32
    calls = []
    sampler = llm.engine.runner.sampler
    apply = sampler._apply_grammar
    sampler._apply_grammar = lambda *a: (calls.append(len(a[1])), apply(*a))[1]
    try:
        prompts = [chat(llm, f"Give me a {kind} as JSON.") for kind in SCHEMAS]
        params = [json_request(kind) for kind in SCHEMAS]
        prompts.append(chat(llm, "Return a JSON object with the keys city and country for Paris."))
        params.append(SamplingParams(temperature=0, max_tokens=80,
                                     structured_outputs=StructuredOutputsParams(json_object=True)))
        prompts.append(chat(llm, "Give me a person as JSON."))
        params.append(json_request("person", n=2, temperature=0.8, seed=3))
        prompts += FREE_PROMPTS
        params += [FREE] * len(FREE_PROMPTS)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        sampler._apply_grammar = apply
    assert_all_free(llm)
    assert len(llm.engine.structured) == 0  # every matcher released
    return outs, calls


def test_json_schema_outputs_parse_validate_and_stop_at_the_grammars_end(mixed, smollm_fp32):
    outs, _ = mixed
    eos = smollm_fp32.engine.eos_token_ids
    for out, (kind, schema) in zip(outs, SCHEMAS.items(), strict=False):
        c = out.outputs[0]
        value = assert_valid(c, schema)
        assert set(value) >= set(schema["required"]), kind
        # the closing brace completes the grammar: the request stops there, without sampling EOS
        assert c.text.endswith("}") and c.token_ids[-1] not in eos


def test_json_object_gives_an_object(mixed):
    c = mixed[0][len(SCHEMAS)].outputs[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)


def test_n2_sampled_siblings_each_follow_the_grammar(mixed):
    out = mixed[0][len(SCHEMAS) + 1]
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert_valid(c, SCHEMAS["person"])


def test_free_greedy_requests_in_the_batch_equal_their_outputs_alone(mixed, smollm_fp32):
    outs, calls = mixed
    together = [o.outputs[0].token_ids for o in outs[-len(FREE_PROMPTS):]]
    alone = [smollm_fp32.generate(p, FREE, use_tqdm=False)[0].outputs[0].token_ids for p in FREE_PROMPTS]
    assert together == alone
    assert calls and max(calls) > 2  # the mixed batch did mask its structured rows...


def test_a_batch_without_structured_requests_builds_no_bitmask(smollm_fp32, monkeypatch):
    structured = smollm_fp32.engine.structured
    built = []
    real = structured.bitmask
    monkeypatch.setattr(structured, "bitmask", lambda out: built.append(real(out)) or built[-1])
    monkeypatch.setattr(smollm_fp32.engine.runner.sampler, "_apply_grammar",
                        lambda *a: pytest.fail("masked a batch without grammars"))
    smollm_fp32.generate(FREE_PROMPTS, FREE, use_tqdm=False)
    assert built and all(b is None for b in built)


def test_choice_and_regex(smollm_fp32):
    llm = smollm_fp32
    outs = llm.generate(
        [chat(llm, "Pick a color."), chat(llm, "Give a phone number.")],
        [SamplingParams(temperature=0, max_tokens=10,
                        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"])),
         SamplingParams(temperature=0, max_tokens=20,
                        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))],
        use_tqdm=False)
    assert outs[0].outputs[0].text in ("red", "green", "blue") and outs[0].outputs[0].finish_reason == "stop"
    phone = outs[1].outputs[0].text
    assert len(phone) == 8 and phone[3] == "-" and (phone[:3] + phone[4:]).isdigit()
    assert outs[1].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integr"}}}), "integr"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"n": {"$ref": "#/$defs/missing"}}}),
     "missing"),
    (StructuredOutputsParams(regex="[0-9"), "regex"),
])
def test_invalid_spec_is_rejected_before_queueing_and_the_engine_serves_the_next(smollm_fp32, spec, message):
    engine = smollm_fp32.engine
    with pytest.raises(InvalidRequest, match=message) as info:
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec, max_tokens=4))
    assert str(info.value).startswith(f"structured_outputs.{spec.kind} is invalid")
    assert not engine.scheduler.requests and not engine._requests and len(engine.structured) == 0
    out = smollm_fp32.generate(chat(smollm_fp32, "Give me a person as JSON."), json_request("person"),
                               use_tqdm=False)[0]
    assert_valid(out.outputs[0], SCHEMAS["person"])
    assert_all_free(smollm_fp32)


def test_a_token_the_grammar_rejects_fails_only_its_sequence(smollm_fp32, monkeypatch):
    """With the mask switched off the model answers in prose; its first token is not JSON."""
    llm = smollm_fp32
    monkeypatch.setattr(llm.engine.structured, "bitmask", lambda out: None)
    question = chat(llm, "What is the capital of France?")
    outs = llm.generate([question, question], [json_request("person", max_tokens=8), FREE], use_tqdm=False)
    bad, free = outs
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == 1
    assert bad.error.startswith(f"structured output: the grammar rejected token {bad.outputs[0].token_ids[0]}")
    assert free.error is None and free.outputs[0].finish_reason in ("stop", "length")
    assert len(llm.engine.structured) == 0
    assert_all_free(llm)


def test_logprobs_stay_those_of_the_raw_distribution(smollm_fp32):
    llm = smollm_fp32
    prompt = chat(llm, "What is the capital of France?")
    constrained, free = llm.generate(
        [prompt, prompt], [json_request("person", max_tokens=2, logprobs=5),
                           SamplingParams(temperature=0, max_tokens=1, logprobs=5)], use_tqdm=False)
    first, raw = constrained.outputs[0].logprobs[0], free.outputs[0].logprobs[0]
    chosen = constrained.outputs[0].token_ids[0]
    assert chosen != free.outputs[0].token_ids[0]  # the grammar changed the choice...
    ours = {t: lp.logprob for t, lp in first.items() if t != chosen}
    theirs = {t: lp.logprob for t, lp in raw.items() if t != chosen and t in first}
    assert ours.keys() == theirs.keys()  # ...not the distribution: a grammar's mask renormalised
    # over the allowed tokens would move these by whole units. The shared engine may hold this prompt
    # in its prefix cache from earlier tests, so the two last rows can come from steps of different
    # shapes, where a GEMM may sum in another order (MKL's AVX2 sgemm does; alone, on a fresh engine,
    # they are bit-equal here): equal up to float32 rounding, not bit for bit.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert first[chosen].rank > 1


def test_abort_releases_the_matchers(smollm_fp32):
    engine = smollm_fp32.engine
    engine.add_request("so", chat(smollm_fp32, "Give me a person as JSON."), json_request("person", n=3,
                                                                                          temperature=1.0))
    assert len(engine.structured) == 3
    engine.step()
    assert engine.abort("so")
    assert len(engine.structured) == 0
    assert_all_free(smollm_fp32)


@pytest.mark.slow
def test_preempted_structured_requests_resume_without_refeeding_their_matchers(smollm_fp32):
    """A pool too small for the batch: requests are preempted and recomputed, and their greedy outputs
    equal those of a roomy engine (a matcher fed a token twice would reject or change them)."""
    prompts = [chat(smollm_fp32, f"Give me a {kind} as JSON.") for kind in SCHEMAS]
    params = [json_request(kind, max_tokens=100) for kind in SCHEMAS]
    roomy = smollm_fp32.generate(prompts, params, use_tqdm=False)
    # 9 blocks of 16 = 144 slots: one request fits (<= 39 + 100 tokens), three (~37 + 25..70 each) do not
    small = LLM(dtype="float32", num_kv_blocks=9, max_num_batched_tokens=128)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.kv_cache_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for out, p in zip(outs, params, strict=True):
        assert_valid(out.outputs[0], p.structured_outputs.json)
    assert len(small.engine.structured) == 0
    assert_all_free(small)
