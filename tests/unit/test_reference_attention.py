"""Reference paged attention equals dense scaled_dot_product_attention.

Context lengths 1, B-1, B, B+1 and many blocks; ragged batches; decode and chunked prefill over
a cached prefix; GQA; float32 and bfloat16. K/V are scattered over shuffled physical blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.reference import ReferenceBackend, blockwise_attention, write_kv
from pagedllm.engine.model_runner import build_metadata
from pagedllm.engine.scheduler import ScheduledChunk
from pagedllm.kvstore.spec import LayerKV

HEAD_DIM = 32


def dense_attention(q, k, v, ctx):
    """q [Q, H, D] for the last Q positions of a ctx-long sequence; k, v [ctx, KH, D]."""
    nq, h, _ = q.shape
    g = h // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1).float()
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1).float()
    q_pos = torch.arange(ctx - nq, ctx).unsqueeze(1)
    mask = torch.arange(ctx).unsqueeze(0) <= q_pos
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), kk, vv, attn_mask=mask)
    return out.transpose(0, 1)


def build_case(ctx_and_new, block_size, num_heads, num_kv_heads, dtype, seed=0, head_dim=None):
    """Random sequences written into a shuffled paged cache. Returns what the backend needs.
    ``head_dim``: the module's ``HEAD_DIM`` (read at the call: tests patch it) unless given."""
    head_dim = HEAD_DIM if head_dim is None else head_dim
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-ctx // block_size) for ctx, _ in ctx_and_new) + 3
    k_cache = torch.zeros(total_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(total_blocks, generator=gen).tolist()
    seqs, chunks = [], []
    for i, (ctx, new) in enumerate(ctx_and_new):
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(new, num_heads, head_dim, generator=gen).to(dtype)
        chunks.append(ScheduledChunk(str(i), [0] * new, ctx - new, blocks, True))
        seqs.append((q, k, v, ctx, blocks))
    # the cached prefix is written directly; the new tokens go through write_kv via the slot mapping
    for q, k, v, ctx, blocks in seqs:
        cached = ctx - q.shape[0]
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(cached)])
        if cached:
            write_kv(LayerKV(k_cache, v_cache), k[:cached], v[:cached], slots)
    order = sorted(range(len(chunks)), key=lambda j: chunks[j].num_tokens != 1)
    chunks = [chunks[j] for j in order]
    seqs = [seqs[j] for j in order]
    _, _, meta = build_metadata(chunks, block_size, torch.device("cpu"))
    new_k = torch.cat([k[ctx - q.shape[0]:] for q, k, v, ctx, _ in seqs])
    new_v = torch.cat([v[ctx - q.shape[0]:] for q, k, v, ctx, _ in seqs])
    query = torch.cat([q for q, *_ in seqs])
    return k_cache, v_cache, query, new_k, new_v, meta, seqs


def run_and_compare(ctx_and_new, block_size=16, num_heads=6, num_kv_heads=2, dtype=torch.float32,
                    backend=None):
    k_cache, v_cache, query, new_k, new_v, meta, seqs = build_case(
        ctx_and_new, block_size, num_heads, num_kv_heads, dtype)
    backend = backend or ReferenceBackend(scale=HEAD_DIM ** -0.5)
    kv = LayerKV(k_cache, v_cache)
    backend.write_kv(kv, new_k, new_v, meta)
    out = backend.forward(query, kv, meta)
    assert out.dtype == dtype and out.shape == query.shape
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2))
    row = 0
    for q, k, v, ctx, _ in seqs:
        expected = dense_attention(q, k, v, ctx)
        torch.testing.assert_close(out[row:row + q.shape[0]].float(), expected, **tol)
        row += q.shape[0]


def assert_matches_reference(backend, case, heads, kv_heads, dtype, seed):
    """``backend`` writes the same cache bytes as the reference and gives the same attention output."""
    k1, v1, query, new_k, new_v, meta, _ = build_case(case, 16, heads, kv_heads, dtype, seed=seed)
    k2, v2 = k1.clone(), v1.clone()
    ref = ReferenceBackend(HEAD_DIM ** -0.5)
    ref.write_kv(LayerKV(k1, v1), new_k, new_v, meta)
    backend.write_kv(LayerKV(k2, v2), new_k, new_v, meta)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(backend.forward(query, LayerKV(k2, v2), meta).float(),
                               ref.forward(query, LayerKV(k1, v1), meta).float(), **tol)


B = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [1, B - 1, B, B + 1, 5 * B + 3, 4096])
def test_decode_single_sequence(ctx, dtype):
    run_and_compare([(ctx, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_decode_batch(dtype):
    run_and_compare([(1, 1), (B - 1, 1), (B, 1), (B + 1, 1), (200, 1), (37, 1)], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx,new", [(1, 1), (B, B), (B + 1, B + 1), (40, 7), (100, 33), (64, 16), (17, 2)])
def test_prefill_with_and_without_cached_prefix(ctx, new, dtype):
    run_and_compare([(ctx, new)], dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_mixed_decode_and_prefill_batch_with_gqa(num_heads, num_kv_heads):
    run_and_compare([(30, 1), (50, 12), (B, 1), (3, 3), (90, 45)], num_heads=num_heads,
                    num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_other_block_sizes(block_size):
    run_and_compare([(1, 1), (block_size + 1, 1), (3 * block_size, 5)], block_size=block_size)


def test_padding_slots_are_never_written():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    write_kv(LayerKV(k_cache, v_cache), key, key * 2, torch.tensor([5, -1, 0]), has_padding_slots=True)
    flat = k_cache.view(8, 1, 2)
    assert flat[5].eq(1).all() and flat[0].eq(1).all()
    assert flat[[1, 2, 3, 4, 6, 7]].eq(0).all()
    assert v_cache.view(8, 1, 2)[5].eq(2).all()


def test_merge_across_blocks_is_not_a_plain_sum_of_block_softmaxes():
    """Summing each block's softmax-weighted values (no log-sum-exp rescaling) is wrong."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 2, HEAD_DIM, generator=gen)
    k = torch.randn(1, 3, B, 2, HEAD_DIM, generator=gen)
    v = torch.randn(1, 3, B, 2, HEAD_DIM, generator=gen)
    ctx = 3 * B
    merged = blockwise_attention(q, k, v, torch.tensor([[ctx - 1]]), torch.tensor([ctx]), HEAD_DIM ** -0.5)
    dense = dense_attention(q[0], k.view(ctx, 2, HEAD_DIM), v.view(ctx, 2, HEAD_DIM), ctx)
    torch.testing.assert_close(merged[0], dense, atol=1e-5, rtol=1e-4)
    scores = torch.einsum("hd,nbhd->hnb", q[0, 0], k[0]) * HEAD_DIM ** -0.5
    naive = torch.einsum("hnb,nbhd->hd", scores.softmax(-1), v[0])
    assert (naive - dense[0]).abs().max() > 0.1
