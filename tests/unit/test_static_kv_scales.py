"""kv_cache_scales: static KV scales parsed and validated by name, encoded by the torch codec and
the C++ store alike (the scale slot holds the static value, values beyond it saturate)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.attention.reference import ReferenceBackend
from pagedllm.kvstore.quant import INT4_POINTS, QUANTIZED_FORMATS, KVCodec
from pagedllm.kvstore.spec import KVSpec, LayerKV
from pagedllm.kvstore.static_scales import StaticKVScales
from tests.unit.test_kv_quant import same_bytes


def test_a_number_applies_to_every_layer_and_head():
    scales = StaticKVScales.parse("0.25", num_layers=3, num_kv_heads=2)
    assert scales.k == scales.v == ((0.25, 0.25),) * 3
    assert StaticKVScales.parse(2, 1, 1).k == ((2.0,),)


def test_a_json_file_gives_scales_per_layer_and_per_head(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [0.5, [0.125, 0.25]], "v_scale": 0.75}))
    scales = StaticKVScales.parse(str(path), num_layers=2, num_kv_heads=2)
    assert scales.k == ((0.5, 0.5), (0.125, 0.25))
    assert scales.v == ((0.75, 0.75), (0.75, 0.75))
    assert torch.equal(scales.layer(1), torch.tensor([[0.125, 0.25], [0.75, 0.75]]))


@pytest.mark.parametrize(("content", "message"), [
    ({"k_scale": [0.5], "v_scale": 1}, "k_scale lists 1 layers, the model has 2"),
    ({"k_scale": 1, "v_scale": [1, [1, 2, 3]]}, r"v_scale\[1\] lists 3 KV heads, the model has 2"),
    ({"k_scale": -1, "v_scale": 1}, "k_scale of layer 0, KV head 0 must be a positive finite number"),
    ({"k_scale": 1e-45, "v_scale": 1}, "below bfloat16's range"),
    ({"k_scale": "big", "v_scale": 1}, "k_scale must be a number, got 'big'"),
    ({"k_scale": 1}, "must hold an object with k_scale and v_scale"),
    ({"k_scale": 1, "v_scale": 1, "q_scale": 1}, r"unknown keys \['q_scale'\]"),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        StaticKVScales.parse(str(path), num_layers=2, num_kv_heads=2)


def test_neither_a_number_nor_a_readable_json_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a number nor a JSON file"):
        StaticKVScales.parse(str(tmp_path / "missing.json"), 1, 1)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        StaticKVScales.parse(str(tmp_path / "bad.json"), 1, 1)
    with pytest.raises(ValueError, match="must be a positive finite number"):
        StaticKVScales.parse("nan", 1, 1)


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_the_codec_encodes_with_the_static_scale_and_saturates_beyond_it(name):
    codec = KVCodec(name, 16)
    rows = torch.randn(5, 2, 16)
    rows[0, 0, 3] = 1e4  # far beyond scale * qmax: saturates
    static = torch.tensor([0.01, 0.3])
    codes, scale = codec.encode(codec.rotate(rows), static)
    assert torch.equal(scale, static.to(torch.bfloat16).expand(5, 2))
    decoded = codec.decode(codes, scale)
    bound = static.to(torch.bfloat16).float().view(1, 2, 1) * codec.qmax
    assert bool((decoded.abs() <= bound * (1 + 1e-6)).all())
    assert decoded[0, 0].abs().max() == bound[0, 0, 0]  # the saturated row reaches the range's end
    # within range, a static scale decodes as close as the format allows
    small = rows.clamp(-0.5, 0.5) * 0.01
    codes, scale = codec.encode(small, torch.tensor([0.001, 0.001]))
    error = (codec.decode(codes, scale) - small).abs()
    if name == "int8":  # half a code step, plus the scale's bfloat16 rounding
        assert error.max() <= 0.0005 + 1e-6
    elif name == "int4":  # half the widest step between its levels (the last)
        assert error.max() <= 0.001 * (INT4_POINTS[-1] - INT4_POINTS[-2]) / 2 + 1e-6
    else:  # half an fp8 unit in the last place: 2^-4 (e4m3) or 2^-3 (e5m2) of the value
        relative = 2.0 ** -4 if name == "fp8_e4m3" else 2.0 ** -3
        assert bool((error <= small.abs() * relative * 1.01 + 1e-6).all())


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_the_cpu_store_writes_the_references_bytes_with_static_scales(name):
    from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    codec = KVCodec(name, 64)
    spec = KVSpec(codec.dtype, 2, 64, 16, 1, "per_token_head", name)
    static = torch.tensor([[0.02, 0.05], [0.01, 0.3]])
    ours, theirs = (LayerKV.allocate(spec, 4, static_scales=static) for _ in range(2))
    key, value = torch.randn(40, 2, 64) * 3, torch.randn(40, 2, 64)
    meta = type("M", (), {"slot_mapping": torch.randperm(64)[:40], "has_padding_slots": False})
    ReferenceBackend(0.125).write_kv(theirs, key, value, meta)
    CpuBackend(0.125, ops).write_kv(ours, key, value, meta)
    assert same_bytes(ours, theirs)
    written = ours.k_scale.view(-1, 2)[meta.slot_mapping]
    assert torch.equal(written, static[0].to(torch.bfloat16).expand(40, 2))
    assert torch.equal(ours.v_scale.view(-1, 2)[meta.slot_mapping], static[1].to(torch.bfloat16).expand(40, 2))


def test_static_scales_belong_to_a_quantized_layer_of_their_shape():
    float_spec = KVSpec(torch.float32, 2, 64, 16, 1)
    with pytest.raises(ValueError, match="static scales are for a quantized KV format"):
        LayerKV.allocate(float_spec, 2, static_scales=torch.ones(2, 2))
    spec = KVSpec(torch.int8, 2, 64, 16, 1, "per_token_head", "int8")
    with pytest.raises(ValueError, match=r"must be float32 \[2, 2\]"):
        LayerKV.allocate(spec, 2, static_scales=torch.ones(2, 3))
    layer = LayerKV.allocate(spec, 2, static_scales=torch.ones(2, 2))
    assert len(layer.tensors) == 4 and len(layer.kernel_tensors) == 5  # block copies never move the scales


def test_a_tensor_parallel_rank_keeps_its_kv_heads_share_of_the_scales(tmp_path):
    """Per-head scales are written for the whole model; a rank's pool (holding 1 of 2 KV heads at
    tensor_parallel_size=2) reads the model's list and keeps its own head's scale."""
    from pagedllm.config import CacheConfig
    from pagedllm.errors import ConfigError
    from pagedllm.kvstore.storage import static_kv_scales

    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [[0.125, 0.25], [0.5, 1.0]], "v_scale": [[2.0, 4.0], 8.0]}))
    cache = CacheConfig(kv_cache_dtype="int8", kv_cache_scales=str(path))
    rank_spec = KVSpec(torch.int8, 1, 64, 16, 2, "per_token_head", "int8")  # one KV head per rank
    first, second = (static_kv_scales(cache, rank_spec, rank, 2) for rank in (0, 1))
    assert (first.k, first.v) == (((0.125,), (0.5,)), ((2.0,), (8.0,)))
    assert (second.k, second.v) == (((0.25,), (1.0,)), ((4.0,), (8.0,)))
    with pytest.raises(ConfigError, match="lists 2 KV heads, the model has 4"):
        static_kv_scales(cache, KVSpec(torch.int8, 2, 64, 16, 2, "per_token_head", "int8"), 0, 2)
