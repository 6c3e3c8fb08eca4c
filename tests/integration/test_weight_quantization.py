"""Quantized weights: ``quantization="int8"`` (per output channel, from float safetensors) and AWQ
checkpoints (``quantization="awq"``, AutoAWQ's GEMM packing), each equal to a float reference
computed here, independently of the loader, layer by layer; the engine's tokens equal HF
transformers' on those dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.models.awq import round_to_groups
from pagedllm.models.loader import load_weights
from pagedllm.models.quantized_linear import INT4_MATMULS, Int8ChannelMatmul
from tests.conftest import hf_greedy, make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(60, 90))]
PROJECTIONS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
               "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM: column order_map[i] goes to nibble i


def fused_reference(state: dict[str, torch.Tensor], layer: int, projection: str) -> torch.Tensor:
    block, parts = PROJECTIONS[projection]
    return torch.cat([state[f"model.layers.{layer}.{block}.{p}.weight"].float() for p in parts])


def projection(llm: LLM, layer: int, name: str):
    model = llm.engine.runner.model.layers[layer]
    return getattr(model.self_attn if name in ("qkv_proj", "o_proj") else model.mlp, name)


def engine_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_tokens(folder: str, state: dict[str, torch.Tensor]) -> list[list[int]]:
    """HF transformers' greedy tokens for the folder's architecture with these (float) weights, every
    one of them given (its own AWQ loader is not used: it needs packages this project does not pin)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return [hf_greedy(model.eval(), p, GREEDY.max_tokens) for p in PROMPTS]


# -- int8 ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8") / "llama", "llama")


def int8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, written out: scale = max |w| / 127, codes = round(w / scale)."""
    scale = weight.abs().max(dim=1).values / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def test_int8_weights_equal_their_reference_layer_by_layer_and_drop_the_float_copy(llama_folder):
    state = load_file(f"{llama_folder}/model.safetensors")
    llm = LLM(model=llama_folder, dtype="float32", quantization="int8", block_size=8, num_kv_blocks=64)
    assert llm.engine.config.quantization == "int8"
    for layer in range(2):
        for name in PROJECTIONS:
            linear = projection(llm, layer, name)
            assert linear.weight is None  # only the int8 codes are kept
            kernel = linear.int8_weight
            assert isinstance(kernel, Int8ChannelMatmul) and linear.small_batch is kernel
            codes, scale = int8_reference(fused_reference(state, layer, name))
            assert torch.equal(kernel.codes, codes)
            torch.testing.assert_close(kernel.scale, scale, rtol=0, atol=0)
    # the LM head and embeddings stay float
    assert llm.engine.runner.model.lm_head.int8_weight is None


def test_int8_engine_tokens_equal_hf_on_the_dequantized_weights(llama_folder):
    state = load_file(f"{llama_folder}/model.safetensors")
    for key, value in state.items():
        if key.endswith("proj.weight"):
            codes, scale = int8_reference(value.float())
            state[key] = codes.float() * scale[:, None]
    expected = hf_tokens(llama_folder, state)
    for loop in ("auto", "python"):  # the C++ decoder stack and the Python loop
        llm = LLM(model=llama_folder, dtype="float32", quantization="int8", block_size=8, num_kv_blocks=64,
                  layer_loop=loop)
        assert engine_tokens(llm) == expected, loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_and_its_dense_path_equal_the_dequantized_linear(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    kernel = Int8ChannelMatmul.quantize(weight)
    reference = kernel.codes.float() * kernel.scale[:, None]
    assert (reference - weight).abs().max() <= kernel.scale.max() / 2 + 1e-6  # round to nearest
    from pagedllm.models.quantized_linear import Linear

    linear = Linear(64, 96, bias=True).to(dtype)
    linear.bias.data.copy_(bias)
    linear.use_int8_weight(kernel, max_rows=4)
    tolerance = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    for rows in (1, 4, 5, 40):  # the int8 kernel up to max_rows, dequantize-then-GEMM above
        x = torch.randn(rows, 64).to(dtype)
        expected = F.linear(x.float(), reference, bias)
        torch.testing.assert_close(linear(x).float(), expected, **tolerance)


# -- AWQ ------------------------------------------------------------------------------------------------
def awq_pack(columns: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, C] -> int32 [R, C / 8], AutoAWQ's packing (written out here, not the loader's)."""
    packed = torch.zeros(columns.shape[0], columns.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        packed |= columns[:, column::8].to(torch.int64) << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_quantize(weight: torch.Tensor, group: int):
    """RTN per group (``round_to_groups``): qweight, qzeros, scales packed by ``awq_pack`` above, and
    the float weight they dequantize to, computed here."""
    codes, zeros, scales = round_to_groups(weight, group)
    groups = codes.float().reshape(-1, group, codes.shape[1])
    dequantized = ((groups - zeros.float()[:, None]) * scales.float()[:, None]).reshape(codes.shape).t().contiguous()
    return awq_pack(codes), awq_pack(zeros), scales, dequantized


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    """A tiny random Llama (inputs of 128 and 256: whole groups of 128) stored AWQ-quantized, and the
    float weights it dequantizes to."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(8.0)
    folder = tmp_path_factory.mktemp("awq") / "llama-awq"
    model.save_pretrained(folder)
    state = load_file(f"{folder}/model.safetensors")
    stored, dequantized = {}, {}
    for key, value in state.items():
        if key.endswith("proj.weight"):
            prefix = key.removesuffix(".weight")
            qweight, qzeros, scales, dequantized[key] = awq_quantize(value, 128)
            stored |= {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
        else:
            stored[key] = value
    save_file(stored, f"{folder}/model.safetensors", metadata={"format": "pt"})
    reference = state | dequantized
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), dequantized, reference


def test_awq_loader_equals_the_dequantized_reference_layer_by_layer(awq_checkpoint):
    folder, dequantized, _ = awq_checkpoint
    loaded = load_weights(Path(folder))
    assert loaded.quant_format == "awq" and set(loaded.quantized) == set(dequantized)
    for name, expected in dequantized.items():
        assert torch.equal(loaded.state_dict[name], expected), name  # exact: s * (q - z) in float32
        assert torch.equal(loaded.quantized[name].dequantize(), expected), name


def test_awq_engine_tokens_equal_hf_and_its_4bit_kernels_run(awq_checkpoint):
    folder, dequantized, reference = awq_checkpoint
    expected = hf_tokens(folder, reference)
    dense = LLM(model=folder, dtype="float32", quantization="none", block_size=8, num_kv_blocks=64)
    assert engine_tokens(dense) == expected
    # bf16: the 4-bit path that serves GGUF's Q4 blocks runs small steps
    llm = LLM(model=folder, dtype="bfloat16", block_size=8, num_kv_blocks=64)
    assert llm.engine.config.quantization == "awq"  # auto picks it, as gguf for a GGUF
    assert_plans_4bit_kernel_runs(llm, dequantized)
    assert len(engine_tokens(llm)) == len(PROMPTS)


def assert_plans_4bit_kernel_runs(llm: LLM, dequantized: dict[str, torch.Tensor]) -> None:
    """Every projection's small steps run the kernel plan's 4-bit kernel (AWQ minimums, which float16
    cannot hold, included: our C++ kernels keep them in float32) and equal the dequantized product."""
    plan = llm.engine.kernel_plan
    dtype = plan.dtype
    for layer in range(2):
        for name in PROJECTIONS:
            linear = projection(llm, layer, name)
            assert isinstance(linear.small_batch, INT4_MATMULS[plan.int4_kernel]), (plan.family, dtype)
            x = torch.randn(3, linear.in_features).to(dtype)
            reference = F.linear(x.float(), fused_reference(dequantized, layer, name))
            tolerance = {torch.bfloat16: 3e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
            torch.testing.assert_close(linear.small_batch(x).float(), reference, rtol=tolerance,
                                       atol=tolerance * 16)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_awq_float16_and_float32_models_run_the_plans_4bit_kernel(awq_checkpoint, dtype):
    """torch's int4 kernel is fast with bf16 rows only (10x slower steps with float16 / float32 ones,
    docs/design.md): the plan gives these dtypes our C++ kernel, and AWQ's blocks must reach it."""
    folder, dequantized, _ = awq_checkpoint
    llm = LLM(model=folder, dtype=dtype, quantization="awq", block_size=8, num_kv_blocks=16)
    if not llm.engine.kernel_plan.int4_rows:  # a family without our kernel's vector body, float32: dense only
        assert all(projection(llm, i, n).small_batch is None for i in range(2) for n in PROJECTIONS)
        return
    assert_plans_4bit_kernel_runs(llm, dequantized)


def test_awq_and_unsupported_checkpoints_are_refused_by_name(awq_checkpoint, tmp_path):
    folder = awq_checkpoint[0]
    plain = make_tiny_checkpoint(tmp_path / "plain", "llama")
    with pytest.raises(ConfigError, match="quantization='awq' needs an AWQ checkpoint"):
        LLM(model=plain, quantization="awq", num_kv_blocks=16)
    with pytest.raises(ConfigError, match="quantization='int8' needs float weights"):
        LLM(model=folder, quantization="int8", num_kv_blocks=16)
    config_file = Path(plain) / "config.json"
    config = json.loads(config_file.read_text())
    for quant, message in (({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
                           ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8")):
        config_file.write_text(json.dumps(config | {"quantization_config": quant}))
        with pytest.raises(ModelLoadError, match=message):
            load_weights(Path(plain))
    config_file.write_text(json.dumps(config | {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                                        "group_size": 128}}))
    with pytest.raises(ModelLoadError, match="holds no .qweight tensors"):
        load_weights(Path(plain))
