"""Triton paged attention and KV store (``attention_backend="triton"``, the default on CUDA).

``paged_attention_kernel``: one program per (query token, query head). It walks the token's
sequence block by block through the block table, up to the token's own position (causal within
the new chunk, all of the cached prefix), with an online softmax: per block the running max and
normaliser are rescaled by ``exp(m_old - m_new)`` (the log-sum-exp merge). So one kernel serves
decode (one token per sequence) and prefill over a cached prefix (many). ``store_kv_kernel``
writes new K/V rows into their slots, skipping padding (slot < 0).

A quantized KV format (``kvstore/quant.py``) is read by ``paged_attention_quant_kernel``: the same
walk, each block's codes decoded in registers and times their scales (no float copy of the cache);
int4's rotation is applied to the query and undone on the output with R loaded as a [D, D] tile.
Its rows are quantized as they are written by ``store_kv_quant_kernel``: one program per (token,
KV head) loads the row, rotates it (int4: the Hadamard butterflies in ``fwht``'s order), takes
``absmax / qmax`` rounded to bfloat16 (or the static scale), and stores the codes and the scale:
the torch codec's bytes exactly (IEEE division, round-half-even by the 1.5 * 2^23 trick, the
bfloat16 rounding done on the bits), so no float copy of the new rows is made either.

On a machine without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set before this module
is imported) on CPU tensors; loads are upcast to float32 right away, since the interpreter
mishandles bfloat16 arithmetic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvstore.quant import QUANTIZED_FORMATS, KVCodec, rotation
from pagedllm.kvstore.spec import LayerKV


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr,
                    ROW_P2: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, ROW_P2)
        mask = offs < ROW
        k = tl.load(key_ptr + t * ROW + offs, mask=mask)
        v = tl.load(value_ptr + t * ROW + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _fwht(x, D: tl.constexpr, LOG2D: tl.constexpr):
    """``x @ H`` unnormalised: the butterflies ``(a, b) -> (a + b, a - b)`` at strides 1, 2, 4, ...
    (``kvstore/quant.py``'s ``fwht``, in its order, so the same float32 sums)."""
    for i in tl.static_range(LOG2D):
        h: tl.constexpr = 1 << i
        pairs = tl.permute(tl.reshape(x, (D // (2 * h), 2, h)), (0, 2, 1))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))
    return x


@triton.jit
def _bfloat16_bits(x):
    """float32 -> the nearest bfloat16 (ties to even): (its value as float32, its 16 bits as int16)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.to(tl.float32, bitcast=True), (rounded >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _fp8_bits(y, E4M3: tl.constexpr):
    """|y| <= the format's largest value -> its fp8 byte, rounded to nearest even (e4m3: 3 mantissa
    bits, exponents from -6; e5m2: 2 bits, from -14; subnormals below). Rounded in float32 to a
    multiple of the value's step (a power of two, so exact), then read off float16's bits, which
    hold every fp8 value exactly (``_codes_to_float`` in reverse). The interpreter's own fp8 casts
    drop a rounding's carry into the exponent (120.0 -> e5m2 64.0), hence not ``y.to(fp8)``."""
    mant: tl.constexpr = 3 if E4M3 else 2
    emin: tl.constexpr = -6 if E4M3 else -14
    bits = y.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)  # kept apart: a value that rounds to zero stays -0
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    step_exp = tl.maximum(exponent, emin) - mant
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    value = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
    if E4M3:
        half = (value * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True)
        return ((half >> 7) & 0x7F).to(tl.uint8) | sign
    else:
        return (value.to(tl.float16).to(tl.uint16, bitcast=True) >> 8).to(tl.uint8) | sign


@triton.jit
def _quantize_row(src_ptr, codes_ptr, scales_ptr, static_ptr, row, D: tl.constexpr, D_P2: tl.constexpr,
                  LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr, QMAX: tl.constexpr, FORMAT: tl.constexpr,
                  ROTATE: tl.constexpr, HAS_STATIC: tl.constexpr):
    """One row (``D`` values at ``src_ptr``) encoded as ``KVCodec.encode`` does, stored as code row
    ``row`` (and its scale's bits); FORMAT as ``_codes_to_float``'s."""
    d = tl.arange(0, D_P2)
    x = tl.load(src_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if ROTATE:
        x = _fwht(x, D_P2, LOG2D) * INV_SQRT_D
    if HAS_STATIC:
        scale, bits = _bfloat16_bits(tl.load(static_ptr))
    else:
        scale, bits = _bfloat16_bits(tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX))
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
    if FORMAT == 1 or FORMAT == 2:
        codes = _fp8_bits(y, FORMAT == 1)
    elif FORMAT == 3:  # the index of the nearest level, minus 8 (KVCodec: INT4_THRESHOLDS' literals)
        a = tl.abs(y)
        magnitude = ((a > 0.3646).to(tl.float32) + (a > 1.10405).to(tl.float32) + (a > 1.87505).to(tl.float32)
                     + (a > 2.7043).to(tl.float32) + (a > 3.6324).to(tl.float32) + (a > 4.73295).to(tl.float32)
                     + (a > 6.16925).to(tl.float32))
        codes = tl.where(y < 0, -magnitude, magnitude)
    else:  # round half to even: exact for |y| < 2^22, and the clamp above bounds y by QMAX
        codes = (y + 12582912.0) - 12582912.0
    if FORMAT == 0:
        tl.store(codes_ptr + row * D + d, codes.to(tl.int8), mask=d < D)
    elif FORMAT == 3:
        lo, hi = tl.split(tl.reshape((codes + 8.0).to(tl.uint8), (D_P2 // 2, 2)))
        byte = tl.arange(0, D_P2 // 2)
        tl.store(codes_ptr + row * (D // 2) + byte, lo | (hi << 4), mask=byte < D // 2)
    else:
        tl.store(codes_ptr + row * D + d, codes, mask=d < D)
    tl.store(scales_ptr + row, bits)


@triton.jit
def store_kv_quant_kernel(key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, static_ptr, slot_ptr, KH: tl.constexpr,
                          D: tl.constexpr, D_P2: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr,
                          QMAX: tl.constexpr, FORMAT: tl.constexpr, ROTATE: tl.constexpr, HAS_STATIC: tl.constexpr):
    """One program per (new token, KV head): its K and V rows quantized into slot ``slot_mapping[t]``
    (skipped where it is padding, < 0); ``static_ptr`` holds [2, KH] float32 static scales."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        row = slot * KH + kh
        src = (t * KH + kh) * D
        _quantize_row(key_ptr + src, k_ptr, ks_ptr, static_ptr + kh, row, D, D_P2, LOG2D, INV_SQRT_D, QMAX, FORMAT,
                      ROTATE, HAS_STATIC)
        _quantize_row(value_ptr + src, v_ptr, vs_ptr, static_ptr + KH + kh, row, D, D_P2, LOG2D, INV_SQRT_D, QMAX,
                      FORMAT, ROTATE, HAS_STATIC)


@triton.jit
def _merge_block(s, v, m, l_sum, acc):
    """One block's scores ``s`` (masked keys -inf) and values ``v`` merged into the running max,
    normaliser and unnormalised output: the log-sum-exp rescaling by ``exp(m_old - m_new)``."""
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    return m_new, l_sum * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, token_seq_ptr, token_pos_ptr, tables_ptr,
                           scale, max_blocks, H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr,
                           D_P2: tl.constexpr, B: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (H // KH)
    seq = tl.load(token_seq_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    d = tl.arange(0, D_P2)
    dmask = d < D
    j = tl.arange(0, B)
    q = tl.load(q_ptr + (t * H + h) * D + d, mask=dmask, other=0.0).to(tl.float32) * scale
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D_P2,), tl.float32)
    num_blocks = pos // B + 1
    for b in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * max_blocks + b)
        key_pos = b * B + j
        kmask = key_pos <= pos
        rows = (block * B + j) * (KH * D) + kh * D
        offs = rows[:, None] + d[None, :]
        lmask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        m, l_sum, acc = _merge_block(tl.where(kmask, s, float("-inf")), v, m, l_sum, acc)
    out = acc / l_sum
    tl.store(out_ptr + (t * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _codes_to_float(codes, shift, FORMAT: tl.constexpr):
    """Stored codes -> their values before the row's scale (KVCodec.decode's): int8 as is; fp8 through
    float16, whose bits hold e5m2's exactly and e4m3's shifted by 2^8; int4 the level of the nibble
    at ``shift`` (the bytes come as uint8; KVCodec's INT4_LEVELS: nibble 8 +- k is +-INT4_POINTS[k-1],
    and 0, 7 and 8 away from 8 are those numbers themselves)."""
    if FORMAT == 0:
        return codes.to(tl.float32)
    elif FORMAT == 1:
        b = codes.to(tl.uint16)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    elif FORMAT == 2:
        return (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        k = ((codes >> shift) & 0xF).to(tl.int32) - 8
        m = tl.abs(k)
        level = tl.where(m == 1, 0.7292, tl.where(m == 2, 1.4789, tl.where(m == 3, 2.2712, tl.where(
            m == 4, 3.1374, tl.where(m == 5, 4.1274, tl.where(m == 6, 5.3385, m.to(tl.float32)))))))
        return tl.where(k < 0, -level, level)


@triton.jit
def paged_attention_quant_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, rot_ptr, out_ptr, token_seq_ptr, token_pos_ptr,
                                 tables_ptr, scale, max_blocks, H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr,
                                 D_P2: tl.constexpr, B: tl.constexpr, CD: tl.constexpr, FORMAT: tl.constexpr,
                                 ROTATED: tl.constexpr):
    """``paged_attention_kernel`` over quantized K/V (kvstore/quant.py): each block's code rows of the
    token's kv head are loaded and decoded in registers, times their bf16 scales; a rotated format
    (int4) takes the query rotated by ``rot`` (R, [D, D]) and rotates the output back (R^T)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (H // KH)
    seq = tl.load(token_seq_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    d = tl.arange(0, D_P2)
    dmask = d < D
    j = tl.arange(0, B)
    q = tl.load(q_ptr + (t * H + h) * D + d, mask=dmask, other=0.0).to(tl.float32) * scale
    square = dmask[:, None] & dmask[None, :]
    if ROTATED:
        rot = tl.load(rot_ptr + d[:, None] * D + d[None, :], mask=square, other=0.0)
        q = tl.sum(q[:, None] * rot, axis=0)  # q @ R
    if FORMAT == 3:
        byte = d // 2
        shift = (d % 2) * 4
    else:
        byte = d
        shift = d * 0
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D_P2,), tl.float32)
    num_blocks = pos // B + 1
    for b in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * max_blocks + b)
        key_pos = b * B + j
        kmask = key_pos <= pos
        rows = (block * B + j) * KH + kh  # the rows' index among the pool's code rows and scales
        offs = rows[:, None] * CD + byte[None, :]
        lmask = kmask[:, None] & dmask[None, :]
        k_scale = tl.load(ks_ptr + rows, mask=kmask, other=0.0).to(tl.float32)
        v_scale = tl.load(vs_ptr + rows, mask=kmask, other=0.0).to(tl.float32)
        k = _codes_to_float(tl.load(k_ptr + offs, mask=lmask, other=0), shift[None, :], FORMAT) * k_scale[:, None]
        v = _codes_to_float(tl.load(v_ptr + offs, mask=lmask, other=0), shift[None, :], FORMAT) * v_scale[:, None]
        s = tl.sum(k * q[None, :], axis=1)
        m, l_sum, acc = _merge_block(tl.where(kmask, s, float("-inf")), v, m, l_sum, acc)
    out = acc / l_sum
    if ROTATED:
        rot_t = tl.load(rot_ptr + d[None, :] * D + d[:, None], mask=square, other=0.0)
        out = tl.sum(out[:, None] * rot_t, axis=0)  # out @ R^T
    tl.store(out_ptr + (t * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


class TritonBackend(AttentionBackend):
    """Paged attention through Triton kernels; same interface as the reference."""

    name = "triton"
    quant_formats = QUANTIZED_FORMATS

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def write_kv(self, kv: LayerKV, key, value, meta: AttentionMetadata) -> None:
        if kv.codec is not None:
            store_quantized(kv, key, value, meta.slot_mapping)
            return
        k_cache, v_cache = kv.k, kv.v
        row = k_cache.shape[2] * k_cache.shape[3]
        key = key.to(k_cache.dtype).contiguous()
        value = value.to(v_cache.dtype).contiguous()
        store_kv_kernel[(key.shape[0],)](key, value, k_cache, v_cache, meta.slot_mapping, ROW=row,
                                         ROW_P2=triton.next_power_of_2(row))

    def forward(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        if kv.codec is not None:
            return self._forward_quantized(query, kv, meta)
        k_cache, v_cache = kv.k, kv.v
        num_tokens, heads, dim = query.shape
        token_seq, token_pos = _token_layout(meta, query.device)
        out = torch.empty_like(query)
        paged_attention_kernel[(num_tokens, heads)](
            query.contiguous(), k_cache, v_cache, out, token_seq, token_pos, meta.block_tables, self.scale,
            meta.block_tables.shape[1], H=heads, KH=k_cache.shape[2], D=dim, D_P2=triton.next_power_of_2(dim),
            B=k_cache.shape[1])
        return out


    def _forward_quantized(self, query: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        codec = kv.codec
        num_tokens, heads, dim = query.shape
        token_seq, token_pos = _token_layout(meta, query.device)
        out = torch.empty_like(query)
        k, v = kv.k, kv.v
        if k.dtype.is_floating_point:  # fp8: read as bytes, decoded in the kernel
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        rot = rotation(dim).to(query.device) if codec.rotated else torch.zeros(1, device=query.device)
        paged_attention_quant_kernel[(num_tokens, heads)](
            query.contiguous(), k, v, kv.k_scale, kv.v_scale, rot, out, token_seq, token_pos, meta.block_tables,
            self.scale, meta.block_tables.shape[1], H=heads, KH=k.shape[2], D=dim, D_P2=triton.next_power_of_2(dim),
            B=k.shape[1], CD=k.shape[3], FORMAT=_FORMAT_IDS[codec.name], ROTATED=codec.rotated)
        return out


_FORMAT_IDS = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int4": 3}  # _codes_to_float's FORMAT


def store_quantized(kv: LayerKV, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """New rows ``[T, kv_heads, head_dim]`` quantized into their slots by ``store_kv_quant_kernel``
    (padding slots, < 0, skipped). A rotated format whose head size is not a power of two is
    rotated by its matrix here first (the kernel's butterflies need a power of two)."""
    codec: KVCodec = kv.codec
    num_tokens, heads, dim = key.shape
    if num_tokens == 0:
        return
    rotate_in_kernel = codec.rotated and dim & (dim - 1) == 0
    if codec.rotated and not rotate_in_kernel:
        key, value = codec.rotate(key), codec.rotate(value)
    k, v = kv.k, kv.v
    if k.dtype.is_floating_point:  # fp8: stored as bytes
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    static = kv.static_scales
    has_static = static is not None
    static = static.to(key.device) if has_static else torch.zeros(1, device=key.device)
    d_p2 = triton.next_power_of_2(dim)
    store_kv_quant_kernel[(num_tokens, heads)](
        key.contiguous(), value.contiguous(), k, v, kv.k_scale.view(torch.int16), kv.v_scale.view(torch.int16),
        static, slot_mapping, KH=heads, D=dim, D_P2=d_p2, LOG2D=d_p2.bit_length() - 1, INV_SQRT_D=1.0 / math.sqrt(dim),
        QMAX=codec.qmax, FORMAT=_FORMAT_IDS[codec.name], ROTATE=rotate_in_kernel, HAS_STATIC=has_static)


def _token_layout(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query row: its sequence index and absolute position (host lists -> one copy)."""
    seqs, pos = [], []
    qsl = meta.query_start_loc_list
    for i, ctx in enumerate(meta.seq_lens_list):
        n = qsl[i + 1] - qsl[i]
        seqs.extend([i] * n)
        pos.extend(range(ctx - n, ctx))
    return (torch.tensor(seqs, dtype=torch.int64, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device))
