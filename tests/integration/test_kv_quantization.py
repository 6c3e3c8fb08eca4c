"""kv_cache_dtype in the engine: each format gives the same tokens with prefix caching on and off,
however a prompt is chunked, through swaps and copy-on-write (n > 1, beam search), on a paged
and a contiguous pool; the pool holds blocks by the format's bytes; nothing leaks."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.attention.cpu_kernel import load_cpu_kernel
from pagedllm.errors import ConfigError
from pagedllm.kvstore.quant import QUANTIZED_FORMATS
from tests.conftest import make_tiny_checkpoint
from tests.integration.test_engine import assert_all_free

FORMATS = [*QUANTIZED_FORMATS, "bfloat16"]
SHARED = list(range(30, 70))  # 40 shared tokens: 5 full blocks of 8
PROMPTS = [SHARED + [5, 6, 7], SHARED + [9, 10, 11, 12, 13], list(range(100, 121))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvq") / "llama", "llama", seed=3)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_free(llm)
    return [[c.token_ids for c in o.outputs] for o in outs]


def engine(tiny: str, kv_cache_dtype: str, **options) -> LLM:
    """The tiny model at ``kv_cache_dtype``; the other options those of the test's first engine."""
    base = dict(model=tiny, dtype="float32", block_size=8, num_kv_blocks=96, max_num_batched_tokens=256,
                kv_cache_dtype=kv_cache_dtype)
    return LLM(**(base | options))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_each_format_gives_the_same_tokens_however_its_kv_was_written(tiny, kv_cache_dtype, backend):
    if backend == "cpu" and load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if backend == "cpu" and kv_cache_dtype == "bfloat16":
        backend = "auto"  # a bf16 cache under a float32 model: the C++ kernel reads only the model's dtype
    llm = engine(tiny, kv_cache_dtype, attention_backend=backend)
    assert llm.engine.kv_spec.kv_cache_dtype == kv_cache_dtype
    if backend == "cpu":  # the C++ layer loop runs the layers, its attention calls read the quantized cache
        assert llm.engine.runner.model._stack is not None
    expected = run(llm)
    # one request at a time: the later ones' shared prefix comes from the cache
    cached = [run(llm, [p])[0] for p in PROMPTS]
    assert llm.kv_cache_stats()["prefix_cache_hits"] >= 2 * len(SHARED)
    assert cached == expected
    same = dict(attention_backend=backend)
    assert run(engine(tiny, kv_cache_dtype, enable_prefix_caching=False, **same)) == expected
    # prompts prefilled in chunks of 8 tokens: later chunks read the stored K/V of earlier ones
    assert run(engine(tiny, kv_cache_dtype, max_num_batched_tokens=8, enable_prefix_caching=False, **same)) \
        == expected
    # a pool too small for all three: preempted to the host tier and swapped back in
    small = engine(tiny, kv_cache_dtype, num_kv_blocks=12, max_num_batched_tokens=64, preemption_mode="swap",
                   swap_space="8MiB", enable_prefix_caching=False, **same)
    assert run(small) == expected
    assert small.kv_cache_stats()["num_swapped_in_blocks"] > 0
    # the contiguous baseline
    assert run(engine(tiny, kv_cache_dtype, kv_layout="contiguous", max_model_len=64, **same)) == expected


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_forks_copy_the_quantized_blocks_on_write(tiny, kv_cache_dtype):
    llm = engine(tiny, kv_cache_dtype)
    one = run(llm, PROMPTS[:1])[0][0]
    before = llm.kv_cache_stats()["num_cow_copies"]
    siblings = run(llm, PROMPTS[:1], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert siblings == [one] * 3
    assert llm.kv_cache_stats()["num_cow_copies"] > before
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    beams = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0].sequences
    assert_all_free(llm)
    uncached = engine(tiny, kv_cache_dtype, enable_prefix_caching=False)
    again = uncached.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0].sequences
    assert len(beams) == 2 and [b.tokens for b in beams] == [b.tokens for b in again]
    assert_all_free(uncached)


def test_the_same_memory_holds_more_blocks_of_a_smaller_format(tiny):
    blocks = {name: engine(tiny, name, num_kv_blocks=None, kv_cache_memory="1MiB").kv_cache_stats()["num_blocks"]
              for name in ("float32", "bfloat16", "int8", "int4")}
    # tiny model: 2 layers x 2 KV heads x head size 16, 8-token blocks: 4,096 / 2,048 / 1,152 / 640 bytes
    assert blocks == {"float32": 256, "bfloat16": 512, "int8": 910, "int4": 1638}


def test_the_cpu_and_reference_backends_give_the_same_tokens_from_the_same_quantized_cache(tiny):
    if load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    for name in QUANTIZED_FORMATS:
        cpu, reference = (engine(tiny, name, attention_backend=b) for b in ("cpu", "reference"))
        assert run(cpu) == run(reference)


def test_a_backend_that_cannot_read_a_format_is_refused_by_name(tiny):
    if load_cpu_kernel() is not None:
        with pytest.raises(ConfigError, match="reads KV in the model's dtype"):
            engine(tiny, "float16", attention_backend="cpu")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        engine(tiny, "int3")


def test_a_format_measured_over_2_percent_says_so_when_the_engine_is_built(tiny, caplog):
    with caplog.at_level("WARNING", logger="pagedllm.engine.builder"):
        engine(tiny, "int8")
    assert not any("perplexity" in r.message for r in caplog.records)
    with caplog.at_level("WARNING", logger="pagedllm.engine.builder"):
        engine(tiny, "int4")
    assert any("kv_cache_dtype=int4 measured +" in r.message and "perplexity" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedllm.engine.builder"):
        engine(tiny, "fp8_e5m2")  # +4.7% measured; fp8_e4m3 +1.4% stays quiet
        engine(tiny, "fp8_e4m3")
    warned = [r.message for r in caplog.records if "perplexity" in r.message]
    assert len(warned) == 1 and "kv_cache_dtype=fp8_e5m2" in warned[0]


def test_the_triton_backend_reads_the_quantized_cache_as_the_reference(tiny):
    """int4 (rotated, two codes a byte) under TRITON_INTERPRET=1 here, compiled on a GPU: the same
    tokens as the reference backend (every format's kernel: tests/unit/test_triton_kernel.py)."""
    triton = engine(tiny, "int4", attention_backend="triton")
    assert triton.engine.runner.backend.name == "triton"
    prompts, short = PROMPTS[1:], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # interpreted: slow
    assert run(triton, prompts, short) == run(engine(tiny, "int4", attention_backend="reference"), prompts, short)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "int4"])
def test_static_scales_fill_every_written_row_and_every_path_reads_them_alike(tiny, tmp_path, kv_cache_dtype):
    """kv_cache_scales: each layer's K and V rows carry its static scale (the tiny model: 2 layers,
    2 KV heads); the tokens stay the same with and without the prefix cache and chunking, and on
    the C++ and reference backends."""
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [[0.05, 0.06], 0.07], "v_scale": 0.04}))
    backends = ["reference"] + (["cpu"] if load_cpu_kernel() is not None else [])
    results = []
    for backend in backends:
        llm = engine(tiny, kv_cache_dtype, attention_backend=backend, kv_cache_scales=str(path))
        results.append(run(llm))
        if backend == "cpu":  # the C++ layer loop stores the rows, with the static scales
            assert llm.engine.runner.model._stack is not None
        layers = llm.engine.runner.kv.layers
        used = layers[0].k_scale.view(-1, 2).float().abs().sum(1) > 0  # the slots written: scales never 0
        assert int(used.sum()) > 40
        expect = {0: ([0.05, 0.06], [0.04, 0.04]), 1: ([0.07, 0.07], [0.04, 0.04])}
        for i, (k, v) in expect.items():
            ks, vs = layers[i].k_scale.view(-1, 2)[used], layers[i].v_scale.view(-1, 2)[used]
            assert torch.equal(ks, torch.tensor(k).to(torch.bfloat16).expand_as(ks))
            assert torch.equal(vs, torch.tensor(v).to(torch.bfloat16).expand_as(vs))
        results.append(run(engine(tiny, kv_cache_dtype, attention_backend=backend, kv_cache_scales=str(path),
                                  enable_prefix_caching=False, max_num_batched_tokens=8)))
    assert all(r == results[0] for r in results)


def test_static_scales_are_refused_for_a_float_cache_and_when_malformed(tiny, tmp_path):
    with pytest.raises(ConfigError, match="static scales are for the quantized KV formats.*kv_cache_dtype=float32"):
        engine(tiny, "float32", kv_cache_scales=0.1)
    (tmp_path / "s.json").write_text(json.dumps({"k_scale": [1, 2, 3], "v_scale": 1}))
    with pytest.raises(ConfigError, match="k_scale lists 3 layers, the model has 2"):
        engine(tiny, "int8", kv_cache_scales=str(tmp_path / "s.json"))
    with pytest.raises(ConfigError, match="kv_cache_scales"):
        engine(tiny, "int8", kv_cache_scales=-2.0)
