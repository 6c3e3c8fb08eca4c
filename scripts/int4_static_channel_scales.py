"""Static per-channel K scales for 4-bit KV, fitted on the evaluated text itself (an upper bound for
any calibration): docs/kv_quantization.md, "Why int4 is what it is". A first pass records each
layer's K statistics per KV head and channel; the second fake-quantizes K with them (V float32)
in ``bench accuracy``'s harness (float32 SmolLM2, 2,048 tokens of the pydoc topics, 512 context;
float32 KV gives 15.2347):

    .venv/bin/python scripts/int4_static_channel_scales.py chan_amax  # a static scale per channel (one mode a run)
    .venv/bin/python scripts/int4_static_channel_scales.py pair_rms   # keys / pair RMS, rotated, a row scale
    .venv/bin/python scripts/int4_static_channel_scales.py row        # the row scale alone, for comparison
"""
import argparse
import sys

import torch

from pagedllm.attention import reference
from pagedllm.bench import accuracy
from pagedllm.kvstore.quant import fwht

orig = reference.write_kv
MODE = sys.argv[1]
ARGS = argparse.Namespace(model=None, kv_cache_dtypes="float32", weights="float32", contexts="512",
                          text_tokens=2048, prompts=0, new_tokens=0, chunk=64, block_size=16, quiet=True,
                          configs=None)


def row_scale(x):
    s = (x.abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.round(x * inv).clamp(-7, 7) * s


def per_layer(fn):
    """``fn(layer index, kv, key, value, slots, padding)``: layers numbered in first-write order."""
    layer_of = {}

    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        return fn(layer_of.setdefault(id(kv), len(layer_of)), kv, key, value, slot_mapping, has_padding_slots)
    return write_kv


stats = []


def record(layer, kv, key, value, slots, padding):
    k = key.float()
    if layer == len(stats):
        stats.append({"amax": torch.zeros(k.shape[1:]), "sq": torch.zeros(k.shape[1:]), "n": 0})
    s = stats[layer]
    s["amax"] = torch.maximum(s["amax"], k.abs().amax(0))
    s["sq"] += k.pow(2).sum(0)
    s["n"] += k.shape[0]
    orig(kv, key, value, slots, padding)


def quantized(layer, kv, key, value, slots, padding):
    s, k = stats[layer], key.float()
    d = k.shape[-1]
    if MODE == "chan_amax":
        scale = s["amax"] / 7
        k = torch.round(k / scale).clamp(-7, 7) * scale
    elif MODE == "pair_rms":
        rms = (s["sq"] / s["n"]).sqrt()
        pair = rms.view(-1, 2, d // 2).pow(2).sum(1).sqrt().repeat(1, 2)
        k = fwht(row_scale(fwht(k / pair))) * pair
    else:
        k = fwht(row_scale(fwht(k)))
    orig(kv, k.to(key.dtype), value, slots, padding)


reference.write_kv = per_layer(record)
accuracy.run(ARGS)
reference.write_kv = per_layer(quantized)
ppl = accuracy.run(ARGS)["rows"][0]["ppl_512"]
print(MODE, round(ppl, 4), flush=True)
