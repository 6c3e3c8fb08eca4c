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

Session 29 (docs/kv_quantization.md, "Session 29"):

- ``grid15``: K and V coded on 15 uneven levels (``lloyd_grid``: Lloyd-Max for Gaussian rows over
  their absmax), one scale per row; what int4 now stores;
- ``sinkN``: the keys of positions below N kept in float, the rest ``row15``;
- ``prerope_center[_grid][_g32]``: each key minus its layer's and KV head's mean key *before*
  RoPE (stored ``RoPE_p(k - mu)``, read back plus ``RoPE_p(mu)``), on even or uneven levels, a
  scale per row or per 32 values; ``--calib=random`` / ``--calib=argparse`` measure ``mu`` on
  seeded random token ids / argparse's source instead of the evaluated text's first 2,048 tokens;
- ``weighted_A``: ``prerope_center_grid`` with each RoPE pair of the centred key multiplied by
  ``(q RMS / k RMS) ** A`` before quantizing and divided after (its statistics always from the
  evaluated text's first 2,048 tokens).

    .venv/bin/python scripts/int4_variants.py none row15 sink4 grid15 prerope_center prerope_center_grid
    .venv/bin/python scripts/int4_variants.py prerope_center_grid_g32 weighted_0.25 weighted_0.5
    .venv/bin/python scripts/int4_variants.py --calib=random prerope_center_grid
    .venv/bin/python scripts/int4_variants.py --full --calib=random prerope_center_grid prerope_center
    .venv/bin/python scripts/int4_variants.py --levels  # int4's levels, as kvstore/quant.py holds them

Session 41: ``prerope_anchor8`` / ``prerope_anchor16``: ``prerope_center_grid``, and each block's
first centred key (int8 / int16) subtracted from the block's centred keys before their 4-bit codes.

    .venv/bin/python scripts/int4_variants.py --calib=random prerope_center_grid prerope_anchor8

``split_kAvB[_center]``: K on a Lloyd grid of 2^A - 1 levels and V on one of 2^B - 1 (one bf16 scale
per row each; ``split_k5v3``: 68 bytes per token and KV head at head size 64, as int4's);
``_center``: K centred before RoPE (``--calib``).

    .venv/bin/python scripts/int4_variants.py grid15 split_k5v3 split_k4v4 split_k6v2
    .venv/bin/python scripts/int4_variants.py --full --calib=random split_k5v3 split_k5v3_center
"""
import argparse
import sys

import torch

from pagedllm.attention import reference
from pagedllm.bench import accuracy
from pagedllm.kvstore.quant import fwht
from pagedllm.models import layers, llama

orig = reference.write_kv
orig_load = llama.LlamaForCausalLM.load_hf_state_dict
orig_rope = layers.RotaryEmbedding.forward
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


def lloyd_grid(levels=15, rows=20000, dim=64, iters=60, dtype=torch.float32, drop_max=False):
    """A symmetric grid of ``levels`` points on [-1, 1] (the ends fixed: a row's absmax maps to
    them), fitted by Lloyd's algorithm to Gaussian rows divided by their absmax: what a rotated
    row looks like. Generic (no model data): a format could fix it once. The session-29 variants
    ran the defaults; ``--levels`` prints int4's shipped levels, a longer fit (``INT4_FIT``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=g, dtype=dtype)
    x = (x / x.abs().amax(-1, keepdim=True)).abs().flatten()
    if drop_max:  # each row's largest value is 1 exactly, stored exactly: not part of the fit
        x = x[x < 1]
    half = levels // 2
    pts = torch.linspace(0, 1, half + 1, dtype=dtype)
    for _ in range(iters):
        idx = torch.bucketize(x, (pts[1:] + pts[:-1]) / 2)  # each value's nearest point
        for j in range(1, half):  # 0 and 1 stay fixed
            sel = x[idx == j]
            if len(sel):
                pts[j] = sel.mean()
    return torch.cat([-pts.flip(0)[:-1], pts])


# int4's levels in kvstore/quant.py: 7 times this fit's positive points, rounded to 4 decimals
INT4_FIT = dict(levels=15, rows=200000, iters=200, dtype=torch.float64, drop_max=True)


def quantize_grid(x, grid, group=64):
    """Rotated rows, one absmax scale per ``group`` values, each value to its nearest grid point."""
    shape = x.shape
    xf = fwht(x.float())
    g = xf.reshape(*shape[:-1], -1, group)
    s = g.abs().amax(-1, keepdim=True).bfloat16().float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    idx = ((g * inv).unsqueeze(-1) - grid).abs().argmin(-1)
    d = (grid[idx] * s).reshape(shape)
    return fwht(d).to(x.dtype)


def v_only_write():
    """write_kv quantizing V only (per row): K is quantized in the RoPE hook."""
    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        orig(kv, key, quantize(value, 64, 15), slot_mapping, has_padding_slots)
    return write_kv


def rope_hook(k_post_fn, num_layers=30):
    """RotaryEmbedding.forward with K replaced by ``k_post_fn(layer, positions, k_pre, rope)``,
    where ``rope(x)`` rotates x at the call's positions. Layers call RoPE in order."""
    calls = [0]

    def forward(self, positions, q, k):
        layer = calls[0] % num_layers
        calls[0] += 1
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)

        def rope(x):
            return x * cos + layers._rotate_half(x) * sin
        return rope(q), k_post_fn(layer, positions, k, rope)
    return forward


def collect_prerope_means():
    sums, counts = {}, {}

    def k_post(layer, positions, k, rope):
        sums[layer] = sums.get(layer, 0) + k.double().sum(0)
        counts[layer] = counts.get(layer, 0) + k.shape[0]
        return rope(k)
    return k_post, lambda: {i: (sums[i] / counts[i]).float() for i in sums}


def collect_pair_energy(means, num_kv_heads=3):
    """Per layer and KV head: the mean square per RoPE channel pair of the queries (the group's
    heads averaged) and of the keys minus ``means`` (pre-RoPE; a pair's energy is RoPE-invariant)."""
    qe, ke, counts = {}, {}, {}

    def pairs(x):  # [..., D] -> [..., D/2]: x_j^2 + x_{j+D/2}^2
        half = x.shape[-1] // 2
        return x[..., :half].double() ** 2 + x[..., half:].double() ** 2

    def forward(self, positions, q, k, calls=[0]):  # noqa: B006 (a counter)
        layer = calls[0] % 30
        calls[0] += 1
        t, h, d = q.shape
        qe[layer] = qe.get(layer, 0) + pairs(q).view(t, num_kv_heads, h // num_kv_heads, d // 2).mean(2).sum(0)
        ke[layer] = ke.get(layer, 0) + pairs(k - means[layer]).sum(0)
        counts[layer] = counts.get(layer, 0) + t
        return orig_rope(self, positions, q, k)
    return forward, lambda: {i: ((qe[i] / counts[i]).float(), (ke[i] / counts[i]).float()) for i in qe}


def prerope_weighted(means, energy, alpha, grid):
    """``prerope_centered`` with each RoPE pair of the centred key multiplied by
    ``(q_rms / k_rms) ** alpha`` before the rotation and divided after (foldable into W_k / W_q)."""
    def k_post(layer, positions, k, rope):
        qe, ke = energy[layer]
        w = (qe.sqrt() / ke.sqrt().clamp_min(1e-12)) ** alpha
        w = (w / w.pow(2).mean(-1, keepdim=True).sqrt()).repeat(1, 2).to(k.dtype)  # [KH, D]
        mu = means[layer].to(k.dtype)
        r = quantize_grid(rope(k - mu) * w, grid, 64) / w
        return (r + rope(mu.expand_as(k))).to(k.dtype)
    return k_post


def prerope_centered(means, group, grid=None):
    """Stored: the key minus RoPE(mu) at its own position, quantized (mu: the layer's mean key
    before RoPE); read back plus RoPE(mu). A kernel would add q . RoPE_pos(mu) per key.
    ``grid``: codes on that grid (``lloyd_grid``) instead of evenly spaced."""
    def k_post(layer, positions, k, rope):
        mu = means[layer].to(k.dtype)
        r = rope(k - mu)
        r = quantize(r, group, 15) if grid is None else quantize_grid(r, grid, group)
        return (r + rope(mu.expand_as(k))).to(k.dtype)
    return k_post


def prerope_anchored(means, grid, anchor_levels=255):
    """``prerope_centered`` on the uneven grid, and each block's first centred key (int8, a scale
    of its own: 66 bytes a block and KV head, ~4 bytes a token at 16-token blocks) subtracted from
    the block's centred keys before they are quantized. A kernel would add ``q . anchor`` once per
    block and ``q . RoPE_pos(mu)`` per key. Blocks follow positions (``pos // BLOCK``), and the
    harness runs one sequence at a time, its chunks in order, so a block's first key comes first."""
    anchors = {}

    def k_post(layer, positions, k, rope):
        mu = means[layer].to(k.dtype)
        r = rope(k - mu).float()
        pos = positions.tolist()
        for t, p in enumerate(pos):
            if p % BLOCK == 0:
                anchors[layer, p // BLOCK] = quantize(r[t], 64, anchor_levels, rotate=False)
        a = torch.stack([anchors[layer, p // BLOCK] for p in pos])
        q = quantize_grid(r - a, grid, 64) + a
        return (q + rope(mu.expand_as(k))).to(k.dtype)
    return k_post


def v_grid_write(grid):
    def write_kv(kv, key, value, slot_mapping, has_padding_slots=False):
        orig(kv, key, quantize_grid(value, grid, 64), slot_mapping, has_padding_slots)
    return write_kv


def sink(n):
    """K of positions below ``n`` kept in float, the rest one scale per row."""
    def k_post(layer, positions, k, rope):
        kk = rope(k)
        keep = (positions < n).view(-1, 1, 1)
        return torch.where(keep, kk, quantize(kk, 64, 15))
    return k_post


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
if "--levels" in sys.argv:  # INT4_POINTS of kvstore/quant.py
    print(tuple(round(7 * v, 4) for v in lloyd_grid(**INT4_FIT)[8:].tolist()))
    sys.exit(0)
FULL = "--full" in sys.argv
# --calib=random / --calib=argparse: the centring variants' mean keys measured on 2,048 random token
# ids, or on argparse's source (code and docstrings), instead of the evaluated text's first 2,048 tokens
CALIB = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--calib=")), "text")
names = [a for a in sys.argv[1:] if not a.startswith("--")]
orig_text = accuracy.reference_text_ids


def calibration_ids(tokenizer, num_tokens):
    if CALIB == "random":
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, tokenizer.vocab_size, (num_tokens,), generator=g).tolist()
    if CALIB == "argparse":  # Python source with its docstrings: another text than the evaluated one
        import inspect
        return tokenizer.encode(inspect.getsource(argparse), add_special_tokens=False)[:num_tokens]
    return orig_text(tokenizer, num_tokens)


def calibrate(run_args):
    accuracy.reference_text_ids = calibration_ids
    try:
        accuracy.run(run_args)
    finally:
        accuracy.reference_text_ids = orig_text


def measure_prerope_means():
    """Each layer's mean key per KV head before RoPE, on the calibration text (``--calib``)."""
    calib = argparse.Namespace(**{**vars(args), "contexts": "512", "text_tokens": 2048})
    reference.write_kv = orig
    k_post, means = collect_prerope_means()
    layers.RotaryEmbedding.forward = rope_hook(k_post)
    calibrate(calib)
    return means()


args = argparse.Namespace(model=None, kv_cache_dtypes="float32", weights="float32",
                          contexts="512,4096" if FULL else "512", text_tokens=20480 if FULL else 2048,
                          prompts=0, new_tokens=0, chunk=64, block_size=BLOCK, quiet=True, configs=None)
for name in names:
    llama.LlamaForCausalLM.load_hf_state_dict = orig_load
    layers.RotaryEmbedding.forward = orig_rope
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
    elif name.startswith("prerope_center"):
        means = measure_prerope_means()
        grid = lloyd_grid(15) if "grid" in name else None  # prerope_center[_grid][_g32]
        layers.RotaryEmbedding.forward = rope_hook(
            prerope_centered(means, int(name.split("_g")[-1]) if "_g3" in name or "_g1" in name else 64, grid))
        reference.write_kv = v_only_write() if grid is None else v_grid_write(grid)
    elif name.startswith("split_k"):  # split_k5v3[_center]: K and V on Lloyd grids of 2^b - 1 levels
        kb, vb = int(name[7]), int(name[9])
        kgrid, vgrid = lloyd_grid(2 ** kb - 1), lloyd_grid(2 ** vb - 1)
        if name.endswith("_center"):
            layers.RotaryEmbedding.forward = rope_hook(prerope_centered(measure_prerope_means(), 64, kgrid))
            reference.write_kv = v_grid_write(vgrid)
        else:
            def write_kv(kv, key, value, slot_mapping, has_padding_slots=False, kgrid=kgrid, vgrid=vgrid):
                orig(kv, quantize_grid(key, kgrid, 64), quantize_grid(value, vgrid, 64), slot_mapping,
                     has_padding_slots)
            reference.write_kv = write_kv
    elif name.startswith("prerope_anchor"):  # prerope_anchor8 / prerope_anchor16 (an int16 anchor)
        means = measure_prerope_means()
        grid = lloyd_grid(15)
        levels = 255 if name.endswith("8") else 2 ** 16 - 1
        layers.RotaryEmbedding.forward = rope_hook(prerope_anchored(means, grid, levels))
        reference.write_kv = v_grid_write(grid)
    elif name.startswith("weighted_"):  # weighted_A: prerope_center_grid, pairs weighted ^A
        calib = argparse.Namespace(**{**vars(args), "contexts": "512", "text_tokens": 2048})
        reference.write_kv = orig
        k_post, means = collect_prerope_means()
        layers.RotaryEmbedding.forward = rope_hook(k_post)
        accuracy.run(calib)
        mu = means()
        layers.RotaryEmbedding.forward, energy = collect_pair_energy(mu)
        accuracy.run(calib)
        grid = lloyd_grid(15)
        layers.RotaryEmbedding.forward = rope_hook(prerope_weighted(mu, energy(), float(name[9:]), grid))
        reference.write_kv = v_grid_write(grid)
    elif name.startswith("sink"):
        layers.RotaryEmbedding.forward = rope_hook(sink(int(name[4:])))
        reference.write_kv = v_only_write()
    elif name.startswith("grid"):  # grid15 / grid16: Lloyd levels; _g32: a scale per 32 values
        grid = lloyd_grid(int(name[4:6]))
        group = int(name.split("_g")[1]) if "_g" in name else 64

        def write_kv(kv, key, value, slot_mapping, has_padding_slots=False, grid=grid, group=group):
            orig(kv, quantize_grid(key, grid, group), quantize_grid(value, grid, 64), slot_mapping,
                 has_padding_slots)
        reference.write_kv = write_kv
    elif isinstance(variants[name], str):
        reference.write_kv = anchored(int(variants[name].split("_")[1]))
    else:
        reference.write_kv = variants[name] or orig
    r = accuracy.run(args)
    row = r["rows"][0]
    print(name, *(round(row[f"ppl_{c}"], 4) for c in r["contexts"]), flush=True)
