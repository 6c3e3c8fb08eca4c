"""4-bit KV variants, measured before choosing int4's format (docs/kv_quantization.md, "Why int4
is what it is"): each variant fake-quantizes K and/or V as they are written (rotated by the
Hadamard transform or not, one scale per row or per group, symmetric or with a minimum, with the
block's first key subtracted first, with K and Q rescaled per RoPE channel pair in the weights),
the cache stays float32, and ``pagedllm bench accuracy``'s harness gives the perplexity on 2,048
tokens of Python's pydoc_data topics at 512 tokens of context, float32 SmolLM2.

    .venv/bin/python scripts/int4_variants.py none row15 g32_15 row16asym g32_16asym row15_k row15_v
    .venv/bin/python scripts/int4_variants.py g16_15 smooth_0.5 anchor anchor_g32 anchor_g16
    .venv/bin/python scripts/int4_variants.py klayers_0_10 klayers_10_20 klayers_20_30
    .venv/bin/python scripts/int4_variants.py --full none row15 smooth_0.5 anchor  # 20,480 tokens, 512 and 4,096

Variants (V is quantized as ``row15`` wherever a variant names only K):

- ``rowN`` / ``gG_N``: N levels, one symmetric bfloat16 scale per 64-value row / per G values;
  ``asym``: a scale and a minimum (16 levels); ``_norot``: no rotation; ``_k`` / ``_v``: that one only;
- ``smooth_A``: K divided and Q multiplied, per RoPE channel pair of each KV head, by
  ``(|W_k gamma| / |W_q gamma|) ** A`` (row norms of the projections with the input norm's weight
  folded in; exact in real arithmetic, since a per-pair factor commutes with RoPE), then ``row15``;
- ``klayers_A_B``: K quantized (``row15``) in layers A..B-1 only (where the loss comes from);
- ``anchor``: each block's first key (kept in float, which a real format would have to pay for)
  subtracted from the block's keys before ``row15``; ``anchor_gG``: the same with a scale per G;
- ``center`` / ``center_gG``: one constant key per layer and KV head (the mean key of the first
  2,048 tokens of the text, measured by a first pass) subtracted before ``row15`` / a scale per G
  values of K. Free in a kernel: softmax ignores ``q . mu``, the same for every key of a query.

    .venv/bin/python scripts/int4_variants.py --full center center_g32
"""
import argparse
import sys

import torch

from pagedllm.attention import reference
from pagedllm.bench import accuracy
from pagedllm.kvstore.quant import fwht
from pagedllm.models import llama

orig = reference.write_kv
orig_load = llama.LlamaForCausalLM.load_hf_state_dict
BLOCK = 16


def quantize(x, group, levels, asym=False, rotate=True):
    shape = x.shape
    xf = x.float()
    if rotate:
        xf = fwht(xf)
    g = xf.reshape(*shape[:-1], -1, group)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = ((hi - lo) / (levels - 1)).bfloat16().float()
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        d = torch.round((g - lo) * inv).clamp(0, levels - 1) * s + lo
    else:
        qmax = (levels - 1) / 2
        s = (g.abs().amax(-1, keepdim=True) / qmax).bfloat16().float()
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        d = torch.round(g * inv).clamp(-qmax, qmax) * s
    d = d.reshape(shape)
    if rotate:
        d = fwht(d)
    return d.to(x.dtype)


def fake(group, levels, asym=False, rotate=True, which="kv"):
    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        k = quantize(key, group, levels, asym, rotate) if "k" in which else key
        v = quantize(value, group, levels, asym, rotate) if "v" in which else value
        orig(kv, k, v, slot_mapping, has_padding_slots)
    return write_kv


def anchored(group):
    """Keys minus their block's first key (slot ``offset 0``, always written first), quantized."""
    anchors, layer_of = {}, {}

    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        layer = layer_of.setdefault(id(kv), len(layer_of))
        k = key.float()
        blocks, offsets = (slot_mapping // BLOCK).tolist(), (slot_mapping % BLOCK).tolist()
        for t, (b, o) in enumerate(zip(blocks, offsets, strict=True)):
            if o == 0:
                anchors[layer, b] = k[t].clone()
        a = torch.stack([anchors[layer, b] for b in blocks])
        k = quantize(k - a, group, 15) + a
        orig(kv, k.to(key.dtype), quantize(value, 64, 15), slot_mapping, has_padding_slots)
    return write_kv


def collect_key_means():
    """A write_kv that records each layer's mean key per KV head (post-RoPE, as stored)."""
    sums, counts, layer_of = {}, {}, {}

    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        layer = layer_of.setdefault(id(kv), len(layer_of))
        keep = slot_mapping >= 0
        sums[layer] = sums.get(layer, 0) + key[keep].double().sum(0)
        counts[layer] = counts.get(layer, 0) + int(keep.sum())
        orig(kv, key, value, slot_mapping, has_padding_slots)
    return write_kv, lambda: {i: (sums[i] / counts[i]).float() for i in sums}


def centered(means, group):
    """Keys minus a constant per layer and KV head (softmax ignores q.mu: free in a kernel),
    K quantized with a scale per ``group`` values, V per row."""
    layer_of = {}

    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        layer = layer_of.setdefault(id(kv), len(layer_of))
        mu = means[layer].to(key.device)
        k = quantize(key.float() - mu, group, 15) + mu
        orig(kv, k.to(key.dtype), quantize(value, 64, 15), slot_mapping, has_padding_slots)
    return write_kv


def k_in_layers(first, last):
    """K quantized (``row15``) in layers first..last-1 only, V and the other layers' K float32."""
    layer_of = {}

    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        layer = layer_of.setdefault(id(kv), len(layer_of))
        k = quantize(key, 64, 15) if first <= layer < last else key
        orig(kv, k, value, slot_mapping, has_padding_slots)
    return write_kv


def smoothed(alpha):
    """Fold a per-RoPE-pair factor into W_q (times) and W_k (divided) when the model loads."""
    def load(self, weights):
        cfg, w = self.config, dict(weights)
        d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        for i in range(cfg.num_layers):
            a = f"model.layers.{i}.self_attn."
            gamma = w[f"model.layers.{i}.input_layernorm.weight"].float()
            wq, wk = w[a + "q_proj.weight"].float(), w[a + "k_proj.weight"].float()
            qn = (wq * gamma).norm(dim=1).view(nh, 2, d // 2).pow(2).sum(1).view(nkv, nh // nkv, d // 2).mean(1)
            kn = (wk * gamma).norm(dim=1).view(nkv, 2, d // 2).pow(2).sum(1)
            c = (kn.sqrt() / qn.sqrt()).pow(alpha)
            c = (c / c.pow(2).mean(-1, keepdim=True).sqrt()).repeat(1, 2)
            w[a + "k_proj.weight"] = (wk / c.reshape(-1, 1)).to(wk.dtype)
            w[a + "q_proj.weight"] = (wq * c.repeat_interleave(nh // nkv, 0).reshape(-1, 1)).to(wq.dtype)
        return orig_load(self, w)
    return load


variants = {
    "none": None,
    "row15": fake(64, 15), "g32_15": fake(32, 15), "g16_15": fake(16, 15),
    "row16asym": fake(64, 16, asym=True), "g32_16asym": fake(32, 16, asym=True),
    "row15_norot": fake(64, 15, rotate=False), "row15_k": fake(64, 15, which="k"), "row15_v": fake(64, 15, which="v"),
    "anchor": "anchor_64", "anchor_g32": "anchor_32", "anchor_g16": "anchor_16",
}
# --full: the whole accuracy text (20,480 tokens) at 512 and 4,096 tokens of context, as `bench accuracy`
FULL = "--full" in sys.argv
names = [a for a in sys.argv[1:] if a != "--full"]
args = argparse.Namespace(model=None, kv_cache_dtypes="float32", weights="float32",
                          contexts="512,4096" if FULL else "512", text_tokens=20480 if FULL else 2048,
                          prompts=0, new_tokens=0, chunk=64, block_size=BLOCK, quiet=True, configs=None)
for name in names:
    llama.LlamaForCausalLM.load_hf_state_dict = orig_load
    if name.startswith("smooth_"):
        llama.LlamaForCausalLM.load_hf_state_dict = smoothed(float(name.split("_")[1]))
        reference.write_kv = fake(64, 15)
    elif name.startswith("klayers_"):
        reference.write_kv = k_in_layers(*map(int, name.split("_")[1:]))
    elif name.startswith("center"):
        calib = argparse.Namespace(**{**vars(args), "contexts": "512", "text_tokens": 2048})
        reference.write_kv, means = collect_key_means()
        accuracy.run(calib)
        reference.write_kv = centered(means(), int(name.split("_g")[1]) if "_g" in name else 64)
    elif isinstance(variants[name], str):
        reference.write_kv = anchored(int(variants[name].split("_")[1]))
    else:
        reference.write_kv = variants[name] or orig
    r = accuracy.run(args)
    row = r["rows"][0]
    print(name, *(round(row[f"ppl_{c}"], 4) for c in r["contexts"]), flush=True)
