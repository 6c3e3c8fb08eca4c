"""Tensor parallelism on CPU with gloo (parallel/): outputs equal to one rank's, every feature
kept (prefix caching, preemption by recompute and by swap, n > 1, beam search, a quantized KV
format), every block free and every rank's tables released after a run, a dead worker ends the
engine with an error naming its rank, and no process outlives the engine."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.errors import ConfigError, EngineStopped
from tests.conftest import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPTS = [[1, 5, 9, 33, 7], list(range(1, 40)), [1, 200, 3], list(range(100, 150))]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def prompts(token_lists):
    return [{"prompt_token_ids": p} for p in token_lists]


def assert_all_free(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    llm.engine.kv_manager.check_invariants()
    runner = llm.engine.runner
    if llm.engine.tensor_parallel is not None:  # no rank still holds a table
        assert runner.block_tables_held(llm.engine.scheduler.requests) == [0] * llm.engine.tensor_parallel.world_size


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_pair(request, tmp_path_factory):
    """A tiny checkpoint (4 query heads, 2 KV heads) on one rank and on two; the two-rank engine's
    pool is small enough (12 blocks of 16) for the longer runs to preempt."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    one = LLM(model=folder, dtype="float32", num_kv_blocks=64)
    two = LLM(model=folder, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    yield folder, one, two
    two.shutdown()


def test_two_ranks_give_one_ranks_tokens_and_hold_half_the_heads(tiny_pair):
    _, one, two = tiny_pair
    assert two.engine.kv_spec.num_kv_heads == one.engine.kv_spec.num_kv_heads // 2
    assert two.engine.runner.model.config.num_heads == 2
    assert ids(two.generate(prompts(PROMPTS), GREEDY, use_tqdm=False)) == ids(
        one.generate(prompts(PROMPTS), GREEDY, use_tqdm=False))
    assert_all_free(two)


def test_prefix_cache_hits_under_tensor_parallelism(tiny_pair):
    _, one, two = tiny_pair
    shared = list(range(1, 50))  # three full blocks shared
    before = two.kv_cache_stats()["prefix_cache_hits"]
    first = ids(two.generate(prompts([shared + [7]]), GREEDY, use_tqdm=False))
    second = ids(two.generate(prompts([shared + [9]]), GREEDY, use_tqdm=False))
    assert two.kv_cache_stats()["prefix_cache_hits"] - before >= 48  # tokens: the three blocks
    assert first + second == ids(one.generate(prompts([shared + [7], shared + [9]]), GREEDY, use_tqdm=False))
    assert_all_free(two)


def test_parallel_sampling_and_beam_search_copy_on_write_on_every_rank(tiny_pair):
    _, one, two = tiny_pair
    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=4)
    assert [[c.token_ids for c in o.outputs] for o in two.generate(prompts(PROMPTS[:2]), sampled, use_tqdm=False)] \
        == [[c.token_ids for c in o.outputs] for o in one.generate(prompts(PROMPTS[:2]), sampled, use_tqdm=False)]
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    got = [[s.tokens for s in o.sequences] for o in two.beam_search(prompts(PROMPTS[1:3]), beams)]
    assert got == [[s.tokens for s in o.sequences] for o in one.beam_search(prompts(PROMPTS[1:3]), beams)]
    assert_all_free(two)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tensor_parallelism_keeps_the_outputs(tiny_pair, mode):
    folder, one, _ = tiny_pair
    long = [list(range(1 + i, 60 + i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    small = LLM(model=folder, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=64, preemption_mode=mode,
                swap_space="4MiB", tensor_parallel_size=2)
    try:
        got = ids(small.generate(prompts(long), params, use_tqdm=False))
        stats = small.kv_cache_stats()
        assert stats["num_preemptions"] > 0
        if mode == "swap":
            assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"] > 0
        assert got == ids(one.generate(prompts(long), params, use_tqdm=False))
        assert_all_free(small)
    finally:
        small.shutdown()
    assert not any(p.is_alive() for p in small.engine.tensor_parallel.processes)


def test_speculative_guesses_are_verified_alike_on_every_rank(tiny_pair):
    """A chunk with guesses is laid out as decode rows on rank 0: the workers must lay it out the
    same (the step message carries how many of its tokens are guesses), or the all-reduces would
    add up different rows."""
    folder, one, _ = tiny_pair
    looping = [[10, 11, 12, 13, 14] * 5 + [20]]  # one request: where guessing pays (the drafter's cost table)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)  # the random model falls into loops
    spec = LLM(model=folder, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
               speculative_config={"method": "ngram"})
    try:
        assert ids(spec.generate(prompts(looping), params, use_tqdm=False)) == ids(
            one.generate(prompts(looping), params, use_tqdm=False))
        assert spec.engine.stats()["spec_decode_num_draft_tokens"] > 0  # guesses were verified on both ranks
        assert_all_free(spec)
    finally:
        spec.shutdown()


def test_a_quantized_kv_format_is_sharded_by_heads_too(tiny_pair):
    folder, _, _ = tiny_pair
    one = LLM(model=folder, dtype="float32", num_kv_blocks=32, kv_cache_dtype="int8")
    two = LLM(model=folder, dtype="float32", num_kv_blocks=32, kv_cache_dtype="int8", tensor_parallel_size=2)
    try:
        assert ids(two.generate(prompts(PROMPTS), GREEDY, use_tqdm=False)) == ids(
            one.generate(prompts(PROMPTS), GREEDY, use_tqdm=False))
    finally:
        two.shutdown()


def test_sizes_that_do_not_divide_the_heads_are_refused_naming_them(tiny_pair):
    folder, _, _ = tiny_pair
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide the model's query heads \(4\).*"
                                          r"4 query heads and 2 KV heads: tensor_parallel_size 1 or 2 work"):
        LLM(model=folder, dtype="float32", tensor_parallel_size=3)


def test_a_dead_worker_fails_the_engine_naming_its_rank_and_leaves_no_process(tiny_pair):
    folder, _, _ = tiny_pair
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    worker = llm.engine.tensor_parallel.processes[0]
    assert ids(llm.generate(prompts(PROMPTS[:1]), GREEDY, use_tqdm=False))
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    outs = llm.generate(prompts(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert "worker rank 1" in outs[0].error and "exited" in outs[0].error
    with pytest.raises(EngineStopped, match="tensor parallel"):
        llm.generate(prompts(PROMPTS[:1]), GREEDY, use_tqdm=False)
    assert llm.kv_cache_stats()["num_free_blocks"] == llm.kv_cache_stats()["num_blocks"]
    assert not worker.is_alive()


@pytest.mark.slow
def test_the_default_model_on_three_ranks_gives_one_ranks_tokens(smollm_fp32, parity_prompts):
    """9 query heads and 3 KV heads over 3 ranks, float32: the tokens of one rank, except where one
    rank's top two logits were within 1e-4 of each other (a summation order may then decide)."""
    chosen = [parity_prompts[i] for i in (1, 4, 5, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    reference = smollm_fp32.generate(prompts(chosen), params, use_tqdm=False)
    three = LLM(dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=3)
    try:
        assert three.engine.kv_spec.num_kv_heads == 1
        got = three.generate(prompts(chosen), params, use_tqdm=False)
        for ref, out in zip(reference, got, strict=True):
            a, b = ref.outputs[0].token_ids, out.outputs[0].token_ids
            diverged = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if diverged is not None:  # allowed only on a near tie
                top2 = sorted((lp.logprob for lp in ref.outputs[0].logprobs[diverged].values()), reverse=True)[:2]
                assert top2[0] - top2[1] < 1e-4, (diverged, top2)
        # structured output: the grammar's mask applies on rank 0, where sampling is
        constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
        question = "Answer in JSON: which city is the capital of France?"
        text = three.generate(question, constrained, use_tqdm=False)[0].outputs[0].text
        assert json.loads(text)["city"] and text == smollm_fp32.generate(question, constrained,
                                                                         use_tqdm=False)[0].outputs[0].text
        assert_all_free(three)
    finally:
        three.shutdown()
    assert not any(p.is_alive() for p in three.engine.tensor_parallel.processes)


def test_a_torchrun_style_launch_meets_a_tp_worker_command(tiny_pair, monkeypatch):
    """Several machines: rank 1 is `pagedllm tp-worker`, rank 0 the engine, both given MASTER_ADDR,
    MASTER_PORT, RANK and WORLD_SIZE; the worker leaves when the engine shuts down."""
    import subprocess
    import sys

    from pagedllm.parallel.collectives import free_port

    folder, one, _ = tiny_pair
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "pagedllm", "tp-worker", "--model", folder, "--dtype", "float32",
                               "--num-kv-blocks", "32", "--tensor-parallel-size", "2"], env={**env, "RANK": "1"})
    try:
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.setenv("RANK", "0")
        llm = LLM(model=folder, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
        assert ids(llm.generate(prompts(PROMPTS), GREEDY, use_tqdm=False)) == ids(
            one.generate(prompts(PROMPTS), GREEDY, use_tqdm=False))
        llm.shutdown()
        assert worker.wait(30) == 0
    finally:
        worker.kill()


@pytest.mark.slow
def test_each_rank_runs_its_slice_of_the_gguf_blocks():
    """bfloat16, quantization auto: the GGUF's own Q4_1 blocks, sliced per rank on their 32-value
    groups (o_proj: 192 of 576 columns, down_proj: 512 of 1,536), serve the small steps on every
    rank; tokens equal one rank's save where its top two logits are within bfloat16's noise."""
    from pagedllm.models.quantized_linear import INT4_MATMULS

    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    prompt = "The capital of France is"
    one = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    three = LLM(dtype="bfloat16", kv_cache_memory="64MiB", tensor_parallel_size=3)
    try:
        assert three.engine.config.quantization == "gguf"
        layer = three.engine.runner.model.layers[0]
        int4 = INT4_MATMULS[three.engine.kernel_plan.int4_kernel]  # this CPU's 4-bit kernel on every slice
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.small_batch, int4)
        assert three.engine.runner.model.config.num_heads == 3
        ref = one.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = three.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        diverged = next((i for i, (x, y) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)) if x != y), None)
        if diverged is not None:
            top2 = sorted((lp.logprob for lp in ref.logprobs[diverged].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 0.1, (diverged, top2)
    finally:
        three.shutdown()
