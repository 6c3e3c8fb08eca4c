"""Beam search: equal to the same algorithm run on HF transformers over the full vocabulary,
beams share blocks (fork / copy-on-write), nothing leaks."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.integration.test_engine import assert_all_free


def hf_beam_search(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Reference: keep the `width` best of all width x vocab extensions each step (no EOS stop)."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([b[0] for b in beams])).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        scores = torch.tensor([b[1] for b in beams]).unsqueeze(1) + logp
        top = scores.flatten().topk(width)
        vocab = logp.shape[1]
        beams = [(beams[i // vocab][0] + [i % vocab], float(v)) for v, i in zip(top.values, top.indices.tolist(),
                                                                                 strict=True)]
    return beams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("beam") / "llama", "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", block_size=8, num_kv_blocks=64)
    return hf, llm


@pytest.mark.parametrize("width,steps,prompt_len", [(3, 4, 5), (4, 6, 19), (2, 3, 8)])
def test_beam_search_equals_the_reference_on_hf(tiny, width, steps, prompt_len):
    hf, llm = tiny
    prompt = torch.randint(3, 512, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=0.0)
    got = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    expected = hf_beam_search(hf, prompt, width, steps)
    assert [s.tokens for s in got] == [e[0] for e in expected]
    for s, e in zip(got, expected, strict=True):
        assert s.cum_logprob == pytest.approx(e[1], abs=1e-4)
        assert s.finish_reason == "length"
    assert_all_free(llm)


def test_width_one_is_greedy(tiny):
    _, llm = tiny
    prompt = list(range(10, 30))
    beam = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=1, max_tokens=8,
                                                                           ignore_eos=True))[0]
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert beam.sequences[0].tokens == prompt + greedy.outputs[0].token_ids
    assert_all_free(llm)


def test_beams_share_prompt_blocks_and_copy_on_write(tiny):
    _, llm = tiny
    prompt = list(range(100, 141))  # 41 tokens: 5 full blocks of 8 + 1 token
    before = llm.kv_cache_stats()["num_cow_copies"]
    engine, kv = llm.engine, llm.engine.kv_manager
    engine.add_request("beams", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=6,
                                                                                ignore_eos=True))
    used = unshared = 0
    while engine.has_unfinished():
        engine.step()
        used = max(used, kv.num_blocks - kv.num_free_blocks)
        unshared = max(unshared, sum(len(t.blocks) for t in kv.tables.values()))
    assert used < unshared
    # the 5 full prompt blocks are held once instead of four times
    assert unshared - used >= 3 * 5
    assert llm.kv_cache_stats()["num_cow_copies"] > before
    assert_all_free(llm)


def test_beam_search_on_smollm_returns_ranked_text(smollm_fp32):
    out = smollm_fp32.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=8))[0]
    assert len(out.sequences) == 3
    assert "Paris" in out.sequences[0].text
    scores = [s.cum_logprob / len(s.tokens) for s in out.sequences if s.finish_reason == "length"]
    assert scores == sorted(scores, reverse=True)
    assert_all_free(smollm_fp32)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption_gives_the_same_beams(tiny, mode):
    hf, big = tiny
    folder = big.engine.model_path
    small = LLM(model=str(folder), dtype="float32", block_size=8, num_kv_blocks=6, preemption_mode=mode,
                swap_space="1MiB", enable_prefix_caching=False)
    prompt = list(range(200, 229))  # 29 tokens
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True, length_penalty=0.0)
    got = small.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
    assert small.kv_cache_stats()["num_preemptions"] > 0
    assert [s.tokens for s in got] == [e[0] for e in hf_beam_search(hf, prompt, 4, 10)]
    assert_all_free(small)


@pytest.mark.parametrize("bad", [dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                                 dict(beam_width=11, max_tokens=4),
                                 *(dict(beam_width=2, max_tokens=4, length_penalty=x)
                                   for x in (float("nan"), float("inf"), -float("inf")))])
def test_beam_search_params_are_validated(bad):
    with pytest.raises(ValueError):
        BeamSearchParams(**bad)


def test_beam_search_interleaves_with_other_requests_and_aborting_it_frees_every_block(tiny):
    _, llm = tiny
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": list(range(60, 75))}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("beams", {"prompt_token_ids": list(range(100, 141))},
                       BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True))
    engine.add_request("plain", {"prompt_token_ids": list(range(60, 75))}, greedy)
    finals = {}
    for _ in range(4):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    beams = [r for r in engine.scheduler.requests if r.startswith("beams#")]
    assert len(beams) == 4 and engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    assert engine.abort("beams") and not engine.abort("beams")
    assert not any(r.startswith("beams") for r in engine.scheduler.requests)
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(finals) == {"plain"} and finals["plain"].outputs[0].token_ids == alone
    assert_all_free(llm)


@pytest.mark.parametrize("length_penalty", [1e300, -1e300, 400.0, -400.0])
def test_a_length_penalty_past_the_float_range_ranks_instead_of_killing_the_engine(tiny, length_penalty):
    """``n ** length_penalty`` overflows (OverflowError) or underflows to 0 (ZeroDivisionError)
    for such penalties: the engine thread raised in ``beam_score`` and stopped (schemathesis found
    it through ``use_beam_search`` + ``length_penalty`` 1e300). The score is now its limit, so the
    search finishes, ranks its beams, and frees every block."""
    _, llm = tiny
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty)
    (out,) = llm.beam_search({"prompt_token_ids": list(range(40, 52))}, params)
    assert len(out.sequences) == 3 and all(len(s.tokens) > 12 for s in out.sequences)
    assert_all_free(llm)
