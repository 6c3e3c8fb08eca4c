"""Static KV scales (``kv_cache_scales``): fixed scales for a quantized KV format instead of the
ones computed on every write.

By default every quantized row gets its own scale when it is written (``kvstore/quant.py``). A
user with calibrated scales (an fp8 checkpoint's ``k_scale`` / ``v_scale``, as vLLM and
llm-compressor write them) can fix them instead: every row of a layer's K (or V) is then encoded
with that layer's scale, values beyond ``scale * qmax`` saturated, and the scale is written into
each row's scale slot, so the attention kernels read the rows exactly as they read computed ones
(no kernel knows the difference) and a stored value still never depends on a block's write history.

A scale means what vLLM's ``k_scale`` means: the value one code step stands for, ``x ~= code *
scale`` (fp8: ``x / scale`` is cast to fp8; int8: codes -127..127; int4: its levels in -7..7
(``quant.INT4_LEVELS``) of the *rotated* row). It is stored as bfloat16, like every per-row
scale, and the rows are encoded with the rounded value.

The option takes one positive number (every layer, K and V), or the path of a JSON file::

    {"k_scale": 0.02, "v_scale": [0.01, 0.012, ...]}

each entry one number, a list of one per layer, or a list per layer of one per KV head.

This module owns parsing and validation (``StaticKVScales.parse`` raises ``ValueError`` naming
what is wrong); ``LayerKV.static_scales`` carries one layer's ``[2, kv_heads]`` float32 tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.kvstore.quant import SCALE_DTYPE


@dataclass(frozen=True)
class StaticKVScales:
    """Per layer, K's and V's scale per KV head: ``k[layer][head]``, ``v[layer][head]``."""

    k: tuple[tuple[float, ...], ...]
    v: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name, table in (("k_scale", self.k), ("v_scale", self.v)):
            for layer, heads in enumerate(table):
                for head, s in enumerate(heads):
                    if not (isinstance(s, float) and math.isfinite(s) and s > 0):
                        raise ValueError(f"kv_cache_scales: {name} of layer {layer}, KV head {head} must be a "
                                         f"positive finite number, got {s!r}")
                    if float(torch.tensor(s).to(SCALE_DTYPE)) == 0:
                        raise ValueError(f"kv_cache_scales: {name} of layer {layer}, KV head {head} ({s!r}) is "
                                         f"below bfloat16's range")

    @classmethod
    def parse(cls, value: float | str, num_layers: int, num_kv_heads: int) -> StaticKVScales:
        """The option's value (a number, a number as text, or a JSON file's path) for a model of
        ``num_layers`` layers and ``num_kv_heads`` KV heads."""
        if isinstance(value, bool):
            raise ValueError(f"kv_cache_scales must be a positive number or a JSON file's path, got {value!r}")
        if isinstance(value, int | float):
            entries = {"k_scale": value, "v_scale": value}
        else:
            text = value.strip()
            try:
                number = float(text)
            except ValueError:
                entries = _read_file(text)
            else:
                entries = {"k_scale": number, "v_scale": number}
        return cls(_table(entries, "k_scale", num_layers, num_kv_heads),
                   _table(entries, "v_scale", num_layers, num_kv_heads))

    def heads(self, first: int, count: int) -> StaticKVScales:
        """KV heads ``first .. first + count - 1`` of every layer (a tensor-parallel rank's share)."""
        share = slice(first, first + count)
        return StaticKVScales(tuple(h[share] for h in self.k), tuple(h[share] for h in self.v))

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s scales as float32 ``[2, kv_heads]`` (row 0 K, row 1 V), bfloat16-rounded."""
        return torch.tensor([self.k[index], self.v[index]], dtype=torch.float32).to(SCALE_DTYPE).float()


def _read_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"kv_cache_scales: {path!r} is neither a number nor a JSON file")
    try:
        entries = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"kv_cache_scales: {path} is not valid JSON ({e})") from None
    if not isinstance(entries, dict) or not {"k_scale", "v_scale"} <= entries.keys():
        raise ValueError(f"kv_cache_scales: {path} must hold an object with k_scale and v_scale")
    unknown = sorted(set(entries) - {"k_scale", "v_scale"})
    if unknown:
        raise ValueError(f"kv_cache_scales: {path} has unknown keys {unknown} (only k_scale and v_scale)")
    return entries


def _number(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ValueError(f"kv_cache_scales: {where} must be a number, got {x!r}")
    return float(x)


def _table(entries: dict, name: str, num_layers: int, num_kv_heads: int) -> tuple[tuple[float, ...], ...]:
    entry = entries[name]
    if not isinstance(entry, list):
        s = _number(entry, name)
        return tuple((s,) * num_kv_heads for _ in range(num_layers))
    if len(entry) != num_layers:
        raise ValueError(f"kv_cache_scales: {name} lists {len(entry)} layers, the model has {num_layers}")
    rows = []
    for layer, item in enumerate(entry):
        if not isinstance(item, list):
            rows.append((_number(item, f"{name}[{layer}]"),) * num_kv_heads)
            continue
        if len(item) != num_kv_heads:
            raise ValueError(f"kv_cache_scales: {name}[{layer}] lists {len(item)} KV heads, the model has "
                             f"{num_kv_heads}")
        rows.append(tuple(_number(x, f"{name}[{layer}][{h}]") for h, x in enumerate(item)))
    return tuple(rows)
