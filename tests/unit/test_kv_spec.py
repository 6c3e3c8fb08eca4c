"""The KV data plane's one type: KVSpec sizes the pool, LayerKV is what storage, host tier, every
attention backend and the C++ decoder stack take (kvstore/spec.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends import get_backend
from pagedllm.attention.cpu_kernel import load_cpu_kernel
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.errors import ConfigError
from pagedllm.kvstore.host_tier import HostTier
from pagedllm.kvstore.spec import KVSpec, LayerKV
from pagedllm.kvstore.storage import KVCacheStorage, num_blocks_for
from tests.unit.test_reference_attention import HEAD_DIM, build_case

MODEL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def test_bytes_per_block_counts_k_v_every_layer_and_the_scales():
    plain = KVSpec.for_model(MODEL, 16, torch.bfloat16)
    assert plain.bytes_per_block == 3 * 2 * (16 * 2 * 16 * 2)  # layers x (K, V) x tokens x heads x dim x 2 bytes
    scaled = KVSpec.for_model(MODEL, 16, torch.int8, scale_layout="per_block_head")
    assert scaled.bytes_per_block == 3 * 2 * (16 * 2 * 16 * 1 + 2 * 4)  # int8 elements + a float32 per KV head
    one_rank = KVSpec.for_model(MODEL, 16, torch.bfloat16, num_kv_heads=1)
    assert one_rank.bytes_per_block * 2 == plain.bytes_per_block


def test_a_spec_with_scales_holds_fewer_blocks_in_the_same_memory_counted_exactly():
    memory = 1_000_000
    plain = KVSpec.for_model(MODEL, 16, torch.int8)
    scaled = KVSpec.for_model(MODEL, 16, torch.int8, scale_layout="per_block_head")
    cache = CacheConfig(block_size=16, kv_cache_memory=memory)
    assert num_blocks_for(plain, cache) == memory // (3 * 2 * 512) == 325
    assert num_blocks_for(scaled, cache) == memory // (3 * 2 * (512 + 8)) == 320
    storage = KVCacheStorage.allocate(scaled, 320)
    assert storage.nbytes == 320 * scaled.bytes_per_block <= memory


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "bfloat16", "KVSpec.dtype"), ("num_kv_heads", 0, "KVSpec.num_kv_heads"),
    ("block_size", 1.5, "KVSpec.block_size"), ("num_layers", True, "KVSpec.num_layers"),
    ("scale_layout", "per_token", "KVSpec.scale_layout")])
def test_a_bad_spec_raises_naming_its_field(field, value, message):
    args = dict(dtype=torch.bfloat16, num_kv_heads=2, head_dim=16, block_size=16, num_layers=2)
    args[field] = value
    with pytest.raises(ValueError, match=message):
        KVSpec(**args)


def test_layer_kv_tensors_and_shapes_follow_the_spec():
    spec = KVSpec.for_model(MODEL, 8, torch.int8, scale_layout="per_block_head")
    layer = LayerKV.allocate(spec, 5)
    assert layer.k.shape == layer.v.shape == (5, 8, 2, 16) and layer.dtype == torch.int8
    assert layer.k_scale.shape == (5, 2) and layer.k_scale.dtype == torch.float32
    assert layer.tensors == (layer.k, layer.v, layer.k_scale, layer.v_scale) and layer.has_scales
    plain = LayerKV.allocate(KVSpec.for_model(MODEL, 8, torch.float32), 5)
    assert plain.tensors == (plain.k, plain.v) and not plain.has_scales
    with pytest.raises(ValueError, match="both have scales or neither"):
        LayerKV(plain.k, plain.v, layer.k_scale)
    with pytest.raises(ValueError, match="differ"):
        LayerKV(plain.k, plain.v[:4])


def test_copy_on_write_and_swaps_move_the_scales_with_their_blocks():
    spec = KVSpec.for_model(MODEL, 4, torch.int8, scale_layout="per_block_head")
    storage = KVCacheStorage.allocate(spec, 6)
    for i, layer in enumerate(storage.layers):
        for j, tensor in enumerate(layer.tensors):
            tensor.copy_(torch.arange(6).view(6, *[1] * (tensor.dim() - 1)).expand_as(tensor) + 10 * i + j)
    storage.copy_blocks([(1, 4), (2, 5)])
    for i, layer in enumerate(storage.layers):
        for j, tensor in enumerate(layer.tensors):
            assert tensor[4].eq(1 + 10 * i + j).all() and tensor[5].eq(2 + 10 * i + j).all()
    host = HostTier(storage, 3)
    host.swap_out([(3, 0), (0, 2)])
    host.start_swap_in([(0, 1), (2, 5)])
    host.wait()
    for i, layer in enumerate(storage.layers):
        for j, tensor in enumerate(layer.tensors):
            assert tensor[1].eq(3 + 10 * i + j).all() and tensor[5].eq(0 + 10 * i + j).all()


def scaled_copy(kv: LayerKV) -> LayerKV:
    scales = torch.ones(kv.num_blocks, kv.k.shape[2])
    return LayerKV(kv.k, kv.v, scales, scales.clone())


BACKENDS = ["reference", "cpu"]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_takes_a_layer_kv_and_refuses_a_format_it_cannot_read(name):
    if name == "cpu" and load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    k, v, query, new_k, new_v, meta, _ = build_case([(40, 1), (9, 9)], 16, 4, 2, torch.float32, seed=3)
    backend = get_backend(name, "cpu", HEAD_DIM)
    reference_kv = LayerKV(k.clone(), v.clone())
    ReferenceBackend(HEAD_DIM ** -0.5).write_kv(reference_kv, new_k, new_v, meta)
    kv = LayerKV(k, v)
    out = backend.store_and_attend(query, new_k, new_v, kv, meta)
    assert torch.equal(kv.k, reference_kv.k) and torch.equal(kv.v, reference_kv.v)
    torch.testing.assert_close(out, ReferenceBackend(HEAD_DIM ** -0.5).forward(query, reference_kv, meta),
                               atol=1e-5, rtol=1e-4)
    spec = KVSpec.for_model(MODEL, 16, torch.int8, scale_layout="per_block_head")
    with pytest.raises(ConfigError, match="scale layout 'per_block_head'"):
        backend.check_kv_spec(spec, torch.float32)
    with pytest.raises(ConfigError, match="the model's dtype"):
        backend.check_kv_spec(KVSpec.for_model(MODEL, 16, torch.int8), torch.float32)
    backend.check_kv_spec(KVSpec.for_model(MODEL, 16, torch.float32), torch.float32)


def test_the_cpu_kernel_refuses_scaled_kv_at_its_own_door():
    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    k, v, query, new_k, new_v, meta, _ = build_case([(20, 1)], 16, 4, 2, torch.float32)
    scaled = scaled_copy(LayerKV(k, v))
    with pytest.raises(RuntimeError, match="reads K/V without scales"):
        ops.paged_attention(query, scaled.tensors, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25)
    with pytest.raises(RuntimeError, match="reads K/V without scales"):
        ops.store_kv(new_k, new_v, scaled.tensors, meta.slot_mapping)
    layouts = r"\(k, v\), \(k, v, k_scale, v_scale\) or \(k, v, k_scale, v_scale, static_scales\)"
    with pytest.raises(RuntimeError, match=layouts):
        ops.paged_attention(query, [k], meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25)


def test_the_kernel_abi_capsule_is_the_layer_kv_version():
    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    import ctypes

    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    assert get_name(ops.rope_store_attend_fn) == b"pagedllm.rope_store_attend.v3"
