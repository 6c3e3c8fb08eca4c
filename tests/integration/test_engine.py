"""The engine end to end on the embedded SmolLM2 (float32): batch invariance, preemption, errors,
stops, seeds, chat, accounting."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams, cpu_features
from pagedllm.cpu_features import matmul_dtype
from pagedllm.errors import InvalidRequest, RequestTooLong
from pagedllm.models.kernel_plan import plan_kernels
from pagedllm.models.quantized_linear import (
    INT4_MATMULS,
    Q8_0_MATMULS,
    Linear,
    NativePackedMatmul,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    llm.engine.kv_manager.check_invariants()
    assert not llm.engine.scheduler.requests and not llm.engine._requests and not llm.engine._owner


@pytest.fixture(scope="module")
def batched_reference(smollm_fp32, parity_prompts):
    prompts = [{"prompt_token_ids": p} for p in parity_prompts]
    return prompts, token_ids(smollm_fp32.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.slow
def test_one_at_a_time_equals_all_together(smollm_fp32, batched_reference):
    prompts, together = batched_reference
    alone = [token_ids(smollm_fp32.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert alone == together
    assert_all_free(smollm_fp32)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_still_gives_identical_outputs(batched_reference, mode):
    prompts, together = batched_reference
    # 12 blocks of 16 tokens = 192 slots for 8 requests of up to 121 tokens: preemption is certain
    small = LLM(dtype="float32", num_kv_blocks=12, max_num_batched_tokens=64, preemption_mode=mode,
                swap_space="32MiB")
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    stats = small.kv_cache_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
        assert stats["swap_in_copy_seconds"] > 0
    assert token_ids(outs) == together
    assert sum(o.metrics.num_preemptions for o in outs) == small.kv_cache_stats()["num_preemptions"]
    assert_all_free(small)


def test_outputs_come_back_in_input_order_with_prompt_fields(smollm_fp32):
    prompts = ["Hello", "The sky is", "1, 2, 3,"]
    outs = smollm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tok = smollm_fp32.get_tokenizer()
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt == p and o.prompt_token_ids == tok.encode(p)
        assert o.finished and len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    assert_all_free(smollm_fp32)


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-2),
    dict(top_k=-5), dict(n=0), dict(min_p=1.5), dict(presence_penalty=2.5), dict(repetition_penalty=0.0),
    dict(min_tokens=20, max_tokens=10)])
def test_invalid_params_raise_and_the_llm_still_works(smollm_fp32, batched_reference, bad):
    with pytest.raises(ValueError):
        smollm_fp32.generate("hi", SamplingParams(**bad), use_tqdm=False)
    prompts, together = batched_reference
    # the same greedy tokens as before the refusal: the first 4 of two prompts (a short check, 11 cases)
    first = SamplingParams(temperature=0.0, max_tokens=4)
    assert token_ids(smollm_fp32.generate(prompts[:2], first, use_tqdm=False)) == [t[:4] for t in together[:2]]
    assert_all_free(smollm_fp32)


def test_too_long_prompt_is_rejected_naming_the_limit_and_nothing_leaks(smollm_fp32, batched_reference):
    limit = smollm_fp32.engine.config.scheduler.max_model_len
    with pytest.raises(RequestTooLong, match=f"max_model_len \\({limit}\\)"):
        smollm_fp32.generate(["ok", {"prompt_token_ids": [5] * limit}], GREEDY, use_tqdm=False)
    assert_all_free(smollm_fp32)
    prompts, together = batched_reference
    assert token_ids(smollm_fp32.generate(prompts[3:5], GREEDY, use_tqdm=False)) == together[3:5]


def test_request_bigger_than_the_pool_is_rejected():
    llm = LLM(dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(RequestTooLong, match="num_kv_blocks=4"):
        llm.generate({"prompt_token_ids": [7] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [7] * 40}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10
    assert_all_free(llm)


@pytest.mark.parametrize("prompt,match", [("", "empty"), ([], "empty"), ([10**9], "token ids"),
                                          (3.5, "string or a list"), ({"nothing": 1}, "prompt_token_ids")])
def test_malformed_prompts_raise_invalid_request(smollm_fp32, prompt, match):
    with pytest.raises(InvalidRequest, match=match):
        smollm_fp32.generate([prompt], GREEDY, use_tqdm=False)
    assert_all_free(smollm_fp32)


def test_stop_string_truncates_text_and_finishes(smollm_fp32):
    base = smollm_fp32.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[4:6]
    assert stop.strip()
    out = smollm_fp32.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    inc = smollm_fp32.generate("Count: 1, 2, 3,", SamplingParams(
        temperature=0, max_tokens=12, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[:text.find(stop) + len(stop)]
    assert_all_free(smollm_fp32)


def test_stop_token_ids_and_ignore_eos(smollm_fp32):
    base = smollm_fp32.generate("The sky is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ids = base[0].outputs[0].token_ids
    out = smollm_fp32.generate("The sky is", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[3]]),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:4] and out.finish_reason == "stop" and out.stop_reason == ids[3]
    chat = [{"role": "user", "content": "Say hi."}]
    natural = smollm_fp32.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in smollm_fp32.engine.eos_token_ids
    forced = smollm_fp32.chat(chat, SamplingParams(temperature=0, max_tokens=len(natural.token_ids) + 3,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert forced.finish_reason == "length" and forced.token_ids[:len(natural.token_ids)] == natural.token_ids


def test_seeded_sampling_is_reproducible_alone_or_batched(smollm_fp32):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=16)
    alone = token_ids(smollm_fp32.generate("Tell me a story", p, use_tqdm=False))[0]
    batched = token_ids(smollm_fp32.generate(
        ["Other prompt", "Tell me a story", "x"], [SamplingParams(temperature=1.0, max_tokens=9), p,
                                                   SamplingParams(temperature=0.5, max_tokens=20)],
        use_tqdm=False))[1]
    assert alone == batched
    other = token_ids(smollm_fp32.generate("Tell me a story", SamplingParams(
        temperature=0.9, top_p=0.9, top_k=40, seed=99, max_tokens=16), use_tqdm=False))[0]
    assert other != alone


def test_top_k_one_is_greedy(smollm_fp32, batched_reference):
    prompts, together = batched_reference
    outs = smollm_fp32.generate(prompts[:3], SamplingParams(temperature=1.3, top_k=1, max_tokens=24), use_tqdm=False)
    assert token_ids(outs) == together[:3]


def test_chat_applies_the_template(smollm_fp32):
    out = smollm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text


def test_abort_mid_generation_frees_blocks(smollm_fp32):
    engine = smollm_fp32.engine
    engine.add_request("x", "Once upon a time", SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("y", "Hello there", SamplingParams(temperature=0, max_tokens=3))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    assert engine.abort("x") and not engine.abort("x")
    while engine.has_unfinished():
        engine.step()
    assert_all_free(smollm_fp32)


@pytest.mark.parametrize("reservation", ["max_model_len", "request"])
def test_contiguous_layout_gives_the_paged_outputs(batched_reference, reservation):
    prompts, together = batched_reference
    llm = LLM(dtype="float32", kv_layout="contiguous", contiguous_reservation=reservation,
              max_model_len=256, num_kv_blocks=40)
    assert llm.kv_cache_stats()["kv_layout"] == "contiguous"
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == together
    assert_all_free(llm)


def test_quantization_option_resolves_and_rejects_what_cannot_apply(tmp_path):
    from pagedllm.engine.builder import resolve_quantization
    from pagedllm.models.loader import default_model_path, load_weights
    from tests.conftest import make_tiny_checkpoint

    gguf = load_weights(default_model_path())
    assert resolve_quantization("auto", gguf, "bfloat16", "cpu") == "gguf"
    assert resolve_quantization("auto", gguf, "float32", "cpu") == "none"  # exact HF parity by default
    assert resolve_quantization("auto", gguf, "bfloat16", "cuda") == "none"
    assert resolve_quantization("none", gguf, "bfloat16", "cpu") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf", gguf, "bfloat16", "cuda")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", gguf, "bfloat16", "cpu")
    folder = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        LLM(model=folder, dtype="bfloat16", quantization="gguf", num_kv_blocks=16)
    assert LLM(model=folder, dtype="bfloat16", num_kv_blocks=16).engine.config.quantization == "none"


def test_bf16_engine_prepacks_weights_and_logits_equal_dense():
    """The kernels follow this CPU family's plan (``kernel_plan``; each family's plan is checked in
    tests/unit/test_cpu_features.py), and every path gives the logits of the dense weights."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    model, plan = llm.engine.runner.model, llm.engine.kernel_plan
    assert plan == plan_kernels(cpu_features.detect(), torch.bfloat16)
    assert plan.family in llm.engine.kernels_line()
    assert model.embed_tokens.weight is not None  # the tied head dropped only its own reference
    # oneDNN's layout where the plan packs, our float32 panels instead where it picks the panel GEMM
    panels = plan.dense_kernel == "panels"
    assert all(layer.mlp.down_proj.packed is not None for layer in model.layers) == (plan.pack and not panels)
    assert all(layer.mlp.down_proj.panels is not None for layer in model.layers) == panels
    assert (model.lm_head.packed is not None) == (plan.pack and not panels)
    assert (model.lm_head.panels is not None) == panels
    # float32 GEMMs exactly where this CPU lacks native bf16 ones (every family must pass this)
    widened = matmul_dtype(torch.bfloat16) == torch.float32
    assert plan.widened == widened
    assert all((lin.widen == torch.float32) == widened for lin in model.modules() if isinstance(lin, Linear))
    # the GGUF kernels' crossovers are the family's: 4-bit blocks in every layer...
    qkv = model.layers[0].self_attn.qkv_proj
    int4 = INT4_MATMULS[plan.int4_kernel]
    assert isinstance(qkv.small_batch, int4) and qkv.max_rows == plan.int4_rows
    # ...and the LM head on its Q8_0 blocks, or (AVX-512 without BF16) the bf16 weight natively
    # packed for one row, half float32's bytes, or (AMX) the packed dense head at every size
    head = model.lm_head
    if plan.q8_0_rows:
        assert isinstance(head.small_batch, Q8_0_MATMULS[plan.q8_0_kernel]) and head.max_rows == plan.q8_0_rows
    elif plan.native_head_rows:
        assert isinstance(head.small_batch, NativePackedMatmul) and head.max_rows == plan.native_head_rows
    else:
        assert head.small_batch is None
    small = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = torch.nn.functional.linear(small.float(), model.embed_tokens.weight.float())
    tol = 2**-7 if plan.q8_0_rows == 0 else 3e-2  # Q8_0 blocks are the GGUF's weights, not the bf16 table's
    torch.testing.assert_close(model.compute_logits(small), exact, rtol=tol, atol=tol)
    rows = max(plan.q8_0_rows, plan.native_head_rows) + 4  # past the small-batch kernels: the dense head
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits = model.compute_logits(hidden)
    if widened:  # the float32 product rounded to bf16 once; the sum's order may move a rare ulp
        exact = torch.nn.functional.linear(hidden.float(), model.embed_tokens.weight.float())
        torch.testing.assert_close(logits, exact, rtol=2**-8, atol=1e-3)
        assert (logits != exact.bfloat16().float()).float().mean() < 1e-3
    else:
        assert torch.equal(logits, torch.nn.functional.linear(hidden, model.embed_tokens.weight).float())
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
