"""Quantized KV formats (kvstore/quant.py): round-trip error bounds, saturation, the rotation's
exact inverse, history-independent bytes, block counts, and the reference over quantized K/V."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import pagedllm
from pagedllm.attention.reference import ReferenceBackend, gather_blocks
from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.errors import ConfigError
from pagedllm.kvstore.quant import (
    INT4_LEVELS,
    INT4_POINTS,
    INT4_THRESHOLDS,
    QUANTIZED_FORMATS,
    KVCodec,
    rotation,
)
from pagedllm.kvstore.spec import KVSpec, LayerKV, kv_spec_for
from pagedllm.kvstore.storage import num_blocks_for
from tests.unit.test_reference_attention import HEAD_DIM, build_case

MODEL = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=64, max_position_embeddings=512)

# per element: |x - decode(encode(x))| <= rel * |x| + abs_of_scale * scale (the codes' half step;
# int4: half its widest gap between levels, the last)
BOUNDS = {"int8": (0.0, 0.5), "int4": (0.0, (INT4_POINTS[-1] - INT4_POINTS[-2]) / 2),
          "fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17)}


def rows(seed: int, shape=(37, 2, 64), magnitude: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * magnitude
    x[3, 0, 5] = 9.0 * magnitude  # an outlier in one row
    return x


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_round_trip_error_is_within_the_formats_bound(name, magnitude):
    codec = KVCodec(name, 64)
    x = codec.rotate(rows(1, magnitude=magnitude))
    codes, scale = codec.encode(x)
    assert codes.dtype == codec.dtype and codes.shape == (37, 2, codec.code_dim) and scale.shape == (37, 2)
    assert scale.dtype == torch.bfloat16
    back = codec.decode(codes, scale)
    rel, absolute = BOUNDS[name]
    bound = rel * x.abs() + absolute * scale.float().unsqueeze(-1) * 1.0001 + 1e-30
    assert ((back - x).abs() <= bound).all()
    # the row's largest magnitude is stored as the format's largest code (scale = absmax / qmax)
    assert torch.allclose(scale.float(), (x.abs().amax(-1) / codec.qmax).bfloat16().float())


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_zero_rows_store_scale_zero_and_decode_to_zeros(name):
    codec = KVCodec(name, 64)
    codes, scale = codec.encode(torch.zeros(4, 2, 64))
    assert (scale == 0).all() and (codec.decode(codes, scale) == 0).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_saturates_at_its_largest_finite_value_never_nan(name):
    codec = KVCodec(name, 64)
    x = torch.full((2, 1, 64), 1.0)
    x[:, :, 0] = 3e4  # absmax / fp8_max in float16 rounds, so x / scale can exceed fp8_max a little
    x[1, 0, 1] = -3e4
    codes, scale = codec.encode(x)
    assert torch.isfinite(codes.float()).all()
    assert codes.float().abs().max() == codec.qmax
    assert torch.isfinite(codec.decode(codes, scale)).all()


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    codec = KVCodec("int4", 4)
    x = torch.tensor([[[7.0, -7.0, INT4_POINTS[1], 0.0]]])  # levels: nibbles 15, 1, 10, 8
    codes, scale = codec.encode(x)
    assert scale.item() == 1.0
    assert codes.tolist() == [[[15 | (1 << 4), 10 | (8 << 4)]]]
    assert codec.decode(codes, scale).tolist() == x.tolist()


def test_int4_codes_each_value_as_its_nearest_level():
    """Every level codes to itself; any value to the level nearest it (the threshold between two
    levels, a midpoint, to the smaller magnitude); beyond +-7, the end levels."""
    levels = torch.tensor(INT4_LEVELS)
    assert levels[8] == 0 and torch.equal(levels[9:], -levels[1:8].flip(0)) and (levels[1:].diff() > 0).all()
    points = torch.tensor(INT4_POINTS)
    midpoints = (torch.cat([torch.zeros(1), points[:-1]]) + points) / 2
    torch.testing.assert_close(torch.tensor(INT4_THRESHOLDS), midpoints, atol=2e-7, rtol=0)
    codec = KVCodec("int4", 2)
    y = torch.cat([levels[1:], torch.linspace(-9.0, 9.0, 20001), torch.tensor(INT4_THRESHOLDS),
                   -torch.tensor(INT4_THRESHOLDS)])
    y = torch.stack([y, torch.zeros_like(y)], -1)[:, None, :]
    codes, scale = codec.encode(y, static_scale=torch.ones(1))  # beyond +-7: saturates
    assert (scale == 1).all()
    back = codec.decode(codes, scale)[:, 0, 0]
    x = y[:, 0, 0]
    nearest = levels[1:][(x[:, None] - levels[1:]).abs().argmin(1)]
    at_threshold = (x.abs()[:, None] == torch.tensor(INT4_THRESHOLDS)).any(1)
    assert torch.equal(back[~at_threshold], nearest[~at_threshold])
    lower = back[at_threshold].abs() < x[at_threshold].abs()
    assert lower.all()  # a tie goes to the smaller magnitude


def test_the_kernels_hold_int4s_levels_and_thresholds():
    """csrc/kv_codec.h and the Triton kernel write int4's levels and thresholds as literals: the
    same numbers as kvstore/quant.py's (their bytes are compared by the kernel tests too, but a
    threshold a hair apart would only show on a value that falls between the two)."""
    src = Path(pagedllm.__file__).parent
    header = (src / "csrc" / "kv_codec.h").read_text()
    levels = re.search(r"kInt4Levels\[16\] = \{([^}]*)\}", header).group(1)
    thresholds = re.search(r"kInt4Thresholds\[7\] = \{([^}]*)\}", header).group(1)
    assert [float(v.rstrip("f ")) for v in levels.split(",")] == list(INT4_LEVELS)
    assert [float(v.rstrip("f ")) for v in thresholds.split(",")] == list(INT4_THRESHOLDS)
    triton_source = (src / "attention" / "triton_kernel.py").read_text()
    assert all(f"a > {t!r}" in triton_source for t in INT4_THRESHOLDS)
    assert all(f"== {k}, {p!r}" in triton_source for k, p in enumerate(INT4_POINTS[:-1], start=1))


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_the_rotation_is_orthogonal_and_keeps_dot_products(head_dim):
    r = rotation(head_dim).double()
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    codec = KVCodec("int4", head_dim)
    q, k = torch.randn(5, head_dim), torch.randn(5, head_dim)
    torch.testing.assert_close((codec.rotate(q) * codec.rotate(k)).sum(-1), (q * k).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(codec.unrotate(codec.rotate(q)), q, atol=1e-5, rtol=1e-5)
    if head_dim == 64:  # the normalised Hadamard matrix: +-1/8 everywhere, symmetric
        assert torch.equal(r.abs(), torch.full_like(r, 1 / 8)) and torch.equal(r, r.T)


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_a_rows_bytes_do_not_depend_on_what_was_encoded_with_it(name):
    codec = KVCodec(name, 64)
    x = rows(2)
    codes, scale = codec.encode(x)
    for i in (0, 3, 36):
        one_codes, one_scale = codec.encode(x[i:i + 1])
        assert torch.equal(one_codes.view(torch.uint8), codes[i:i + 1].view(torch.uint8))
        assert torch.equal(one_scale, scale[i:i + 1])


@pytest.mark.parametrize("kv_cache_dtype,element_bytes,ratio", [
    ("bfloat16", 2 * 64, 1.0), ("float32", 4 * 64, 0.5), ("int8", 64 + 2, 1.93), ("fp8_e4m3", 64 + 2, 1.93),
    ("fp8_e5m2", 64 + 2, 1.93), ("int4", 32 + 2, 3.76)])
def test_the_pool_holds_blocks_by_the_formats_bytes(kv_cache_dtype, element_bytes, ratio):
    spec = kv_spec_for(MODEL, 16, kv_cache_dtype, torch.bfloat16)
    assert spec.kv_cache_dtype == kv_cache_dtype
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * element_bytes  # layers x (K, V) x tokens x heads x row
    cache = CacheConfig(block_size=16, kv_cache_memory="1GiB")
    bf16 = num_blocks_for(kv_spec_for(MODEL, 16, "bfloat16", torch.bfloat16), cache)
    assert num_blocks_for(spec, cache) / bf16 == pytest.approx(ratio, abs=0.01)
    layer = LayerKV.allocate(spec, 3)
    assert layer.nbytes * 2 == 3 * spec.bytes_per_block


def test_a_quantized_spec_must_match_its_codec():
    with pytest.raises(ValueError, match="int8 KV is stored as torch.int8 with per_token_head"):
        KVSpec(torch.int8, 2, 64, 16, 2, "per_block_head", "int8")
    with pytest.raises(ValueError, match="no quantized KV format 'int2'"):
        KVSpec(torch.int8, 2, 64, 16, 2, "per_token_head", "int2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        kv_spec_for(MODEL, 16, "int2", torch.float32)


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_the_reference_attends_over_the_decoded_cache(name):
    """Written through the reference, read back: the output equals attention over K/V that were
    decoded from the cache first (the rotated format: with Q rotated and the output rotated back)."""
    k, v, query, new_k, new_v, meta, _ = build_case([(40, 1), (9, 9), (33, 5)], 16, 4, 2, torch.float32, seed=4)
    codec = KVCodec(name, HEAD_DIM)
    spec = KVSpec(codec.dtype, 2, HEAD_DIM, 16, 1, "per_token_head", name)
    kv = LayerKV.allocate(spec, k.shape[0])
    plain = LayerKV(k.clone(), v.clone())
    backend = ReferenceBackend(HEAD_DIM ** -0.5)
    # fill every slot (the prefixes too) from the float cache, then write this step's rows
    slots = torch.arange(k.shape[0] * 16)
    backend_meta = type("M", (), {"slot_mapping": slots, "has_padding_slots": False})
    backend.write_kv(kv, k.view(-1, 2, HEAD_DIM), v.view(-1, 2, HEAD_DIM), backend_meta)
    out = backend.store_and_attend(query, new_k, new_v, kv, meta)
    decoded_k, decoded_v = gather_blocks(kv, torch.arange(k.shape[0]))
    r = rotation(HEAD_DIM) if codec.rotated else torch.eye(HEAD_DIM)
    expected_kv = LayerKV((decoded_k @ r.T).contiguous(), (decoded_v @ r.T).contiguous())
    expected = backend.forward(query, expected_kv, meta)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    # and it stays close to attention over the unquantized K/V
    backend.write_kv(plain, new_k, new_v, meta)
    exact = backend.forward(query, plain, meta)
    tolerance = {"int8": 0.03, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2, "int4": 0.35}[name]
    assert (out - exact).abs().max() < tolerance * exact.abs().max()


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_backends_without_a_format_refuse_it_naming_it(name):
    spec = kv_spec_for(MODEL, 16, name, torch.float32)
    ReferenceBackend(0.125).check_kv_spec(spec, torch.float32)
    from pagedllm.attention.base import AttentionBackend

    with pytest.raises(ConfigError, match=f"reads no kv_cache_dtype={name} KV"):
        AttentionBackend().check_kv_spec(spec, torch.float32)



def quantized_case(name: str, dtype: torch.dtype, ctx_and_new, num_heads: int = 8, seed: int = 5,
                   head_dim: int = HEAD_DIM):
    """A paged case whose prefix is stored in format ``name`` (by the reference), and a copy of it."""
    k, v, query, new_k, new_v, meta, _ = build_case(ctx_and_new, 16, num_heads, 2, dtype, seed=seed, head_dim=head_dim)
    codec = KVCodec(name, head_dim)
    spec = KVSpec(codec.dtype, 2, head_dim, 16, 1, "per_token_head", name)
    kv = LayerKV.allocate(spec, k.shape[0])
    slots = torch.arange(k.shape[0] * 16)
    ReferenceBackend(head_dim ** -0.5).write_kv(kv, k.view(-1, 2, head_dim), v.view(-1, 2, head_dim),
                                                 type("M", (), {"slot_mapping": slots, "has_padding_slots": False}))
    twin = LayerKV(*(t.clone() for t in kv.tensors), codec=kv.codec)
    return kv, twin, query, new_k, new_v, meta


def same_bytes(a: LayerKV, b: LayerKV) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.tensors, b.tensors, strict=True))


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
@pytest.mark.parametrize(("dtype", "num_heads", "head_dim"), [
    (torch.float32, 8, 64),    # decodes of G = 4 rows per kv head: the few-row path on AVX-512
    (torch.bfloat16, 8, 64),
    (torch.float32, 14, 64),   # G = 7: two row groups (4 + 3)
    (torch.float32, 24, 64),   # G = 12: decodes in the generic loop (as every tile on AVX2)
    (torch.bfloat16, 2, 128),  # G = 1, head size 128
])
def test_the_cpu_kernel_stores_the_references_bytes_and_attends_as_it(name, dtype, num_heads, head_dim):
    from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    # decodes (1 row), a fresh prefill, chunks over a cached prefix, 2 tiles; a decode at a block's
    # first key and one that fills it
    kv, twin, query, new_k, new_v, meta = quantized_case(
        name, dtype, [(40, 1), (70, 1), (17, 1), (32, 1), (9, 9), (33, 5), (50, 20)], num_heads=num_heads,
        head_dim=head_dim)
    scale = head_dim ** -0.5
    expected = ReferenceBackend(scale).store_and_attend(query, new_k, new_v, kv, meta)
    out = CpuBackend(scale, ops).store_and_attend(query, new_k, new_v, twin, meta)
    assert same_bytes(kv, twin)
    assert out.dtype == dtype
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)


def test_int8_decodes_of_a_bf16_query_with_nan_or_inf_are_nan_where_the_references_are():
    """Where the CPU has AVX512-VNNI, the scores of int8 keys take a bf16 query rounded to int16
    (int8_scores_int16); a query row holding NaN or inf must keep float32 scores, so that its
    output is NaN as the reference's (an int16 NaN is a finite garbage value), the others unharmed."""
    from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    # head size 64: the few-row path (int16 scores need 64 or 128)
    kv, twin, query, new_k, new_v, meta = quantized_case("int8", torch.bfloat16, [(40, 1), (70, 1), (17, 1)],
                                                         head_dim=64)
    query[0, 0, 3] = float("nan")
    query[1, 2, 5] = float("inf")
    scale = 64 ** -0.5
    expected = ReferenceBackend(scale).store_and_attend(query, new_k, new_v, kv, meta)
    out = CpuBackend(scale, ops).store_and_attend(query, new_k, new_v, twin, meta)
    assert expected[0, 0].isnan().all() and expected[1, 2].isnan().all()
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(out[finite].float(), expected[finite].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_the_cpu_kernels_fused_rope_store_attend_reads_a_quantized_layer(name):
    """rope_store_attend (the C++ layer loop's call) on a quantized layer: RoPE'd K encoded into
    the cache byte for byte as the reference path stores it, the same output."""
    from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    kv, twin, query, new_k, new_v, meta = quantized_case(name, torch.float32, [(40, 1), (33, 5)], num_heads=4)
    heads = 4
    positions = torch.cat([torch.arange(n - q, n) for n, q in ((40, 1), (33, 5))])
    angles = torch.arange(64).unsqueeze(1) * torch.linspace(0.1, 1.0, HEAD_DIM // 2)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)

    def rope(x):
        half = HEAD_DIM // 2
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * c + rotated * s

    qkv = torch.cat([query.reshape(len(positions), -1), new_k.reshape(len(positions), -1),
                     new_v.reshape(len(positions), -1)], 1)
    out = CpuBackend(HEAD_DIM ** -0.5, ops).rope_store_attend(qkv, cos, sin, positions, twin, meta, heads)
    expected = ReferenceBackend(HEAD_DIM ** -0.5).store_and_attend(rope(query), rope(new_k), new_v, kv, meta)
    assert same_bytes(kv, twin)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_the_cpu_backend_reads_every_quantized_format_for_its_head_sizes():
    from pagedllm.attention.cpu_kernel import CpuBackend, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    backend = CpuBackend(0.125, ops)
    for name in QUANTIZED_FORMATS:
        backend.check_kv_spec(kv_spec_for(MODEL, 16, name, torch.bfloat16), torch.bfloat16)
    odd = ModelConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=48, max_position_embeddings=512)
    backend.check_kv_spec(kv_spec_for(odd, 16, "int8", torch.float32), torch.float32)
    with pytest.raises(ConfigError, match="power-of-two head size"):
        backend.check_kv_spec(kv_spec_for(odd, 16, "int4", torch.float32), torch.float32)


@pytest.mark.parametrize("name", QUANTIZED_FORMATS)
def test_fresh_bf16_prefills_over_a_quantized_cache_through_sdpa(name):
    """Where fresh bf16 prefills go through torch's SDPA (AMX; set here on every family), a quantized
    layer's are attended over its stored rows decoded (int4 rotated back): the reference's output;
    the other sequences in the batch keep the kernel."""
    from pagedllm import cpu_features
    from pagedllm.attention.cpu_kernel import CpuBackend, dense_prefill_rows, load_cpu_kernel

    ops = load_cpu_kernel()
    if ops is None:
        pytest.skip("the C++ kernel cannot be built here")
    kv, twin, query, new_k, new_v, meta = quantized_case(name, torch.bfloat16, [(40, 40), (30, 1), (17, 17), (33, 5)],
                                                         num_heads=6)
    scale = HEAD_DIM ** -0.5
    expected = ReferenceBackend(scale).store_and_attend(query, new_k, new_v, kv, meta)
    backend = CpuBackend(scale, ops)  # sets this family's own setting
    try:
        ops.set_dense_prefill_min_rows(16)
        with torch.profiler.profile() as prof:
            out = backend.store_and_attend(query, new_k, new_v, twin, meta)
    finally:
        ops.set_dense_prefill_min_rows(dense_prefill_rows(cpu_features.current()))
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention") == 2
    assert same_bytes(kv, twin)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
