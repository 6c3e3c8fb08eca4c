"""Triton kernels equal the reference (so dense SDPA); on CPU they run under TRITON_INTERPRET=1
(set in tests/conftest.py before anything imports triton), on a GPU compiled, through ``OnCuda``.
Shapes are small: the interpreter is slow."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.attention.triton_kernel import TritonBackend
from pagedllm.kvstore.quant import QUANTIZED_FORMATS, KVCodec
from pagedllm.kvstore.spec import KVSpec, LayerKV
from tests.unit.test_reference_attention import HEAD_DIM, assert_matches_reference, run_and_compare

B = 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class OnCuda(AttentionBackend):
    """A backend run on the GPU for cases built on the CPU: inputs are copied to CUDA, and the caches
    and outputs back (compiled Triton kernels cannot read CPU memory; the interpreter can)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name

    def write_kv(self, kv: LayerKV, key, value, meta: AttentionMetadata) -> None:
        on_gpu = on_cuda(kv)
        self.inner.write_kv(on_gpu, key.cuda(), value.cuda(), metadata_on_cuda(meta))
        for mine, theirs in zip(kv.tensors, on_gpu.tensors, strict=True):
            mine.copy_(theirs)

    def forward(self, query, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        return self.inner.forward(query.cuda(), on_cuda(kv), metadata_on_cuda(meta)).cpu()


def on_cuda(kv: LayerKV) -> LayerKV:
    """The layer's tensors (scales, static ones too) copied to the GPU, its codec kept."""
    return LayerKV(kv.k.cuda(), kv.v.cuda(), *(None if t is None else t.cuda() for t in (kv.k_scale, kv.v_scale)),
                   codec=kv.codec, static_scales=None if kv.static_scales is None else kv.static_scales.cuda())


def metadata_on_cuda(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cuda(), query_start_loc=meta.query_start_loc.cuda(),
                               seq_lens=meta.seq_lens.cuda(), block_tables=meta.block_tables.cuda())


@pytest.fixture(scope="module")
def backend():
    triton_backend = TritonBackend(HEAD_DIM ** -0.5)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton_backend if interpreted or not torch.cuda.is_available() else OnCuda(triton_backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx", [1, B - 1, B, B + 1, 70])
def test_decode_matches_dense(backend, ctx, dtype):
    run_and_compare([(ctx, 1)], dtype=dtype, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_decode_and_chunked_prefill_with_cached_prefix(backend, dtype):
    run_and_compare([(1, 1), (B + 1, 1), (40, 7), (20, 20), (33, 5)], dtype=dtype, backend=backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 32])
def test_gqa_ratios_and_block_sizes(backend, num_heads, num_kv_heads, block_size):
    run_and_compare([(9, 1), (block_size + 3, 4)], block_size=block_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, backend=backend)


def test_long_context_decode(backend):
    run_and_compare([(4096, 1)], dtype=torch.bfloat16, num_heads=3, num_kv_heads=1, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_and_attention_equal_the_reference(backend, dtype):
    assert_matches_reference(backend, [(50, 1), (30, 9)], 6, 2, dtype, seed=4)


def test_store_skips_padding_slots(backend):
    from pagedllm.attention.metadata import AttentionMetadata

    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    meta = AttentionMetadata(torch.tensor([5, -1, 0]), torch.arange(4), torch.ones(3, dtype=torch.long),
                             torch.zeros(3, 1, dtype=torch.long), 3, [0, 1, 2, 3], [1, 1, 1], True)
    backend.write_kv(LayerKV(k_cache, v_cache), key, key * 2, meta)
    flat = k_cache.view(8, 1, 2)
    assert flat[5].eq(1).all() and flat[0].eq(1).all() and flat[[1, 2, 3, 4, 6, 7]].eq(0).all()


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_quantized_kv_is_stored_and_read_as_the_reference_does(backend, name):
    """Every quantized format: the reference's bytes (the torch codec writes them), and the output of
    attention over the decoded cache (int4: the query rotated, the output rotated back), for
    decodes at a block's first and last key, a fresh prefill and a chunk over a cached prefix."""
    from pagedllm.attention.reference import ReferenceBackend
    from tests.unit.test_kv_quant import quantized_case, same_bytes

    kv, twin, query, new_k, new_v, meta = quantized_case(name, torch.float32, [(17, 1), (32, 1), (9, 9), (33, 5)],
                                                         num_heads=4)
    scale = HEAD_DIM ** -0.5
    expected = ReferenceBackend(scale).store_and_attend(query, new_k, new_v, kv, meta)
    out = backend.store_and_attend(query, new_k, new_v, twin, meta)
    assert same_bytes(kv, twin)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def _store_both(backend, name, key, value, slots, head_dim, static=None):
    """The rows stored by the reference (the torch codec) and by ``backend``: (theirs, ours)."""
    codec = KVCodec(name, head_dim)
    spec = KVSpec(codec.dtype, key.shape[1], head_dim, B, 1, "per_token_head", name)
    theirs, ours = (LayerKV.allocate(spec, 4, static_scales=static) for _ in range(2))
    meta = type("M", (), {"slot_mapping": slots, "has_padding_slots": bool((slots < 0).any())})
    ReferenceBackend(0.125).write_kv(theirs, key, value, meta)
    backend.write_kv(ours, key, value, meta)
    return theirs, ours


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
@pytest.mark.parametrize(("dtype", "head_dim", "static"), [
    (torch.float32, 64, None), (torch.bfloat16, 64, None),
    (torch.float32, 48, None),  # int4: not a power of two, rotated by its matrix before the kernel
    (torch.float32, 64, [[0.02, 0.05], [0.01, 0.3]]),  # static scales: values beyond them saturate
])
def test_the_triton_store_quantizes_on_write_to_the_references_bytes(backend, name, dtype, head_dim, static):
    """store_kv_quant_kernel: codes and scales byte for byte the torch codec's, for random rows, a row
    of zeros, rows of large values and padding slots (left untouched)."""
    from tests.unit.test_kv_quant import same_bytes

    gen = torch.Generator().manual_seed(3)
    key = (torch.randn(24, 2, head_dim, generator=gen) * 3).to(dtype)
    value = torch.randn(24, 2, head_dim, generator=gen).to(dtype)
    key[0], value[1, 1] = 0, 0
    key[2] *= 1e4
    value[3, 0, 5] = -3e4
    slots = torch.randperm(4 * B, generator=gen)[:24]
    slots[[4, 9]] = -1
    static = None if static is None else torch.tensor(static)
    theirs, ours = _store_both(backend, name, key, value, slots, head_dim, static)
    assert same_bytes(ours, theirs)
    assert ours.k_scale.view(-1, 2)[slots[slots >= 0]].float().gt(0).any()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_triton_store_rounds_fp8_to_nearest_even_everywhere(backend, name):
    """Every fp8 value, every midpoint between neighbours (ties go to the even code), and points a
    quarter step either side, stored with a static scale of 1 (codes = the values themselves):
    the bytes torch's cast gives. A rounding that carries into the exponent (1.9375 -> 2) is among them."""
    fp8 = KVCodec(name, 64).dtype
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    quarter = (values[1:] - values[:-1]) / 4
    points = torch.cat([values, mids, mids - quarter, mids + quarter])
    rows = torch.nn.functional.pad(points, (0, -points.numel() % 128)).view(-1, 2, 64)
    slots = torch.arange(rows.shape[0])
    theirs, ours = _store_both(backend, name, rows, -rows, slots, 64, torch.ones(2, 2))
    from tests.unit.test_kv_quant import same_bytes

    assert same_bytes(ours, theirs)
