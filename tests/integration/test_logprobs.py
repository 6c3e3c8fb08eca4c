"""vLLM-shaped log-probabilities and the sampling features users expect, on a tiny random Llama:
sample and prompt logprobs equal HF transformers' log_softmax, as ``Logprob`` objects with ranks;
prompt inputs as numpy / torch integers; unknown prompt keys; penalties, bias and allowed tokens
end to end. ``check_logprobs_against_hf`` also runs on CUDA (tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.outputs import Logprob
from pagedllm.errors import InvalidRequest
from tests.conftest import make_tiny_checkpoint
from tests.integration.test_engine import assert_all_free


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("logprobs") / "llama", "llama", seed=5)


def check_logprobs_against_hf(folder: str, device: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device=device, block_size=8, num_kv_blocks=64)
    prompt = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=4, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    seq = prompt + tokens
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(seq)):
        entry = out.prompt_logprobs[pos] if pos < len(prompt) else out.outputs[0].logprobs[pos - len(prompt)]
        k = 3 if pos < len(prompt) else 4
        row = logp[pos - 1]
        token = seq[pos]
        assert isinstance(entry[token], Logprob)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        top = row.topk(k).indices.tolist()
        assert [t for t in entry if t != token] == [t for t in top if t != token]
        for rank, t in enumerate(top, start=1):
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4) and entry[t].rank == rank
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)), abs=1e-3)
    assert_all_free(llm)


def test_logprobs_equal_hf_log_softmax(tiny_folder):
    check_logprobs_against_hf(tiny_folder, "cpu")


def test_prompt_logprobs_are_computed_even_for_a_cached_prefix(tiny_folder):
    llm = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64)
    prompt = list(range(40, 75))
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)[0]
    assert all(d is not None for d in first.prompt_logprobs[1:])
    assert [None if d is None else d[t].logprob for d, t in zip(again.prompt_logprobs, prompt, strict=True)] == \
        [None if d is None else d[t].logprob for d, t in zip(first.prompt_logprobs, prompt, strict=True)]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 32 and again.num_cached_tokens == 0  # skipped the cache to see every row
    assert_all_free(llm)


def test_prompts_accept_numpy_and_torch_token_ids_and_reject_unknown_keys(tiny_folder):
    llm = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [5, 6, 7, 8, 9]
    expected = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.array(ids), torch.tensor(ids), {"prompt_token_ids": np.array(ids, dtype=np.int32)},
                   [np.int64(t) for t in ids]):
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    with pytest.raises(InvalidRequest, match="'prompt_ids'"):
        llm.generate({"prompt_ids": ids}, greedy, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate({"prompt_token_ids": [1.5, 2]}, greedy, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(logit_bias={600: 1.0}), use_tqdm=False)
    assert_all_free(llm)


def test_sampling_features_end_to_end(tiny_folder):
    llm = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    allowed = [40, 41, 42]
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=12, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logit_bias={77: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert biased == [77] * 12
    tiny_t = llm.generate(prompt, SamplingParams(temperature=1e-6, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert tiny_t == greedy  # temperatures below 1e-5 are greedy
    penalized = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, frequency_penalty=2.0,
                                                    presence_penalty=2.0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalized)) >= len(set(greedy))
    seeded = [llm.generate(prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=8, top_k=k), use_tqdm=False)[0]
              .outputs[0].token_ids for k in (0, -1)]
    assert seeded[0] == seeded[1]  # top_k 0 and -1 both disable top-k
    assert_all_free(llm)


def test_max_logprobs_limits_requests_and_minus_one_is_the_whole_vocabulary(tiny_folder):
    """vLLM's ``max_logprobs``: 20 by default (more, or -1, is an InvalidRequest naming the field);
    with -1, a request's -1 returns every token of the vocabulary, ranked, at each position."""
    prompt = {"prompt_token_ids": [5, 9, 17, 33]}
    llm = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64)
    for field, value in (("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", -1)):
        with pytest.raises(InvalidRequest, match=f"^{field}: .*max_logprobs \\(20\\)"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert_all_free(llm)
    del llm
    everything = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64, max_logprobs=-1)
    vocab = everything.engine.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    out = everything.generate(prompt, params, use_tqdm=False)[0]
    assert params.logprobs == -1 and params.prompt_logprobs == -1  # the caller's params are left as they were
    for entry in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]:
        assert len(entry) == vocab and sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))
    assert_all_free(everything)
    del everything
    # vLLM's rule: -1 is the vocabulary's size, so a limit at least that size takes it too
    sized = LLM(model=tiny_folder, dtype="float32", block_size=8, num_kv_blocks=64, max_logprobs=vocab)
    out = sized.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
