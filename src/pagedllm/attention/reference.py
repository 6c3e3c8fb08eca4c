"""Reference paged attention in pure torch: the oracle every backend is checked against.

Keys and values are read through the block table, one block at a time conceptually: each block
``b`` gives a partial result (max score ``m_b``, normaliser ``l_b``, normalised output ``o_b``),
and the partials are merged with log-sum-exp rescaling:
``out = sum_b o_b * l_b * exp(m_b - m) / sum_b l_b * exp(m_b - m)`` with ``m = max_b m_b``.
(Vectorised over blocks; maths in float32 whatever the cache dtype.)
A query at position ``p`` sees keys at positions ``<= p`` (causal inside the new chunk, all of
the cached prefix); slots with id < 0 are never written.

A quantized KV format (``LayerKV.codec``) is encoded on write and decoded when the blocks are
gathered; for a rotated one (int4) the query is rotated as K was and the output rotated back.
The new chunk's tokens are read back from the cache like the prefix, so an output never depends
on how a prompt was chunked or whether its prefix came from the cache.
"""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvstore.spec import LayerKV, as_movable


def write_kv(kv: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             has_padding_slots: bool = False) -> None:
    """Store new K/V rows ``[T, kv_heads, head_dim]`` into their slots (padding skipped)."""
    if has_padding_slots:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    nb, bs, h, d = kv.k.shape
    codec = kv.codec
    if codec is None:
        kv.k.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(kv.dtype))
        kv.v.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(kv.dtype))
        return
    fixed = (None, None) if kv.static_scales is None else kv.static_scales.to(key.device)
    for cache, scales, rows, static in ((kv.k, kv.k_scale, key, fixed[0]), (kv.v, kv.v_scale, value, fixed[1])):
        codes, scale = codec.encode(codec.rotate(rows), static)
        as_movable(cache).view(nb * bs, h, d).index_copy_(0, slot_mapping, as_movable(codes))
        scales.view(nb * bs, h).index_copy_(0, slot_mapping, scale)


def gather_blocks(kv: LayerKV, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``tables`` names (any shape of block ids), decoded to float32 for a
    quantized format, else in the cache's dtype."""
    if kv.codec is None:
        return kv.k[tables], kv.v[tables]
    return kv.codec.decode(kv.k[tables], kv.k_scale[tables]), kv.codec.decode(kv.v[tables], kv.v_scale[tables])


def blockwise_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                        q_pos: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of queries over paged blocks, merged across blocks with log-sum-exp.

    q:        [S, Q, H, D]       queries (Q per sequence)
    k_blocks: [S, N, B, KH, D]   the N blocks of each sequence, gathered through its block table
    q_pos:    [S, Q]             absolute position of each query (-1 = padding query)
    seq_lens: [S]                number of valid key positions per sequence
    returns   [S, Q, H, D]       in q's dtype
    """
    s, nq, h, d = q.shape
    _, n, b, kh, _ = k_blocks.shape
    g = h // kh
    qf = q.float().view(s, nq, kh, g, d)
    kf = k_blocks.float()
    vf = v_blocks.float()
    scores = torch.einsum("sqkgd,snbkd->skgqnb", qf, kf) * scale  # [S, KH, G, Q, N, B]
    key_pos = torch.arange(n * b, device=q.device).view(1, 1, n, b)
    visible = (key_pos <= q_pos.view(s, nq, 1, 1)) & (key_pos < seq_lens.view(s, 1, 1, 1))
    scores = scores.masked_fill(~visible.view(s, 1, 1, nq, n, b), float("-inf"))

    m_b = scores.amax(dim=-1)                                     # [S, KH, G, Q, N]
    m_b_safe = torch.where(torch.isinf(m_b), torch.zeros_like(m_b), m_b)
    p = torch.exp(scores - m_b_safe.unsqueeze(-1))                # masked -> 0
    l_b = p.sum(dim=-1)                                           # [S, KH, G, Q, N]
    o_b = torch.einsum("skgqnb,snbkd->skgqnd", p, vf) / l_b.clamp_min(1e-30).unsqueeze(-1)

    m = m_b_safe.amax(dim=-1, keepdim=True)                       # [S, KH, G, Q, 1]
    w = l_b * torch.exp(m_b_safe - m)                             # rescaled block weights
    out = (o_b * w.unsqueeze(-1)).sum(dim=-2) / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return out.permute(0, 3, 1, 2, 4).reshape(s, nq, h, d).to(q.dtype)


class ReferenceBackend(AttentionBackend):
    """Pure-torch paged attention (gathers each sequence's blocks, then ``blockwise_attention``)."""

    name = "reference"
    scale_layouts = ("none", "per_token_head")

    def check_kv_spec(self, spec, model_dtype: torch.dtype) -> None:
        """Reads every KV format of ``kvstore/quant.py`` and any float dtype, whatever the model's."""
        if spec.quant != "none" or (spec.scale_layout == "none" and spec.dtype.is_floating_point):
            return
        super().check_kv_spec(spec, model_dtype)

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def write_kv(self, kv: LayerKV, key, value, meta: AttentionMetadata) -> None:
        write_kv(kv, key, value, meta.slot_mapping, meta.has_padding_slots)

    def forward(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D] -> output [T, H, D] for the flat batch described by ``meta``."""
        if kv.codec is not None and kv.codec.rotated:
            return kv.codec.unrotate(self._attend(kv.codec.rotate(query), kv, meta)).to(query.dtype)
        return self._attend(query, kv, meta)

    def _attend(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(query)
        bs = kv.block_size
        nd = meta.num_decodes
        if nd:
            max_blocks = -(-max(meta.seq_lens_list[:nd]) // bs)
            tables = meta.block_tables[:nd, :max_blocks]
            seq_lens = meta.seq_lens[:nd]
            out[:nd] = blockwise_attention(
                query[:nd].unsqueeze(1), *gather_blocks(kv, tables),
                (seq_lens - 1).unsqueeze(1), seq_lens, self.scale).squeeze(1)
        qsl, lens = meta.query_start_loc_list, meta.seq_lens_list
        for i in range(nd, meta.num_seqs):
            start, end, ctx = qsl[i], qsl[i + 1], lens[i]
            nblocks = -(-ctx // bs)
            table = meta.block_tables[i, :nblocks]
            q_pos = torch.arange(ctx - (end - start), ctx, device=query.device).unsqueeze(0)
            k_blocks, v_blocks = gather_blocks(kv, table.unsqueeze(0))
            out[start:end] = blockwise_attention(
                query[start:end].unsqueeze(0), k_blocks, v_blocks,
                q_pos, meta.seq_lens[i:i + 1], self.scale).squeeze(0)
        return out
