"""GGUF K-quant encoders (Q4_K, Q5_K, Q6_K) and a GGUF re-quantizer: to measure these formats'
error on a model's weights and to test that the loader reads them (it decodes them with the
``gguf`` package's exact dequantization, ``models/loader.py``).

The encoders round to nearest (RTN): llama.cpp's own quantizer searches each sub-block's scale and
minimum (and uses an importance matrix when given), so a file it makes has a lower error than these
measure: they are an upper bound on the format's error, the same bytes layout.

Layouts (256 weights a super-block; ggml's, as ``gguf.quants`` decodes them; little-endian):
  Q4_K (144 B): fp16 d, fp16 dmin, 12 B of 6-bit scales and minimums for 8 sub-blocks of 32,
                128 B of nibbles. ``w = d * sc[j] * q - dmin * m[j]``, q 0..15.
  Q5_K (176 B): as Q4_K plus 32 B of fifth bits (bit j of byte l: weight 32j + l), q 0..31.
  Q6_K (210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (sub-blocks of 16),
                fp16 d. ``w = d * sc[j] * (q - 32)``, q 0..63.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SUPER = 256
ENCODED_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 scales and 8 minimums (0..63) per super-block -> ggml's 12 bytes (``Q4_K.get_scale_min``)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _scale_min_codes(w: np.ndarray, levels: int):
    """Per super-block [n, 8, 32] asymmetric codes 0..levels: (d, dmin, sc, mn, q) with the 6-bit
    sub-block scales and minimums rounded first and the codes computed against the rounded ones."""
    low = np.minimum(w.min(axis=-1), 0.0)              # a sub-block's minimum, stored as -dmin * m (m >= 0)
    scale = (w.max(axis=-1) - low) / levels
    d = _fp16(scale.max(axis=-1) / 63)
    dmin = _fp16(-low.min(axis=-1) / 63)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[:, None] > 0, np.rint(scale / df[:, None]), 0).clip(0, 63)
        mn = np.where(dminf[:, None] > 0, np.rint(-low / dminf[:, None]), 0).clip(0, 63)
        step = (df[:, None] * sc)[..., None]
        offset = (dminf[:, None] * mn)[..., None]
        q = np.where(step > 0, np.rint((w + offset) / step), 0).clip(0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> Q4_K bytes [rows, cols / 256 * 144]."""
    rows = x.shape[0]
    w = x.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _scale_min_codes(w, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_6bit(sc, mn), qs],
                         axis=1)
    return out.reshape(rows, -1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q5_K bytes [rows, cols / 256 * 176]."""
    rows = x.shape[0]
    w = x.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _scale_min_codes(w, 31)
    low = q & 0x0F
    pairs = low.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4) & 1  # [n, 8, 32]: bit j of byte l
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j] << j).astype(np.uint8)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_6bit(sc, mn), qh,
                          qs], axis=1)
    return out.reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q6_K bytes [rows, cols / 256 * 210]; symmetric codes -32..31."""
    rows = x.shape[0]
    w = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(w).max(axis=-1) / 31
    d = _fp16(scale.max(axis=-1) / 127)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[:, None] > 0, np.rint(scale / df[:, None]), 0).clip(-128, 127)
        step = (df[:, None] * sc)[..., None]
        q = (np.where(step > 0, np.rint(w / step), 0).clip(-32, 31) + 32).astype(np.uint8).reshape(-1, SUPER)
    # weight i = h*128 + s*64 + b: nibble s of ql[64h + b]; its bits 4-5 at bits 2k of qh[32h + l], i = h*128 + 32k + l
    halves = q.reshape(-1, 2, 128)
    low = (halves & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    top = (halves >> 4).reshape(-1, 2, 4, 32)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(rows, -1)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(kind: str, x: np.ndarray) -> np.ndarray:
    if kind not in ENCODERS:
        raise ValueError(f"no encoder for {kind} (encoders: {', '.join(ENCODERS)})")
    if x.ndim != 2 or x.shape[1] % SUPER:
        raise ValueError(f"{kind} needs rows of a multiple of {SUPER} values, got shape {tuple(x.shape)}")
    return ENCODERS[kind](np.ascontiguousarray(x, dtype=np.float32))


def requantize_gguf(source: Path, target: Path, kind_of) -> list[str]:
    """Write ``source`` (a GGUF) to ``target`` with every 2-D tensor for whose name ``kind_of(name)``
    gives a kind (``ENCODED_KINDS``) and whose rows are a multiple of 256 values re-encoded as that
    kind from its dequantized values; metadata and every other tensor are copied as they are.
    Returns the re-encoded tensors' names."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type)
    encoded = []
    for t in reader.tensors:
        kind = kind_of(t.name)
        if kind is not None and len(t.shape) == 2 and int(t.shape[0]) % SUPER == 0:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, encode(kind, values), raw_dtype=gguf.GGMLQuantizationType[kind])
            encoded.append(t.name)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded
