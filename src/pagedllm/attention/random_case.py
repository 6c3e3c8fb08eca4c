"""Random paged-attention inputs with SmolLM2's head layout, for benchmarks and the simulator's kernel timing.

A case is random K/V for a batch of sequences scattered over blocks of a pool, their queries and
the attention metadata, plus the same K/V laid out densely per sequence for SDPA to compare with.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvstore.spec import LayerKV

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def random_paged_case(batch: int, ctx: int, block: int, dtype: torch.dtype, gen: torch.Generator, device: str,
                      prefill: bool = False, order: str = "shuffled"):
    """``(q, kv, meta, q_dense, k_dense, v_dense)``: random K/V (a ``LayerKV``) for ``batch``
    sequences of ``ctx`` tokens in blocks, their queries (the last position of each, or with
    ``prefill`` every position), and the same K/V (and queries) laid out contiguously per sequence
    for SDPA: [batch, heads, tokens, dim]. ``order``: ``shuffled`` blocks (a pool after churn), or
    ``adjacent`` (each sequence's blocks one physical run, in order: what merging adjacent blocks
    gives the kernel)."""
    nblocks = -(-ctx // block)
    total = batch * nblocks
    k_cache = torch.randn(total, block, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    v_cache = torch.randn(total, block, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    if order not in ("shuffled", "adjacent"):
        raise ValueError(f"block order must be shuffled or adjacent, got {order!r}")
    ids = torch.randperm(total, generator=gen) if order == "shuffled" else torch.arange(total)
    tables = ids.view(batch, nblocks).to(device)
    per_seq = ctx if prefill else 1
    q = torch.randn(batch * per_seq, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    qsl = [i * per_seq for i in range(batch + 1)]
    seq_lens = [ctx] * batch
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * per_seq, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, device=device), seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=tables, num_decodes=0 if prefill else batch, query_start_loc_list=qsl, seq_lens_list=seq_lens)
    k_dense = k_cache[tables].reshape(batch, nblocks * block, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = v_cache[tables].reshape(batch, nblocks * block, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    q_dense = q.view(batch, per_seq, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return q, LayerKV(k_cache, v_cache), meta, q_dense, k_dense, v_dense
