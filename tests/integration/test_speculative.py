"""Speculative decoding (ngram, suffix) on the real engine: the same tokens as decoding without it.

The default model (SmolLM2 GGUF Q4_1 in bf16, its small-step 4-bit kernels) computes each row of a
step alone, bit for bit, so greedy tokens, logprobs and seeded samples equal those of plain
decoding exactly; the tiny float32 checkpoints check the same over preemption (recompute and
swap), prefix caching and parallel sampling. Every test also checks that guesses were verified
and accepted (the counters), and that every block is free afterwards.
"""

from __future__ import annotations

import json

import pytest

import pagedllm.engine.speculative.drafter as drafter_module
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.sampling_params import StructuredOutputsParams
from tests.conftest import PROMPT_TEXT, make_tiny_checkpoint
from tests.integration.test_engine import assert_all_free

METHODS = ["ngram", "suffix"]
REPEAT = [{"role": "user", "content": "Repeat this text word for word:\n\n" + PROMPT_TEXT}]
QUESTION = [{"role": "user", "content": "List the first ten prime numbers, separated by commas."}]


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def spec_stats(llm) -> dict:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_decode")}


@pytest.fixture(scope="module")
def smollm():
    """The default model as `make run` serves it: plain, and with each method. Without prefix
    caching: a hit computes the rest of a prompt as a shorter chunk, whose dense GEMMs round
    differently, so engines that ran different prompts before would differ for that reason alone
    (speculation with prefix caching: the tiny checkpoints' test and the property test)."""
    opts = dict(seed=0, kv_cache_memory="64MiB", enable_prefix_caching=False)
    engines = {None: LLM(**opts)}
    for m in METHODS:
        engines[m] = LLM(**opts, speculative_config={"method": m})
    return engines


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_and_logprobs_equal_plain_decoding_on_the_default_model(smollm, method):
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=2)
    convs = [REPEAT, QUESTION]
    plain = smollm[None].chat(convs, params, use_tqdm=False)
    before = spec_stats(smollm[method])
    got = smollm[method].chat(convs, params, use_tqdm=False)
    assert tokens(got) == tokens(plain)
    for g, p in zip(got, plain, strict=True):  # the same logits: logprobs equal exactly
        assert g.outputs[0].logprobs == p.outputs[0].logprobs
        assert g.outputs[0].cumulative_logprob == p.outputs[0].cumulative_logprob
        assert g.outputs[0].text == p.outputs[0].text
    after = spec_stats(smollm[method])
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] > 20
    assert_all_free(smollm[method])


@pytest.mark.parametrize("method", METHODS)
def test_seeded_samples_and_parallel_sampling_equal_plain_decoding(smollm, method):
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, n=2, max_tokens=60)
    plain = smollm[None].chat([REPEAT], params, use_tqdm=False)
    before = spec_stats(smollm[method])["spec_decode_num_accepted_tokens"]
    got = smollm[method].chat([REPEAT], params, use_tqdm=False)
    assert tokens(got) == tokens(plain)
    assert spec_stats(smollm[method])["spec_decode_num_accepted_tokens"] > before
    assert_all_free(smollm[method])


def test_stop_strings_cut_inside_an_accepted_run(smollm):
    text = smollm[None].chat([REPEAT], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 6]  # a string the copy reaches mid-way
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=60, stop=[stop], include_stop_str_in_output=include)
        plain = smollm[None].chat([REPEAT], params, use_tqdm=False)[0].outputs[0]
        got = smollm["suffix"].chat([REPEAT], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason)
        assert got.finish_reason == "stop" and got.stop_reason == stop
    assert_all_free(smollm["suffix"])


def test_structured_output_cuts_guesses_the_grammar_rejects(smollm):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    conv = [{"role": "user", "content": "Put this text in a JSON object under \"text\":\n\n" + PROMPT_TEXT[:300]}]
    params = SamplingParams(temperature=0, max_tokens=90, structured_outputs=StructuredOutputsParams(json=schema))
    plain = smollm[None].chat([conv], params, use_tqdm=False)[0].outputs[0]
    before = spec_stats(smollm["ngram"])["spec_decode_num_accepted_tokens"]
    got = smollm["ngram"].chat([conv], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain.token_ids and got.finish_reason == plain.finish_reason
    if got.finish_reason == "stop":
        assert "text" in json.loads(got.text)
    accepted = spec_stats(smollm["ngram"])["spec_decode_num_accepted_tokens"] - before
    limit = smollm["ngram"].engine.scheduler.drafter.row_limit
    if limit is not None and limit < 2:
        # a CPU family whose small-step kernels compute rows alone only one at a time (AVX-512 without
        # BF16: its 1-row bf16 head) verifies no guess exactly, so its drafter makes none
        assert accepted == 0, smollm["ngram"].engine.kernel_plan.family
    else:
        assert accepted > 0
    assert_all_free(smollm["ngram"])


def test_beam_search_and_opted_out_requests_never_guess(smollm):
    llm = smollm["suffix"]
    before = spec_stats(llm)
    beam = llm.beam_search([{"prompt": "The capital of France is"}], BeamSearchParams(beam_width=2, max_tokens=8))
    plain_beam = smollm[None].beam_search([{"prompt": "The capital of France is"}],
                                          BeamSearchParams(beam_width=2, max_tokens=8))
    assert [s.tokens for s in beam[0].sequences] == [s.tokens for s in plain_beam[0].sequences]
    params = SamplingParams(temperature=0, max_tokens=40, speculative_decoding=False)
    got = llm.chat([REPEAT], params, use_tqdm=False)
    assert tokens(got) == tokens(smollm[None].chat([REPEAT], params, use_tqdm=False))
    assert spec_stats(llm) == before
    assert_all_free(llm)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / request.param, request.param, seed=5)


def looping_prompts(count: int) -> list[dict]:
    """Prompts that repeat themselves (so guesses are taken and many accepted), some sharing a prefix."""
    out = []
    for i in range(count):
        motif = [10 + (i % 3) * 7 + j for j in range(5)]
        out.append({"prompt_token_ids": motif * (3 + i % 4) + [100 + i]})
    return out


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_checkpoints_under_preemption_prefix_caching_and_forks(tiny, preemption_mode, monkeypatch):
    # rows cost nothing here, so the drafter guesses whenever a proposer has a guess, at any batch
    # size up to disable_by_batch_size: what is tested is exactness under pressure, not the cost model
    monkeypatch.setattr(drafter_module, "STEP_COST", (1.0, 1.0))
    prompts = looping_prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True)]
    opts = dict(model=tiny, dtype="float32", block_size=8, num_kv_blocks=40, max_num_seqs=8,
                preemption_mode=preemption_mode, swap_space="4MiB")
    plain = LLM(**opts)
    expected = [tokens(plain.generate(prompts, p, use_tqdm=False)) for p in params]
    for method in METHODS:
        llm = LLM(**opts, speculative_config={"method": method, "disable_by_batch_size": 8})
        for p, want in zip(params, expected, strict=True):
            assert tokens(llm.generate(prompts, p, use_tqdm=False)) == want
        again = tokens(llm.generate(prompts, params[0], use_tqdm=False))  # prefix-cache hits now
        assert again == expected[0]
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert_all_free(llm)
