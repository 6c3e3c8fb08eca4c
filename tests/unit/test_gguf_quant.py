"""GGUF Q4_0/Q4_1/Q8_0 blocks decode to codes and scales that dequantize exactly as gguf does."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.models.gguf_quant import BlockQuantized, decode_blocks
from pagedllm.models.loader import unpermute_qk


def quantized(kind: str, rows: int = 12, cols: int = 96, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
    dense = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    return decode_blocks(kind, data, rows, cols), dense


@pytest.mark.parametrize("kind,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
def test_dequantizes_exactly_like_gguf(kind, bits):
    blocks, dense = quantized(kind)
    assert blocks.bits == bits and blocks.shape == (12, 96)
    assert torch.equal(blocks.dequantize(), dense)
    if bits == 4:
        assert int(blocks.codes.min()) >= 0 and int(blocks.codes.max()) <= 15
    else:
        assert blocks.minimum is None and blocks.codes.dtype == torch.int8


def test_row_maps_and_concatenation_follow_the_dense_weights():
    a, dense_a = quantized("Q4_1", rows=16, seed=1)
    b, dense_b = quantized("Q4_1", rows=8, seed=2)
    permuted = a.map_rows(lambda t: unpermute_qk(t, 4))
    assert torch.equal(permuted.dequantize(), unpermute_qk(dense_a, 4))
    fused = BlockQuantized.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([dense_a, dense_b]))
    q8, _ = quantized("Q8_0")
    assert BlockQuantized.cat([a, q8]) is None  # mixed kinds stay dense


def test_safetensors_entries_round_trip():
    blocks, dense = quantized("Q4_0")
    entries = {"other": torch.zeros(1), **blocks.tensors("w")}
    back = BlockQuantized.from_tensors(entries)
    assert list(entries) == ["other"] and torch.equal(back["w"].dequantize(), dense)


def test_rejects_mismatched_shapes_and_unsupported_types():
    with pytest.raises(ValueError, match="not kept quantized"):
        decode_blocks("Q4_K", np.zeros((1, 144), np.uint8), 1, 256)
    with pytest.raises(ValueError, match="do not match"):
        BlockQuantized(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="minimum"):
        BlockQuantized(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 2), None)


def test_default_model_keeps_its_blocks_and_dense_weights_agree():
    from pagedllm.models.loader import default_model_path, load_weights

    w = load_weights(default_model_path())
    assert len(w.quantized) == 30 * 7 + 1  # every Q4_1 projection and the Q8_0 embedding
    assert w.quantized["model.embed_tokens.weight"].bits == 8
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(w.quantized[name].dequantize(), w.state_dict[name])


def test_a_gguf_cache_write_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A full disk while the converted GGUF (~0.7 GB) is written: the load still returns the
    weights, and no half-written folder stays in the cache (it was left there, never removed)."""
    import safetensors.torch

    from pagedllm.models.loader import default_model_path, load_weights

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    loaded = load_weights(default_model_path())
    assert "model.norm.weight" in loaded.state_dict
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_the_gguf_cache_keeps_only_folders_a_load_can_use(tmp_path, monkeypatch):
    """A new cache folder drops those of GGUFs that changed or are gone (a new .venv moves the default
    model) and those of older cache versions; the current one is what the next load reads."""
    import os
    import shutil

    from pagedllm.models.loader import default_model_path, gguf_cache_key, load_weights

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf"
    old_version = root / "0123456789abcdef"  # written before source.json existed
    old_version.mkdir(parents=True)
    (old_version / "weights.safetensors").write_bytes(b"stale")
    model = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), model)
    first = load_weights(model)
    assert sorted(f.name for f in root.iterdir()) == [gguf_cache_key(model)]
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a new key
    load_weights(model)
    assert sorted(f.name for f in root.iterdir()) == [gguf_cache_key(model)]
    again = load_weights(model)  # from the cache
    assert torch.equal(again.state_dict["model.norm.weight"], first.state_dict["model.norm.weight"])
    assert set(again.quantized) == set(first.quantized)
