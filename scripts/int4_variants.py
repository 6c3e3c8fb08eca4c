"""4-bit KV variants, measured before choosing int4's format (docs/kv_quantization.md, "Why int4
is what it is"): each variant fake-quantizes K and/or V as they are written (rotated by the
Hadamard transform or not, one scale per row or per group, symmetric or with a minimum), the
cache stays float32, and ``pagedllm bench accuracy``'s harness gives the perplexity on 2,048
tokens of Python's pydoc_data topics at 512 tokens of context, float32 SmolLM2.

    .venv/bin/python scripts/int4_variants.py none row15 g32_15 row16asym g32_16asym row15_k row15_v
"""
import argparse
import sys

import torch

from pagedllm.attention import reference
from pagedllm.bench import accuracy
from pagedllm.kvstore.quant import fwht

orig = reference.write_kv

def fake(group, levels, asym=False, rotate=True, which="kv"):
    def q(x):
        shape = x.shape
        xf = x.float()
        if rotate:
            xf = fwht(xf)
        g = xf.reshape(*shape[:-1], -1, group)
        if asym:
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            s = ((hi - lo) / (levels - 1)).bfloat16().float()
            inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            c = torch.round((g - lo) * inv).clamp(0, levels - 1)
            d = c * s + lo
        else:
            qmax = (levels - 1) / 2
            s = (g.abs().amax(-1, keepdim=True) / qmax).bfloat16().float()
            inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            d = torch.round(g * inv).clamp(-qmax, qmax) * s
        d = d.reshape(shape)
        if rotate:
            d = fwht(d)
        return d.to(x.dtype)
    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        k = q(key) if "k" in which else key
        v = q(value) if "v" in which else value
        orig(kv, k, v, slot_mapping, has_padding_slots)
    return write_kv

variants = {
 "none": None,
 "row15": fake(64, 15), "g32_15": fake(32, 15), "g16_15": fake(16, 15),
 "row16asym": fake(64, 16, asym=True), "g32_16asym": fake(32, 16, asym=True),
 "row15_norot": fake(64, 15, rotate=False), "row15_k": fake(64, 15, which="k"), "row15_v": fake(64, 15, which="v"),
}
args = argparse.Namespace(model=None, kv_cache_dtypes="float32", weights="float32", contexts="512", text_tokens=2048,
                          prompts=0, new_tokens=0, chunk=64, block_size=16, quiet=True)
for name in sys.argv[1:]:
    reference.write_kv = variants[name] or orig
    r = accuracy.run(args)
    print(name, round(r["rows"][0]["ppl_512"], 4), flush=True)
