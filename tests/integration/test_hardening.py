"""Regression tests for the defects of the engine-hardening issue, on the embedded SmolLM2 (float32):
length limits, beam search (validation, cache salt, EOS as vLLM), forks within max_num_seqs, stop
strings (always checked, held back, stop-token text omitted), a failing step that fails only its
own requests."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.sampling_params import N_MAX, TOP_K_MAX, RequestOutputKind
from pagedllm.errors import InvalidRequest, RequestTooLong
from tests.integration.test_engine import assert_all_free


@pytest.fixture(scope="module")
def short_ctx():
    """max_model_len 64, a pool of 12 blocks of 16 tokens (192 slots)."""
    return LLM(dtype="float32", max_model_len=64, num_kv_blocks=12)


# -- 1. prompt at or over max_model_len with max_tokens=None ---------------------------------------------
@pytest.mark.parametrize("extra", [0, 5])
def test_a_prompt_of_max_model_len_or_more_is_rejected_even_without_max_tokens(short_ctx, extra):
    prompt = {"prompt_token_ids": [7] * (64 + extra)}
    with pytest.raises(RequestTooLong, match=r"shorter than max_model_len \(64\)"):
        short_ctx.generate(prompt, SamplingParams(max_tokens=None), use_tqdm=False)
    assert_all_free(short_ctx)


def test_max_tokens_none_fills_up_to_max_model_len(short_ctx):
    out = short_ctx.generate({"prompt_token_ids": [7] * 63}, SamplingParams(max_tokens=None, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_all_free(short_ctx)


def test_min_tokens_past_the_room_left_by_the_prompt_is_rejected(short_ctx):
    """With max_tokens None the request may run to max_model_len: a min_tokens past that room could
    never be honoured, so it is refused rather than silently cut short."""
    with pytest.raises(InvalidRequest, match=r"min_tokens \(10\) must be at most max_tokens \(4: what max_model_len"):
        short_ctx.generate({"prompt_token_ids": [7] * 60}, SamplingParams(max_tokens=None, min_tokens=10),
                           use_tqdm=False)
    assert_all_free(short_ctx)
    out = short_ctx.generate({"prompt_token_ids": [7] * 60}, SamplingParams(max_tokens=None, min_tokens=4),
                             use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


# -- issue 21: a request's own fields fail that request when it is added, never the step or engine --
@pytest.mark.parametrize("prompt,field", [({"prompt_token_ids": [7] * 20, "cache_salt": "\ud800"}, "cache_salt"),
                                          ("Hello \udc80", "prompt")])
def test_text_that_is_not_utf8_is_rejected_when_added_and_the_engine_continues(short_ctx, prompt, field):
    with pytest.raises(InvalidRequest, match=f"{field} is not valid UTF-8 text: a lone surrogate"):
        short_ctx.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    out = short_ctx.generate({"prompt_token_ids": [7] * 20, "cache_salt": "tenant"},
                             SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
    assert_all_free(short_ctx)


def test_n_is_bounded_so_a_huge_one_is_refused_at_once_not_built_sample_by_sample(short_ctx):
    """The engine makes one request per sample when a prompt is added: n = 2**40 used to hang the
    caller building them; it is refused by SamplingParams, and a prompt of N_MAX samples runs."""
    with pytest.raises(ValueError, match=rf"n must be an integer in 1\.\.{N_MAX} \(parallel samples"):
        SamplingParams(n=2**40)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=N_MAX + 1)
    out = short_ctx.generate({"prompt_token_ids": [7] * 4}, SamplingParams(n=N_MAX, max_tokens=1, temperature=1.0,
                                                                             seed=0), use_tqdm=False)[0]
    assert len(out.outputs) == N_MAX and all(len(c.token_ids) == 1 for c in out.outputs)
    assert_all_free(short_ctx)


def test_top_k_is_bounded_and_the_largest_accepted_one_samples_next_to_a_greedy_request(short_ctx):
    with pytest.raises(ValueError, match=r"top_k must be .* in 1\.\.2147483647, got 9223372036854775808"):
        SamplingParams(top_k=2**63)
    prompts = [{"prompt_token_ids": [7] * 20}, {"prompt_token_ids": [9] * 20}]
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K_MAX, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    outs = short_ctx.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    alone = short_ctx.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_free(short_ctx)


# -- 2. beam search validates like add_request and keeps cache_salt -------------------------------------------
@pytest.mark.timeout(120)
def test_beam_search_over_the_pool_is_rejected_not_hung():
    llm = LLM(dtype="float32", num_kv_blocks=4, block_size=16)  # 64 slots
    with pytest.raises(RequestTooLong, match="num_kv_blocks=4"):
        llm.beam_search({"prompt_token_ids": [7] * 40}, BeamSearchParams(beam_width=2, max_tokens=30))
    assert_all_free(llm)
    got = llm.beam_search({"prompt_token_ids": [7] * 40}, BeamSearchParams(beam_width=2, max_tokens=8))
    assert len(got[0].sequences) == 2
    assert_all_free(llm)


def test_beam_search_keeps_the_cache_salt(smollm_fp32):
    prompt = list(range(1000, 1050))  # 3 full blocks of 16 (+2 tokens)
    llm = smollm_fp32
    llm.beam_search({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, BeamSearchParams(beam_width=2,
                                                                                             max_tokens=2))
    params = SamplingParams(temperature=0, max_tokens=1)
    before = llm.kv_cache_stats()["prefix_cache_hits"]
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, params, use_tqdm=False)
    assert llm.kv_cache_stats()["prefix_cache_hits"] == before  # another tenant shares nothing
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, params, use_tqdm=False)
    assert llm.kv_cache_stats()["prefix_cache_hits"] - before == 48  # the beams' own tenant hits 3 blocks
    assert_all_free(llm)


# -- 3. beam search moves every EOS candidate to the completed beams (vLLM) -----------------------------------
def reference_beam_search(llm: LLM, prompt: list[int], width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """vLLM's LLM.beam_search algorithm, one engine call per step (max_tokens=1, 2 * width logprobs)."""
    eos = llm.engine.eos_token_ids
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": b[0]} for b in beams],
                            SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width), use_tqdm=False)
        candidates = []
        for (tokens, cum), out in zip(beams, outs, strict=True):
            top = list(out.outputs[0].logprobs[0].items())
            top.sort(key=lambda kv: kv[1].rank)
            for token, lp in top[:2 * width]:
                (completed if token in eos else candidates).append((tokens + [token], cum + lp.logprob))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    completed += beams
    completed.sort(key=lambda c: c[1] / (len(c[0]) - (c[0][-1] in eos)), reverse=True)
    return completed[:width]


def test_beam_search_moves_eos_candidates_to_completed_and_keeps_width_live_beams(smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}])
    got = smollm_fp32.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=8))
    expected = reference_beam_search(smollm_fp32, prompt, 3, 8)
    assert [s.tokens for s in got[0].sequences] == [e[0] for e in expected]
    assert [s.cum_logprob for s in got[0].sequences] == pytest.approx([e[1] for e in expected], abs=1e-4)
    assert sum(s.finish_reason == "stop" for s in got[0].sequences) >= 2  # ended by EOS, without ignore_eos
    assert_all_free(smollm_fp32)


# -- 5. forks respect max_num_seqs ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["n", "beam"])
def test_forks_never_exceed_max_num_seqs(kind):
    llm = LLM(dtype="float32", max_num_seqs=2, num_kv_blocks=64)
    engine = llm.engine
    prompt = {"prompt_token_ids": list(range(300, 340))}
    params = (SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True) if kind == "n"
              else BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True))
    engine.add_request("r", prompt, params)
    final, most = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
        most = max(most, len(engine.scheduler.running))
    assert most == 2
    assert len(final.outputs) == 4 and all(len(c.token_ids) == (6 if kind == "n" else 5) for c in final.outputs)
    if kind == "n":  # the same samples as with room for all four at once
        wide = LLM(dtype="float32", max_num_seqs=8, num_kv_blocks=64).generate(prompt, params, use_tqdm=False)[0]
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in wide.outputs]
    assert_all_free(llm)


# -- 6. stop strings ----------------------------------------------------------------------------------------
PROMPT = "Count: 1, 2, 3,"


def test_a_stop_string_on_the_last_allowed_token_still_stops(smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    base = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    # the first token whose text is new: a stop string that first matches on that very token
    m = next(i for i in range(1, 16) if (t := tok.decode(base.token_ids[i:i + 1])).strip()
             and t not in tok.decode(base.token_ids[:i]))
    last = tok.decode(base.token_ids[m:m + 1])
    out = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=m + 1, stop=last),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:m + 1]  # ends by length too
    assert out.finish_reason == "stop" and out.stop_reason == last
    assert out.text == tok.decode(base.token_ids[:m])
    assert_all_free(smollm_fp32)


def test_streamed_text_never_shows_a_partial_stop_string(smollm_fp32):
    base = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = base.text[3:9]  # spans several tokens
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop)
    streamed = [o.outputs[0].text for o in smollm_fp32.generate_stream(PROMPT, params)]
    final = streamed[-1]
    assert final == base.text[:base.text.find(stop)]
    assert all(final.startswith(t) for t in streamed)  # every streamed text is a prefix of the final one
    assert_all_free(smollm_fp32)


def test_the_text_of_a_stop_token_is_left_out_unless_asked_for(smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    base = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    m = next(i for i in range(1, 16) if base.token_ids[i] not in base.token_ids[:i])  # a token's first use
    stop_id = base.token_ids[m]
    for include, n in ((False, m), (True, m + 1)):
        out = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id],
                                                          include_stop_str_in_output=include),
                                   use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:m + 1] and out.stop_reason == stop_id
        assert out.finish_reason == "stop" and out.text == tok.decode(base.token_ids[:n])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_deltas_add_up_to_the_final_output(smollm_fp32, kind):
    prompts = [PROMPT, "The sky is"]
    base = smollm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stop = base[0].outputs[0].text[5:8]
    params = [SamplingParams(temperature=0, max_tokens=12, stop=stop, logprobs=2, output_kind=kind),
              SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=10, logprobs=1, output_kind=kind)]
    final = smollm_fp32.generate(prompts, params, use_tqdm=False)
    texts, tokens, logprobs = {}, {}, {}
    for out in smollm_fp32.generate_stream(prompts, params):
        for c in out.outputs:
            key = (prompts.index(out.prompt), c.index)
            if kind is RequestOutputKind.DELTA:
                texts[key] = texts.get(key, "") + c.text
                tokens[key] = tokens.get(key, []) + c.token_ids
                logprobs[key] = logprobs.get(key, []) + c.logprobs
            else:
                texts[key], tokens[key], logprobs[key] = c.text, c.token_ids, c.logprobs
    for (i, index), text in texts.items():
        expected = final[i].outputs[index]
        assert text == expected.text
        assert tokens[(i, index)] == expected.token_ids
        assert [list(d) for d in logprobs[(i, index)]] == [list(d) for d in expected.logprobs]
    assert final[0].outputs[0].finish_reason == "stop" and len(texts) == 3
    assert_all_free(smollm_fp32)


# -- 9. a failed step fails only its own requests -------------------------------------------------------------
def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_others_continue():
    llm = LLM(dtype="float32", max_num_seqs=3, num_kv_blocks=32)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(["Hello there", "Once upon a time"], greedy, use_tqdm=False)
    forward = engine.runner.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    engine.runner.model.forward = flaky
    engine.add_request("a", "Hello there", greedy)
    engine.add_request("b", "Write one line.", SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=6))
    engine.step()  # prefill of a and b; b's second sample forks, sharing b's blocks
    copies = engine.kv_manager.stats()["num_cow_copies"]
    engine.add_request("c", "Once upon a time", greedy)  # no free slot yet: waits
    failed = engine.step()  # raises inside: b's shared block was copied for this step
    assert engine.kv_manager.stats()["num_cow_copies"] == copies + 1
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    for out in failed:
        assert out.finished and out.error and "injected fault" in out.error
        assert all(c.finish_reason == "error" for c in out.outputs)
    engine.kv_manager.check_invariants()
    assert set(engine.scheduler.requests) == {"c"} and not engine.kv_manager.tables
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            finals[out.request_id] = out
    engine.runner.model.forward = forward
    assert finals["c"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert_all_free(llm)
    again = llm.generate(["Hello there", "Once upon a time"], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


# -- 10. prefix-cache keys: 128-bit keyed by default, sha256 as an option ---------------------------------
@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_prefix_cache_hash_algo_is_an_engine_option(algo):
    llm = LLM(dtype="float32", num_kv_blocks=16, prefix_caching_hash_algo=algo)
    assert llm.engine.kv_manager.hasher.algo == algo
    prompt = {"prompt_token_ids": list(range(500, 540))}  # 2 full blocks of 16 (+8 tokens)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens == 32 and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_free(llm)
