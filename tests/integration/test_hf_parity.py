"""Greedy outputs equal HF transformers token for token (embedded SmolLM2, tiny Llama, tiny Qwen2)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.quantized_linear import INT4_MATMULS
from tests.conftest import hf_greedy, make_tiny_checkpoint

NEW_TOKENS = 32


@pytest.mark.slow
def test_smollm_batched_equals_hf_alone(smollm_fp32, hf_parity_expected, parity_prompts):
    assert smollm_fp32.engine.config.quantization == "none"  # float32 keeps dense weights only
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ours = smollm_fp32.generate([{"prompt_token_ids": p} for p in parity_prompts], params, use_tqdm=False)
    for prompt, out, expected in zip(parity_prompts, ours, hf_parity_expected, strict=True):
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    stats = smollm_fp32.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    smollm_fp32.engine.kv_manager.check_invariants()


def test_gguf_quantized_decode_in_float32_equals_hf(hf_parity_expected, parity_prompts):
    """quantization="gguf": decode steps read the GGUF's own 4/8-bit blocks where this CPU family's
    plan runs them (on AVX-512 and AVX2, our C++ 4-bit kernel up to 32 rows), prefill the dense
    copy; both are the same weights, so float32 greedy tokens still equal HF's."""
    llm = LLM(dtype="float32", quantization="gguf", kv_cache_memory="256MiB")
    assert llm.engine.config.quantization == "gguf"
    model, plan = llm.engine.runner.model, llm.engine.kernel_plan
    assert all((lin.small_batch is not None) == (plan.int4_rows > 0) for layer in model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj))
    assert model.lm_head.small_batch is not None and model.lm_head.max_rows == plan.q8_0_rows
    if plan.int4_rows:  # the plan's 4-bit kernel runs (on x86, ours: torch's has no fast float32 body)
        qkv = model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv.small_batch, INT4_MATMULS[plan.int4_kernel]) and qkv.max_rows == plan.int4_rows
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ours = llm.generate([{"prompt_token_ids": p} for p in parity_prompts], params, use_tqdm=False)
    for prompt, out, expected in zip(parity_prompts, ours, hf_parity_expected, strict=True):
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_checkpoint_equals_hf(tmp_path, arch, backend):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 5, 8, 9, 17, 40, 70]
    # Triton runs in its interpreter on CPU (~100 s for the full case): the lengths that still cover
    # one token, a block boundary, several blocks and a prompt chunked across steps, fewer tokens
    new_tokens, budget = 24, 64
    if backend == "triton" and not torch.cuda.is_available():
        lengths, new_tokens, budget = [1, 9, 17, 40], 10, 32
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    llm = LLM(model=folder, dtype="float32", block_size=8, num_kv_blocks=128, max_num_batched_tokens=budget,
              attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    assert llm.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        # ignore_eos on our side; HF must not stop early either
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, new_tokens, eos_token_id=None), f"len {len(prompt)}"
    assert llm.kv_cache_stats()["num_free_blocks"] == 128
    llm.engine.kv_manager.check_invariants()
