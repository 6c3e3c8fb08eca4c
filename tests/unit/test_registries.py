"""Extension points are registries (name -> class or factory), and each option's choices list
exactly the registered names: a new backend, architecture or quantization method is one entry."""

from __future__ import annotations

import pytest

from pagedllm.attention import backends
from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.config import ATTENTION_BACKENDS, QUANTIZATIONS
from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.models import registry
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import LoadedWeights, model_config_from_hf
from pagedllm.models.quantization import QUANTIZATION_METHODS, resolve_quantization


def test_each_option_lists_exactly_the_registered_names():
    assert set(ATTENTION_BACKENDS) == {"auto", *backends.REGISTRY}
    assert set(QUANTIZATIONS) == {"auto", *QUANTIZATION_METHODS}
    assert set(registry.ARCHITECTURES) == {"llama", "mistral", "qwen2"}


def test_a_registered_backend_is_what_get_backend_returns(monkeypatch):
    class Probe(ReferenceBackend):
        name = "probe"

    monkeypatch.setitem(backends.REGISTRY, "probe", Probe)
    backend = backends.get_backend("probe", "cpu", 64)
    assert isinstance(backend, Probe) and isinstance(backend, AttentionBackend) and backend.scale == 64 ** -0.5
    assert isinstance(backends.get_backend("reference", "cpu", 16), ReferenceBackend)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        backends.get_backend("flash", "cpu", 64)
    assert backends.auto_backend("cuda:0") == "triton" and backends.auto_backend("mps") == "reference"


def test_architectures_resolve_through_the_registry(monkeypatch):
    assert registry.model_class("qwen2") is LlamaForCausalLM
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        registry.model_class("gpt2")
    hf = {"model_type": "gemma", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    with pytest.raises(ModelLoadError, match="'gemma' is not supported"):
        model_config_from_hf(hf)
    monkeypatch.setitem(registry.ARCHITECTURES, "gemma", LlamaForCausalLM)  # a new family: one entry
    assert model_config_from_hf(hf).architecture == "gemma"


def test_quantization_methods_decide_where_they_apply():
    cfg = model_config_from_hf({"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "max_position_embeddings": 64})
    plain = LoadedWeights(cfg, {}, None, is_gguf=False)
    blocks = LoadedWeights(cfg, {}, None, is_gguf=True, quantized={"w": object()})
    assert resolve_quantization("auto", blocks, "bfloat16", "cpu") == "gguf"
    assert resolve_quantization("auto", blocks, "float32", "cpu") == "none"
    assert resolve_quantization("auto", plain, "bfloat16", "cpu") == "none"
    with pytest.raises(ConfigError, match="quantization='gguf' runs on CPU only"):
        resolve_quantization("gguf", blocks, "bfloat16", "cuda")
    awq = LoadedWeights(cfg, {}, None, is_gguf=False, quantized={"w": object()})
    assert resolve_quantization("auto", awq, "bfloat16", "cpu") == "awq"
    assert resolve_quantization("auto", awq, "float32", "cpu") == "none"
    assert resolve_quantization("int8", plain, "float32", "cpu") == "int8"  # never picked by auto
    assert resolve_quantization("int8", blocks, "bfloat16", "cpu") == "int8"  # a GGUF's dequantized weights
    for method, weights, device, why in (("awq", plain, "cpu", "needs an AWQ checkpoint"),
                                         ("awq", blocks, "cpu", "needs an AWQ checkpoint"),
                                         ("gguf", awq, "cpu", "needs a GGUF model"),
                                         ("int8", awq, "cpu", "needs float weights"),
                                         ("int8", plain, "cuda", "runs on CPU only")):
        with pytest.raises(ConfigError, match=f"quantization='{method}' {why}"):
            resolve_quantization(method, weights, "bfloat16", device)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        resolve_quantization("gptq", plain, "bfloat16", "cpu")
