"""The C++ decoder stack (``models/decoder_stack.py``) computes exactly what the Python layer loop does.

Each case generates the same prompts twice on one engine, once per ``layer_loop``, with prefill
and decode steps of several rows mixed (prefix caching off, so the second run computes the same
shapes as the first), and compares the tokens and every logprob bit for bit
(equal logits need equal hidden states). A spy on the attention backend shows which loop ran:
the stack calls the attention from C++, never through the backend's Python method.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from pagedllm.cpu_features import matmul_dtype
from pagedllm.models import decoder_stack
from pagedllm.models.awq import awq_blocks, pack_columns, round_to_groups
from pagedllm.models.gguf_quant import decode_blocks
from pagedllm.models.quantized_linear import (
    INT4_MATMULS,
    Int4BlockMatmul,
    Int4Matmul,
    Int4TileMatmul,
    Int8BlockMatmul,
    Int8ChannelMatmul,
    Int8TileMatmul,
    NativePackedMatmul,
)
from tests.conftest import force_cpu_family, make_tiny_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def run(llm: LLM, prompts: list[list[int]], loop: str):
    """(tokens, logprobs) per prompt, and how many attention calls went through Python."""
    model, backend = llm.engine.runner.model, llm.engine.runner.backend
    model.finalize(backend, loop)
    calls = []
    fused = backend.rope_store_attend

    def spy(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    backend.rope_store_attend = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:
        del backend.rope_store_attend
        model.finalize(backend)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls)


def assert_stack_equals_python_loop(llm: LLM, prompts: list[list[int]]) -> None:
    assert llm.engine.runner.model.decoder_stack(llm.engine.runner.backend) is not None
    python, python_calls = run(llm, prompts, "python")
    cpp, cpp_calls = run(llm, prompts, "auto")
    assert python_calls > 0 and cpp_calls == 0
    for (tokens, logprobs), (cpp_tokens, cpp_logprobs) in zip(python, cpp, strict=True):
        assert cpp_tokens == tokens
        assert cpp_logprobs == logprobs  # every float, bit for bit
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def prompts_for(vocab: int, lengths=(1, 9, 30, 70), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def gguf_blocks(folder: str, kind: str) -> dict:
    """The checkpoint's projection weights as GGUF blocks of ``kind``, HF-named (as the loader gives them);
    kind "AWQ": as an AWQ checkpoint's groups of 32 give them (minimums float16 cannot hold)."""
    blocks = {}
    for name, w in load_file(f"{folder}/model.safetensors").items():
        if name.endswith("_proj.weight"):
            n, k = w.shape
            if kind == "AWQ":
                codes, zeros, scales = round_to_groups(w, 32)
                blocks[name] = awq_blocks(pack_columns(codes), pack_columns(zeros), scales, 32, name)
                continue
            data = gguf.quants.quantize(w.float().numpy().astype(np.float32), gguf.GGMLQuantizationType[kind])
            blocks[name] = decode_blocks(kind, data, n, k)
    return blocks


@pytest.mark.parametrize(("arch", "dtype", "kind", "native_bf16"), [
    ("llama", "float32", None, False),     # plain weights: at::linear, as F.linear
    ("qwen2", "bfloat16", None, False),    # prepacked oneDNN weights (widened where the CPU lacks bf16), q/k/v bias
    ("qwen2", "bfloat16", None, True),     # bf16 packed as bf16: the path of a CPU with AVX512-BF16 or AMX
    ("llama", "float16", None, False),     # float16 rounding between the ops (widened where the CPU lacks fp16 GEMMs)
    ("qwen2", "float32", "Q4_1", False),   # our C++ 4-bit kernel for small steps, with the bias added after it
    ("llama", "float16", "Q4_1", False),   # the same with float16 activations (the AVX-512 plans' kernel for them)
    ("llama", "float16", "AWQ", False),    # the same kernel with AWQ's (scale, minimum) pairs in float32
    ("llama", "bfloat16", "Q4_0", True),   # torch's 4-bit kernel
    ("llama", "bfloat16", "Q8_0", False),  # our Q8_0 kernel (attached even where its crossover is 0 rows)
    ("qwen2", "bfloat16", "Q4_1 tiles", True),  # our AVX-512 BF16 tile kernels (skipped where the build lacks them)
    ("qwen2", "bfloat16", "AWQ tiles", True),   # the 4-bit tiles with AWQ's float32 pairs
    ("llama", "bfloat16", "Q8_0 tiles", True),
])
def test_tiny_checkpoints_equal_the_python_loop(tmp_path, monkeypatch, arch, dtype, kind, native_bf16):
    if native_bf16:  # as the engine chooses on such a CPU; oneDNN emulates bf16 where the CPU lacks it
        force_cpu_family(monkeypatch, "avx512_bf16")  # skips where oneDNN packs no bf16 (AVX2-only CPUs)
    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    llm = LLM(model=folder, dtype=dtype, block_size=8, num_kv_blocks=128, max_num_batched_tokens=64,
              attention_backend="cpu", enable_prefix_caching=False)
    prompts = prompts_for(512)
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    widen = torch.float32 if half is not None and not native_bf16 and matmul_dtype(half) == torch.float32 else None
    # bf16: oneDNN's packed weights, or the AVX2 panel GEMM's panels where widened on AVX2; float32: plain ones
    panels = widen is not None and llm.engine.kernel_plan.dense_kernel == "panels"
    for layer in llm.engine.runner.model.layers:
        assert layer.mlp.down_proj.widen == widen and (layer.mlp.down_proj.panels is not None) == panels
        assert (layer.mlp.down_proj.packed is None) == (
            dtype == "float32" or (dtype == "float16" and widen is None) or panels)
    if kind is not None:
        kind, tiles = kind.removesuffix(" tiles"), kind.endswith(" tiles")
        if tiles and not llm.engine.runner.model.layer_ops.has_bf16_tiles():
            pytest.skip("this build has no AVX-512 BF16 tile kernels (AVX-512 BF16 CPUs only)")
        llm.generate([{"prompt_token_ids": [5]}], PARAMS, use_tqdm=False)  # builds the stack before the change
        model = llm.engine.runner.model
        int4_kernel = "tiles" if tiles else "cpp" if kind in ("Q4_1", "AWQ") else "torch"
        assert model.use_gguf_quantized(gguf_blocks(folder, kind), max_rows=8, int4_kernel=int4_kernel,
                                        q8_0_kernel="tiles" if tiles else "cpp") == 4 * model.config.num_layers
        # the stack must be rebuilt with the new kernels: a stale one would decode with the dense
        # weights, whose logprobs differ from the quantized ones the Python loop uses. Changed
        # weights undo finalize: no step runs the stale stack until it is called again
        backend = llm.engine.runner.backend
        assert model.decoder_stack(backend) is None
        with pytest.raises(RuntimeError, match="not finalised"):
            model.forward(torch.tensor([5]), torch.tensor([0]), None, llm.engine.runner.kv, backend)
        model.finalize(backend)
        kernel = model.layers[0].mlp.down_proj.small_batch
        expected = {"Q8_0": Int8BlockMatmul, "Q4_1": Int4BlockMatmul, "AWQ": Int4BlockMatmul, "Q4_0": Int4Matmul}[kind]
        if tiles:
            expected = Int8TileMatmul if kind == "Q8_0" else Int4TileMatmul
        assert isinstance(kernel, expected)
        if kind == "AWQ":
            assert kernel.scale_min.dtype == torch.float32
    assert_stack_equals_python_loop(llm, prompts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_int8_weights_equal_the_python_loop(tmp_path, dtype):
    """quantization="int8": the int8 kernel for steps of up to 16 rows (torch's for bf16 rows; on
    AVX-512 our C++ Q8_0 kernel for float32 and float16 ones, the plan's int8_kernel), the weight
    dequantized per call above (prompts of 30 and 70 tokens, steps of 64): both in C++, bit for bit
    the Python loop."""
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(model=folder, dtype=dtype, quantization="int8", block_size=8, num_kv_blocks=128,
              max_num_batched_tokens=64, attention_backend="cpu", enable_prefix_caching=False)
    down = llm.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(down.small_batch, Int8ChannelMatmul) and down.weight is None and down.max_rows == 16
    blocks = llm.engine.kernel_plan.int8_kernel == "cpp" and dtype != "bfloat16"
    assert down.small_batch.runs_blocks(getattr(torch, dtype)) == blocks
    assert_stack_equals_python_loop(llm, prompts_for(512))


def test_default_model_in_bf16_with_its_gguf_blocks_equals_the_python_loop():
    """The engine's own configuration: 4-bit blocks for decode steps, prepacked dense GEMMs for prefill."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    assert llm.engine.config.quantization == "gguf"
    int4 = INT4_MATMULS[llm.engine.kernel_plan.int4_kernel]
    assert isinstance(llm.engine.runner.model.layers[0].self_attn.qkv_proj.small_batch, int4)
    assert_stack_equals_python_loop(llm, prompts_for(llm.engine.config.model.vocab_size, (3, 20, 40)))


def test_the_python_loop_runs_where_the_stack_does_not_apply(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(model=folder, dtype="float32", block_size=8, num_kv_blocks=64, attention_backend="reference")
    model = llm.engine.runner.model
    assert model.decoder_stack(llm.engine.runner.backend) is None  # the reference backend is torch ops
    assert len(llm.generate([{"prompt_token_ids": [4, 5, 6]}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 10
    # a small-batch kernel the stack does not know keeps the whole model on the Python loop
    module = decoder_stack.EXTENSION.load()
    lin = model.layers[0].mlp.down_proj
    lin.use_quantized(NativePackedMatmul(torch.empty(0)), 1)
    assert decoder_stack.describe_projection(module, lin, model.dtype) is None
    model.finalize(llm.engine.runner.backend, "python")
    assert model.decoder_stack(llm.engine.runner.backend) is None


@pytest.mark.parametrize("family", ["avx2", "avx512"])
def test_widened_layers_keep_float32_between_the_ops(tmp_path, monkeypatch, family):
    """Where the GEMMs compute in float32 (here forced, as on a CPU without native bf16), the stack
    hands float32 rows from op to op: two dtype conversions per layer instead of the Python loop's
    eight (one into and one out of each projection), with the same results. Both widened dense
    kernels: the AVX2 panel GEMM (avx2) and oneDNN's packed float32 one (avx512)."""
    force_cpu_family(monkeypatch, family)  # no native bf16: float32 GEMMs, on any x86 CPU with AVX2
    folder = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    llm = LLM(model=folder, dtype="bfloat16", block_size=8, num_kv_blocks=64, attention_backend="cpu",
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert all(layer.mlp.down_proj.widen == torch.float32 for layer in model.layers)
    down = model.layers[0].mlp.down_proj
    assert (down.panels is not None, down.packed is not None) == ((True, False) if family == "avx2" else (False, True))
    assert_stack_equals_python_loop(llm, prompts_for(512, (3, 40)))
    copies = {}
    for loop in ("python", "auto"):
        model.finalize(llm.engine.runner.backend, loop)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([{"prompt_token_ids": list(range(10, 50))}], PARAMS, use_tqdm=False)  # 10 forwards
        copies[loop] = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
    assert copies["python"] - copies["auto"] == 6 * model.config.num_layers * PARAMS.max_tokens


def test_without_onednn_packing_a_bf16_model_keeps_plain_float32_weights(tmp_path, monkeypatch):
    """A CPU whose oneDNN packs nothing (forced: an x86 CPU without AVX2) widens each bf16 layer into
    a plain float32 copy (MKL's sgemm); the stack does not run that layout, so the Python loop does,
    and greedy tokens equal those of the float32 panel GEMM of an AVX2 CPU."""
    folder = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    prompts = [{"prompt_token_ids": p} for p in prompts_for(512, (3, 40))]
    tokens = {}
    for family in ("avx2", "baseline"):
        force_cpu_family(monkeypatch, family)
        llm = LLM(model=folder, dtype="bfloat16", block_size=8, num_kv_blocks=64, attention_backend="cpu")
        model = llm.engine.runner.model
        down = model.layers[0].mlp.down_proj
        assert down.widen == torch.float32 and down.packed is None
        assert (down.wide_weight is not None, down.panels is not None) == (family == "baseline", family == "avx2")
        assert (model.decoder_stack(llm.engine.runner.backend) is None) == (family == "baseline")
        assert llm.engine.kernel_plan.family == family and family in llm.engine.kernels_line()
        tokens[family] = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert tokens["baseline"] == tokens["avx2"]


def test_the_stack_takes_one_layer_kv_per_layer_and_refuses_scaled_kv(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama")
    llm = LLM(model=folder, dtype="float32", block_size=8, num_kv_blocks=16, attention_backend="cpu")
    runner = llm.engine.runner
    stack = runner.model.decoder_stack(runner.backend)
    if stack is None:
        pytest.skip("the C++ decoder stack does not apply here (no C++ layer ops)")
    from pagedllm.engine.model_runner import ScheduledChunk, build_metadata

    input_ids, positions, meta = build_metadata([ScheduledChunk("a", [5, 6, 7], 0, [0], True)], 8,
                                                torch.device("cpu"))
    model = runner.model

    def forward(layer_tensors):
        return stack.forward(model.embed_tokens(input_ids), positions, model.rotary.cos, model.rotary.sin,
                             layer_tensors, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables)

    layers = runner.kv.layer_tensors
    with torch.inference_mode():
        assert forward(layers).shape == (3, model.config.hidden_size)
        with pytest.raises(RuntimeError, match="one LayerKV per layer"):
            forward(layers[:-1])
        scales = torch.ones(runner.kv.num_blocks, model.config.num_kv_heads)
        with pytest.raises(RuntimeError, match="reads K/V without scales"):
            forward([(*layer, scales, scales) for layer in layers])
