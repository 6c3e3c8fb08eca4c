"""Prefix caching in the real engine (SmolLM2, float32): identical outputs on and off, exact hits."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SYSTEM = ("You are a meticulous assistant for a logistics company. Answer with short, factual "
          "sentences, cite the relevant policy section when you can, and never invent numbers.")
QUESTIONS = ["How do I track a parcel?", "What is the refund policy?", "Can I change the address?"]


@pytest.fixture(scope="module")
def no_cache():
    return LLM(dtype="float32", kv_cache_memory="128MiB", enable_prefix_caching=False)


def conversations(extra: list[str] | None = None):
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in extra or QUESTIONS]


def test_greedy_outputs_identical_with_prefix_caching_on_and_off(smollm_fp32, no_cache):
    convs = conversations()
    on_first = [o.outputs[0].token_ids for o in smollm_fp32.chat(convs, GREEDY, use_tqdm=False)]
    on_again = [o.outputs[0].token_ids for o in smollm_fp32.chat(convs, GREEDY, use_tqdm=False)]  # now hits
    off = [o.outputs[0].token_ids for o in no_cache.chat(convs, GREEDY, use_tqdm=False)]
    assert on_first == on_again == off
    assert no_cache.kv_cache_stats()["prefix_cache_hits"] == 0


def test_exact_hits_for_a_shared_system_prompt(smollm_fp32):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    tok = llm.get_tokenizer()
    convs = conversations()
    prompts = [tok.apply_chat_template(c) for c in convs]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    bs = llm.engine.kv_manager.block_size
    llm.chat(convs[:1], GREEDY, use_tqdm=False)  # the first conversation fills the cache
    for c in convs[1:]:
        llm.chat(c, GREEDY, use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hits"] == (len(prompts) - 1) * (common // bs) * bs
    assert stats["num_free_blocks"] == stats["num_blocks"]
    llm.engine.kv_manager.check_invariants()


def test_cache_salt_isolates_tenants(smollm_fp32):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode(SYSTEM * 2)
    llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, GREEDY, use_tqdm=False)
    llm.generate({"prompt_token_ids": ids, "cache_salt": "b"}, GREEDY, use_tqdm=False)
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 0
    out = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, GREEDY, use_tqdm=False)[0]
    assert llm.kv_cache_stats()["prefix_cache_hits"] == (len(ids) - 1) // 16 * 16
    assert out.outputs[0].token_ids == llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
