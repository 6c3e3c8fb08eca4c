"""n > 1 in the real engine: shared prompt blocks, reproducible seeded samples, nothing leaked."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from tests.integration.test_engine import assert_all_free

PROMPT = "Write one sentence about the sea."


def test_n_samples_share_the_prompt_and_copy_the_partial_block_once_per_writer(smollm_fp32):
    ids = smollm_fp32.get_tokenizer().encode(PROMPT)
    assert len(ids) % 16  # the prompt ends inside a block
    before = smollm_fp32.kv_cache_stats()["num_cow_copies"]
    out = smollm_fp32.generate(PROMPT, SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert smollm_fp32.kv_cache_stats()["num_cow_copies"] - before == 3
    assert_all_free(smollm_fp32)


def test_seeded_n_samples_are_reproducible_and_greedy_siblings_equal_n1(smollm_fp32):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=11, max_tokens=10)
    a = smollm_fp32.generate(PROMPT, params, use_tqdm=False)[0]
    b = smollm_fp32.generate(["Other", PROMPT], [SamplingParams(max_tokens=3), params], use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    greedy = smollm_fp32.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=10), use_tqdm=False)[0]
    one = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert all(c.token_ids == one.outputs[0].token_ids for c in greedy.outputs)
    assert_all_free(smollm_fp32)


def test_n_samples_equal_on_contiguous_layout():
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8)
    paged = LLM(dtype="float32", num_kv_blocks=64, max_model_len=128)
    contiguous = LLM(dtype="float32", num_kv_blocks=64, max_model_len=128, kv_layout="contiguous")
    a = paged.generate(PROMPT, params, use_tqdm=False)[0]
    b = contiguous.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_all_free(paged)
    assert_all_free(contiguous)


def test_abort_of_a_parallel_request_frees_every_sibling(smollm_fp32):
    engine = smollm_fp32.engine
    engine.add_request("par", PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=40))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    assert engine.abort("par")
    assert_all_free(smollm_fp32)
