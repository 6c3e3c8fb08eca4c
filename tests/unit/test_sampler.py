"""Sampler against plain per-row reference implementations: logprobs, masks (top-k, top-p, min-p),
penalties, logit bias, allowed tokens, bad words, min_tokens; seeded draws batch-invariant."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sampler, apply_min_p, apply_top_k_top_p, logprobs_of, row_argmax
from pagedllm.engine.sampling_params import SamplingParams

V = 50
EOS = 2


def request(prompt=(5, 6, 7), output=(), bad_words=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100, eos_token_ids=frozenset({EOS}),
                bad_words_token_ids=[list(w) for w in bad_words])
    for t in output:
        r.append_output(t)
    return r


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


# -- plain references (one row, Python lists) ----------------------------------------------------------
def ref_softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in row]
    s = sum(e)
    return [x / s for x in e]


def ref_kept(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens that survive min-p, then top-k (ties with the k-th kept), then top-p."""
    x = list(row)
    if min_p > 0:
        probs = ref_softmax(x)
        x = [v if p >= min_p * max(probs) else -math.inf for v, p in zip(x, probs, strict=True)]
    if top_k > 0:
        kth = sorted(x, reverse=True)[min(top_k, V) - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if top_p < 1:
        probs = ref_softmax(x)
        order = sorted(range(V), key=lambda i: -x[i])
        before = 0.0
        for i in order:
            if before >= top_p:
                x[i] = -math.inf
            before += probs[i]
    return {i for i, v in enumerate(x) if v != -math.inf}


def ref_penalized(row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
                  repetition: float) -> list[float]:
    out = []
    for t, v in enumerate(row):
        if t in prompt or t in output:
            v = v / repetition if v > 0 else v * repetition
        count = output.count(t)
        out.append(v - frequency * count - presence * (count > 0))
    return out


# -- tests --------------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_the_raw_logits_with_ranks_and_top_k():
    logits = random_logits(3, 0)
    chosen = [4, 11, 30]
    lps = logprobs_of(logits, chosen, 5)
    expected = torch.log_softmax(logits, dim=-1)
    for row, (lp, token) in enumerate(zip(lps, chosen, strict=True)):
        assert lp.token_id == token and lp.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        assert lp.rank == 1 + int((expected[row] > expected[row, token]).sum())
        top = sorted(range(V), key=lambda i: -float(expected[row, i]))[:5]
        assert [t for t, _ in lp.top] == top
        assert [v for _, v in lp.top] == pytest.approx([float(expected[row, t]) for t in top], abs=1e-6)


def test_sampler_logprobs_are_of_the_raw_distribution_even_with_penalties():
    logits = random_logits(2, 1)
    reqs = [request(temperature=0, logprobs=3, repetition_penalty=1.5, output=(9,)), request(temperature=0)]
    tokens, lps = Sampler().sample(logits, reqs, [None, None])
    assert set(lps) == {0}
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lps[0].logprob == pytest.approx(float(raw[tokens[0]]), abs=1e-6) and len(lps[0].top) == 3
    penalized = ref_penalized(logits[0].tolist(), [5, 6, 7], [9], 0.0, 0.0, 1.5)
    assert tokens[0] == max(range(V), key=lambda i: penalized[i])
    assert tokens[1] == int(logits[1].argmax())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_in_the_model_dtype_are_widened_unless_every_row_takes_the_raw_argmax(dtype):
    logits = random_logits(3, 4).to(dtype)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie: the first index
    seen = []

    def argmax(x):
        seen.append(x.dtype)
        return x.float().max(dim=-1).indices

    greedy = [request(temperature=0) for _ in range(3)]
    tokens, lps = Sampler(argmax).sample(logits, greedy, [None] * 3)
    assert seen == [dtype] and not lps  # read as they are: no float32 copy
    assert tokens == logits.float().argmax(dim=-1).tolist() and tokens[1] == 7
    for odd_one in (request(temperature=0, logprobs=2), request(temperature=0, logit_bias={3: 100.0}),
                    request(temperature=0.8, seed=1)):
        seen.clear()
        tokens, lps = Sampler(argmax).sample(logits, [*greedy[:2], odd_one], [None, None, None])
        assert seen and set(seen) == {torch.float32}
        assert tokens[:2] == logits[:2].float().argmax(dim=-1).tolist()
        if odd_one.sampling_params.wants_logprobs:
            raw = torch.log_softmax(logits[2].float(), dim=-1)
            assert lps[2].logprob == pytest.approx(float(raw[tokens[2]]), abs=1e-6)
        if odd_one.sampling_params.logit_bias:
            assert tokens[2] == 3


def test_row_argmax_is_argmax_ties_and_infinities_included():
    x = random_logits(64, 3)
    x[1, 7] = x[1, 30] = x[1].max() + 1  # a tie: the first index, as argmax
    x[2] = -math.inf                      # a row every mask removed: index 0, as argmax
    x[3, 11] = math.inf
    x = torch.cat([x, x.round(decimals=0)])  # rounded rows tie often
    assert row_argmax(x) == x.argmax(dim=-1).tolist() and row_argmax(x)[1] == 7


def test_logprob_token_ids_give_those_tokens_raw_logprobs_and_ranks_with_allowed_tokens():
    """vLLM's ``logprob_token_ids``: exactly the named tokens, in order, at their raw log-probability
    and rank, beside a row with plain top-k logprobs; ``allowed_token_ids`` limits the draw only."""
    logits = random_logits(2, 7)
    reqs = [request(temperature=0, logprob_token_ids=[40, 3, 17], allowed_token_ids=[42, 3]),
            request(temperature=0, logprobs=2)]
    tokens, lps = Sampler().sample(logits.clone(), reqs, [None, None])
    raw = torch.log_softmax(logits, dim=-1)
    assert tokens[0] == max((42, 3), key=lambda t: float(logits[0, t]))
    assert [t for t, _ in lps[0].top] == [40, 3, 17]
    assert [v for _, v in lps[0].top] == pytest.approx([float(raw[0, t]) for t in (40, 3, 17)], abs=1e-6)
    assert lps[0].top_ranks == [1 + int((raw[0] > raw[0, t]).sum()) for t in (40, 3, 17)]
    assert [t for t, _ in lps[1].top] == raw[1].topk(2).indices.tolist() and lps[1].top_ranks is None
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=5, logprob_token_ids=[1, 2])  # with logprobs, their numbers must agree
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=list(range(129)))
    assert SamplingParams(logprob_token_ids=[1]).token_ids_to_check() == [("logprob_token_ids", 1)]  # vocab-checked


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.sampled_from([-1, 0, 1, 2, 7, 49, 50, 80]),
       top_p=st.sampled_from([1.0, 0.99, 0.8, 0.5, 0.1, 0.001]), min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_min_p_top_k_top_p_masks_equal_the_reference(seed, top_k, top_p, min_p):
    logits = random_logits(2, seed)
    x = apply_min_p(logits, torch.tensor([min_p, 0.0])) if min_p > 0 else logits
    x = apply_top_k_top_p(x, torch.tensor([top_k, 0]), torch.tensor([top_p, 1.0]))
    assert {int(i) for i in torch.isfinite(x[0]).nonzero()} == ref_kept(logits[0].tolist(), top_k, top_p, min_p)
    assert torch.isfinite(x[1]).all()  # the untouched row keeps everything
    kept = torch.isfinite(x[0])
    assert torch.equal(x[0][kept], logits[0][kept])  # surviving logits are unchanged


def test_sampled_tokens_stay_inside_the_reference_set_and_greedy_rows_take_the_argmax():
    logits = random_logits(4, 3)
    params = [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.4), dict(temperature=1.0, min_p=0.2),
              dict(temperature=0)]
    for seed in range(30):
        reqs = [request(seed=seed, **p) for p in params]
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(4)]
        tokens, _ = Sampler().sample(logits, reqs, gens)
        for row, p in enumerate(params[:3]):
            scaled = (logits[row] / p["temperature"]).tolist()
            assert tokens[row] in ref_kept(scaled, p.get("top_k", 0), p.get("top_p", 1.0), p.get("min_p", 0.0))
        assert tokens[3] == int(logits[3].argmax())


def test_seeded_rows_draw_the_same_token_alone_or_in_any_batch():
    logits = random_logits(3, 4)
    p = dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.01)
    alone, _ = Sampler().sample(logits[1:2], [request(**p)], [torch.Generator().manual_seed(7)])
    batch, _ = Sampler().sample(logits, [request(temperature=0), request(**p), request(temperature=2.0)],
                                [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(1)])
    assert alone[0] == batch[1]


@pytest.mark.parametrize("pres,freq,rep", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (0.0, 0.0, 0.7),
                                           (-0.4, 1.1, 1.2)])
def test_penalties_equal_the_reference(pres, freq, rep):
    logits = random_logits(2, 5)
    prompt, output = [1, 3, 3, 8], [8, 8, 12, 40, 12, 8]
    reqs = [request(prompt=prompt, output=output, presence_penalty=pres, frequency_penalty=freq,
                    repetition_penalty=rep, temperature=0, logprobs=0),
            request(prompt=[2], output=[2, 4], temperature=0)]
    sampler = Sampler()
    processed = logits.clone()
    from pagedllm.engine.sampler import apply_logits_processors

    processed[:1] = apply_logits_processors(processed[:1], reqs[:1])
    assert processed[0].tolist() == pytest.approx(ref_penalized(logits[0].tolist(), prompt, output, pres, freq, rep),
                                                  abs=1e-5)
    tokens, _ = sampler.sample(logits, reqs, [None, None])
    assert tokens[0] == int(processed[0].argmax()) and tokens[1] == int(logits[1].argmax())


def test_logit_bias_allowed_tokens_bad_words_and_min_tokens_equal_the_reference():
    from pagedllm.engine.sampler import apply_logits_processors

    logits = random_logits(4, 6)
    reqs = [request(logit_bias={3: 5.0, 17: -100.0}),
            request(allowed_token_ids=[4, 9, 33]),
            request(output=(20, 21), bad_words=[(13,), (21, 22), (20, 23)]),  # 13 always; 22 after 21; not 23
            request(output=(5,), min_tokens=3, stop_token_ids=[7])]           # EOS and 7 banned for now
    x = apply_logits_processors(logits.clone(), reqs)
    ref = logits.clone()
    ref[0, 3] += 5.0
    ref[0, 17] -= 100.0
    assert torch.equal(x[0], ref[0])
    assert {int(i) for i in torch.isfinite(x[1]).nonzero()} == {4, 9, 33}
    assert torch.equal(x[1][[4, 9, 33]], logits[1][[4, 9, 33]])
    assert {int(i) for i in (~torch.isfinite(x[2])).nonzero()} == {13, 22}
    assert {int(i) for i in (~torch.isfinite(x[3])).nonzero()} == {EOS, 7}
    done = request(output=(5, 6, 8), min_tokens=3, stop_token_ids=[7])  # min_tokens reached: nothing banned
    assert torch.isfinite(apply_logits_processors(logits[3:].clone(), [done])).all()
    ignoring = request(output=(5,), min_tokens=3, ignore_eos=True)       # ignore_eos: EOS is not a stop
    assert {int(i) for i in (~torch.isfinite(apply_logits_processors(logits[3:].clone(), [ignoring]))).nonzero()} \
        == set()


def test_draws_follow_the_distribution_and_never_take_a_zero_probability_token():
    from pagedllm.engine.sampler import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    g = torch.Generator().manual_seed(3)
    tokens = draw(probs.expand(n, -1), [g] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    keep = probs > 0
    chi2 = float((((counts - expected)[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 16.3  # 3 degrees of freedom: p = 0.001
    # unnormalised rows (after top-k/top-p the softmax is exact, but the draw must not rely on it)
    assert draw(torch.tensor([[0.0, 2.0, 0.0]]), [torch.Generator().manual_seed(0)]) == [1]
