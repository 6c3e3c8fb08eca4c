"""The C++ CPU kernel equals the reference (and so dense SDPA) on every case the reference is tested on."""

from __future__ import annotations

import pytest
import torch

from pagedllm import cpu_features
from pagedllm.attention.cpu_kernel import CpuBackend, dense_prefill_rows, load_cpu_kernel
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.kvstore.spec import LayerKV
from tests.unit.test_reference_attention import HEAD_DIM, assert_matches_reference, build_case, run_and_compare

B = 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def backend():
    module = load_cpu_kernel()
    assert module is not None, "the C++ kernel must build on this machine (g++ is installed)"
    return CpuBackend(HEAD_DIM ** -0.5, module)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx", [1, B - 1, B, B + 1, 5 * B + 3, 4096])
def test_decode_matches_dense(backend, ctx, dtype):
    run_and_compare([(ctx, 1)], dtype=dtype, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_decode_and_chunked_prefill_batch(backend, dtype):
    run_and_compare([(1, 1), (B - 1, 1), (B + 1, 1), (300, 1), (40, 7), (100, 33), (17, 17)],
                    dtype=dtype, backend=backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_gqa_ratios_and_block_sizes(backend, num_heads, num_kv_heads, block_size):
    run_and_compare([(30, 1), (50, 12), (block_size, 1), (3, 3), (2 * block_size + 5, 20)],
                    block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, backend=backend)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_fresh_bf16_prefills_through_sdpa_match_dense(backend, num_heads, num_kv_heads):
    """With ``set_dense_prefill_min_rows(16)``, fresh bf16 prefills of >= 16 rows attend through
    torch's SDPA over K/V gathered from the pool (across blocks); the others in the same batch
    (shorter, chunked with a cached prefix, decode) keep the kernel. Every family runs this path
    here, whatever its own setting (AMX only, ``DENSE_PREFILL_MIN_ROWS``)."""
    seqs = [(40, 40), (30, 1), (17, 17), (100, 33), (16, 16), (15, 15)]
    calls = {}
    try:
        for rows in (16, 0):
            backend.ops.set_dense_prefill_min_rows(rows)
            with torch.profiler.profile() as prof:
                run_and_compare(seqs, dtype=torch.bfloat16, backend=backend, num_heads=num_heads,
                                num_kv_heads=num_kv_heads)
            calls[rows] = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
        assert calls[16] - calls[0] == 3  # (40, 40), (17, 17), (16, 16); the dense reference makes the rest
    finally:
        backend.ops.set_dense_prefill_min_rows(dense_prefill_rows(cpu_features.current()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_reference_output_and_cache_writes(backend, dtype):
    assert_matches_reference(backend, [(4096, 1), (77, 1), (500, 40), (16, 16)], 9, 3, dtype, seed=5)


def test_store_skips_padding_slots(backend):
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    backend.ops.store_kv(key, key * 2, [k_cache, v_cache], torch.tensor([5, -1, 0]))
    flat = k_cache.view(8, 1, 2)
    assert flat[5].eq(1).all() and flat[0].eq(1).all() and flat[[1, 2, 3, 4, 6, 7]].eq(0).all()


def test_without_a_compiler_auto_falls_back_to_the_reference_and_says_so_once(monkeypatch, caplog,
                                                                           without_installed_builds):
    import pagedllm.attention.cpu_kernel as ck
    from pagedllm.attention.backends import get_backend

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(ck.EXTENSION, "module", None)
    monkeypatch.setattr(ck.EXTENSION, "failure", None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level("WARNING"):
        assert ck.load_cpu_kernel() is None
        assert ck.load_cpu_kernel() is None
        backend = get_backend("auto", "cpu", 64)
    assert isinstance(backend, ReferenceBackend)
    warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "c++" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="unavailable"):
        get_backend("cpu", "cpu", 64)


def test_fused_store_and_attend_equals_store_then_attend(backend):
    k1, v1, query, new_k, new_v, meta, _ = build_case([(300, 1), (40, 9), (16, 16)], B, 9, 3, torch.bfloat16, seed=9)
    k2, v2 = k1.clone(), v1.clone()
    backend.write_kv(LayerKV(k1, v1), new_k, new_v, meta)
    separate = backend.forward(query, LayerKV(k1, v1), meta)
    fused = backend.store_and_attend(query, new_k, new_v, LayerKV(k2, v2), meta)
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(separate, fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_store_attend_equals_the_unfused_path(backend, dtype):
    from pagedllm.config import RopeScaling
    from pagedllm.models.layers import RotaryEmbedding

    heads, kv_heads = 9, 3
    k1, v1, _, _, _, meta, _ = build_case([(300, 1), (40, 9), (16, 16), (5, 1)], B, heads, kv_heads, dtype, seed=2)
    k2, v2 = k1.clone(), v1.clone()
    rotary = RotaryEmbedding(HEAD_DIM, 512, 100000.0, RopeScaling(), dtype)
    num_tokens = int(meta.slot_mapping.shape[0])
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * HEAD_DIM, generator=gen).to(dtype)
    positions = torch.tensor([p for i, ctx in enumerate(meta.seq_lens_list)
                              for p in range(ctx - (meta.query_start_loc_list[i + 1] - meta.query_start_loc_list[i]),
                                             ctx)])
    q, k, v = qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    q, k = rotary(positions, q.reshape(num_tokens, heads, HEAD_DIM), k.reshape(num_tokens, kv_heads, HEAD_DIM))
    unfused = backend.store_and_attend(q, k, v.reshape(num_tokens, kv_heads, HEAD_DIM), LayerKV(k1, v1), meta)
    fused = backend.rope_store_attend(qkv, rotary.cos, rotary.sin, positions, LayerKV(k2, v2), meta, heads)
    if dtype == torch.float32:  # same roundings as torch: bit for bit
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(unfused, fused)
    else:  # torch rounds each bf16/fp16 product; the kernel rounds once
        torch.testing.assert_close(k1.float(), k2.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(unfused.float(), fused.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [32, 48, 64])
def test_fused_rope_rounds_a_bf16_row_once_from_float32(head_dim):
    """The fused RoPE of a bf16 row: float32 products, no FMA, one rounding (as c10::BFloat16
    rounds), whether its dims run on vectors (16 or 8 at a time) or on the scalar tail (48: half a
    head of 24 dims is one 16-dim vector and 8 more on AVX-512)."""
    from pagedllm.config import RopeScaling
    from pagedllm.models.layers import RotaryEmbedding

    heads, kv_heads = 9, 3
    backend = CpuBackend(head_dim ** -0.5, load_cpu_kernel())
    k_cache, v_cache, _, _, _, meta, _ = build_case([(40, 9), (16, 16), (5, 1)], B, heads, kv_heads, torch.bfloat16,
                                                    seed=3, head_dim=head_dim)
    rotary = RotaryEmbedding(head_dim, 512, 100000.0, RopeScaling(), torch.bfloat16)
    num_tokens = int(meta.slot_mapping.shape[0])
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(4))
    qkv = qkv.bfloat16()
    positions = torch.tensor([p for i, ctx in enumerate(meta.seq_lens_list)
                              for p in range(ctx - (meta.query_start_loc_list[i + 1] - meta.query_start_loc_list[i]),
                                             ctx)])
    backend.rope_store_attend(qkv, rotary.cos, rotary.sin, positions, LayerKV(k_cache, v_cache), meta, heads)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim).float()
    cos, sin = rotary.cos[positions].float().unsqueeze(1), rotary.sin[positions].float().unsqueeze(1)
    half = head_dim // 2
    x1, x2 = k[..., :half], k[..., half:]
    once = torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]], -1)
    stored = k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
    assert torch.equal(stored, once.bfloat16())


@pytest.mark.parametrize("head_dim", [48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_head_dims_match_dense(monkeypatch, head_dim, dtype):
    """Head dims 32 (the tests above), 64 and 128 take the paths compiled for them: decode rows by
    dot products, prefill tiles of 8+ rows by register-tiled small GEMMs (on AVX-512 BF16, a bf16
    cache's Q K^T and P V by bf16 pairs, 32 keys then a last 16 per 64-key chunk: 61 keys end on two
    16s and an odd pair; 45 new tokens after 55 cached: the first tile's last chunk holds 7 keys, which
    its first rows do not see, and the key after them is real); 48 is the generic loop."""
    import tests.unit.test_reference_attention as tra

    monkeypatch.setattr(tra, "HEAD_DIM", head_dim)
    backend = CpuBackend(head_dim ** -0.5, load_cpu_kernel())
    run_and_compare([(1, 1), (B + 1, 1), (2048, 1), (300, 40), (33, 33), (61, 61), (100, 45)],
                    num_heads=9, num_kv_heads=3, dtype=dtype, backend=backend)


def test_out_of_pool_indices_raise_instead_of_touching_memory(backend):
    k_cache = torch.zeros(4, 8, 1, 64)
    v_cache = torch.zeros_like(k_cache)
    query = torch.randn(1, 1, 64)
    qsl, lens = torch.tensor([0, 1]), torch.tensor([9])
    with pytest.raises(RuntimeError, match="outside the pool"):
        backend.ops.paged_attention(query, [k_cache, v_cache], qsl, lens, torch.tensor([[0, 4]]), 0.125)
    with pytest.raises(RuntimeError, match="table has"):
        backend.ops.paged_attention(query, [k_cache, v_cache], qsl, lens, torch.tensor([[0]]), 0.125)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        backend.ops.store_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), [k_cache, v_cache], torch.tensor([32]))
    assert k_cache.eq(0).all() and v_cache.eq(0).all()
    qkv = torch.randn(1, 3 * 64)
    table = torch.zeros(16, 64)
    with pytest.raises(RuntimeError, match="RoPE table"):
        backend.ops.rope_store_attend(qkv, table, table, torch.tensor([16]), [k_cache, v_cache], torch.tensor([0]),
                                      qsl, torch.tensor([1]), torch.tensor([[0]]), 0.125, 1)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,new_tokens", [(9, 3, 1), (4, 2, 1), (3, 3, 3)])
def test_few_row_tiles_in_a_batch_equal_each_alone_and_dense(monkeypatch, head_dim, dtype, num_heads, num_kv_heads,
                                                             new_tokens):
    """Few-row tiles (1-3 rows per kv head: a decode token, or a 2-3 token chunk with one query
    head per kv head) take the ISA's few-row block step (decode_tile), one work item per (tile, kv
    head), over per-thread scratch reused from item to item: twelve such tiles in one call equal
    dense attention within the dtype's tolerance, and each sequence's output is bit-equal to a
    call on it alone (the same block step, the same order; no state left from the item before)."""
    import tests.unit.test_reference_attention as tra

    monkeypatch.setattr(tra, "HEAD_DIM", head_dim)
    contexts = [1, 2, B - 1, B, B + 1, 2 * B + 3, 83, 300, 5, 47, 64, 129]
    run_and_compare([(max(ctx, new_tokens), new_tokens) for ctx in contexts], num_heads=num_heads,
                    num_kv_heads=num_kv_heads, dtype=dtype, backend=CpuBackend(head_dim ** -0.5, load_cpu_kernel()))
    ops = load_cpu_kernel()
    generator = torch.Generator().manual_seed(0)
    per_seq = [(max(ctx, new_tokens) + B - 1) // B for ctx in contexts]
    pool = sum(per_seq) + 3
    k_cache, v_cache = (torch.randn(pool, B, num_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    order = torch.randperm(pool, generator=generator).tolist()
    tables = torch.zeros(len(contexts), max(per_seq), dtype=torch.long)
    at = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor(order[at:at + n])
        at += n
    lens = torch.tensor([max(ctx, new_tokens) for ctx in contexts])
    starts = torch.arange(len(contexts) + 1) * new_tokens
    query = torch.randn(len(contexts) * new_tokens, num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    together = ops.paged_attention(query, [k_cache, v_cache], starts, lens, tables, scale)
    for s in range(len(contexts)):
        rows = slice(s * new_tokens, (s + 1) * new_tokens)
        alone = ops.paged_attention(query[rows].contiguous(), [k_cache, v_cache], torch.tensor([0, new_tokens]),
                                    lens[s:s + 1], tables[s:s + 1].contiguous(), scale)
        assert torch.equal(alone, together[rows]), f"sequence {s} (context {contexts[s]})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_holding_nan_or_inf_gives_nan_where_the_reference_does(backend, dtype):
    """A NaN or an infinite query value makes its row's scores NaN or infinite, and the reference's
    output for that (row, head) NaN: the kernel's online softmax must keep it NaN on every ISA
    (AVX2's exp once clamped a NaN to exp(-87), a finite weight), the other rows unharmed. Decode
    rows (the few-row block step) and a prefill chunk's rows (the tiled path)."""
    k1, v1, query, new_k, new_v, meta, _ = build_case([(40, 1), (70, 1), (17, 1), (100, 33)], B, 6, 2, dtype,
                                                       seed=3)
    query[0, 0, 3] = float("nan")   # decode rows first (build_case's order)
    query[1, 2, 5] = float("inf")
    query[13, 4, 0] = -float("inf")  # the chunk's 11th row
    query[20, 1, 7] = float("nan")
    k2, v2 = k1.clone(), v1.clone()
    ref = ReferenceBackend(HEAD_DIM ** -0.5)
    ref.write_kv(LayerKV(k1, v1), new_k, new_v, meta)
    backend.write_kv(LayerKV(k2, v2), new_k, new_v, meta)
    expected = ref.forward(query, LayerKV(k1, v1), meta)
    out = backend.forward(query, LayerKV(k2, v2), meta)
    nan = expected.isnan()
    assert nan[0, 0].all() and nan[1, 2].all() and nan[13, 4].all() and nan[20, 1].all()
    assert torch.equal(out.isnan(), nan)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[~nan].float(), expected[~nan].float(), **tol)
