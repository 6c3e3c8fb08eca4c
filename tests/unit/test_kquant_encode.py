"""GGUF K-quants (Q4_K, Q5_K, Q6_K): our encoders write bytes that ``gguf``'s dequantization reads
back within each format's rounding error, and the loader reads a GGUF holding them exactly as
``gguf`` dequantizes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.models.kquant_encode import encode, requantize_gguf
from pagedllm.models.loader import default_model_path, load_weights

# relative RMS error of round-to-nearest on Gaussian weights: each extra bit halves it
RELATIVE_RMS_BOUND = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.022}


@pytest.mark.parametrize("kind", list(RELATIVE_RMS_BOUND))
def test_encoded_blocks_dequantize_within_the_format_error(kind):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    x[0, :256] = 0.0                      # an all-zero super-block
    x[1, 256:] = np.linspace(-1, 3, 256)  # a skewed one (the minimum matters for Q4_K/Q5_K)
    encoded = encode(kind, x)
    assert encoded.shape == (6, 2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1])
    y = gguf.quants.dequantize(encoded, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(y[0, :256], np.zeros(256, dtype=np.float32))
    error = y - x
    assert np.sqrt((error[2:] ** 2).mean() / (x[2:] ** 2).mean()) < RELATIVE_RMS_BOUND[kind]
    skewed = np.abs(error[1, 256:]).max()
    levels = 63 if kind == "Q6_K" else 31 if kind == "Q5_K" else 15
    assert skewed <= 4.0 / levels  # within a code step or so of the 4-wide range


def test_rejects_rows_that_are_not_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        encode("Q4_K", np.zeros((2, 576), dtype=np.float32))
    with pytest.raises(ValueError, match="no encoder for Q3_K"):
        encode("Q3_K", np.zeros((2, 256), dtype=np.float32))


def test_the_loader_reads_k_quants_exactly_as_gguf_dequantizes_them(tmp_path):
    source, target = default_model_path(), tmp_path / "k-quants.gguf"
    layer_of = {"Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
    kinds = {f"blk.{layer}.ffn_down.weight": kind for kind, layer in layer_of.items()}
    # SmolLM2's down projections are its only rows of 1,536 values: the others (576) are not whole super-blocks
    assert requantize_gguf(source, target, lambda name: kinds.get(name, "Q4_K" if "attn_q" in name else None)) == \
        list(kinds)
    reader = gguf.GGUFReader(str(target))
    loaded = load_weights(target, use_cache=False)
    reference = load_weights(source).state_dict
    for kind, layer in layer_of.items():
        tensor = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_down.weight")
        assert tensor.tensor_type.name == kind
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert name not in loaded.quantized  # not kept as blocks: dequantized
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
        assert torch.equal(loaded.state_dict[name], expected)
        error = (loaded.state_dict[name] - reference[name]).norm() / reference[name].norm()
        assert error.item() < RELATIVE_RMS_BOUND[kind] * 1.5
    # every other tensor is copied as it was (and kept as its GGUF blocks)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.6.mlp.down_proj.weight"):
        assert torch.equal(loaded.state_dict[name], reference[name])
        assert name in loaded.quantized
