"""``pagedllm bench accuracy``: what each KV format and weight mode costs in accuracy (issue 24).

Every configuration (a weight mode x a ``kv_cache_dtype``) is compared with the reference, float32
weights and float32 KV, on the same tokens:

- **perplexity** on a real English text no one here wrote: the Python Language Reference sections
  that ship with Python's standard library (``pydoc_data/topics.py``, what ``help("if")`` prints),
  the topics concatenated in name order, cut into non-overlapping windows of each context length
  (512 and 4,096 tokens by default) scored from their first token;
- **mean KL divergence** ``KL(reference || configuration)`` of the next-token distribution over
  the same positions, and by position in the longest windows (the plot: does the error grow with
  the context the quantized K/V covers?);
- **teacher-forced argmax agreement** along the reference's greedy continuation (128 tokens) of a
  fixed set of chat prompts: the share of positions where the configuration's most likely next
  token is the one the reference chose, its own mistakes never fed back.

Every sequence is prefilled in chunks of at most ``--chunk`` (64) tokens through the paged KV
cache, so later tokens attend to the K/V earlier chunks stored: a quantized format is read back
quantized, never the float rows it was written from. Attention runs on the reference backend
(every kernel is tested equal to it), which reads every format; each KV format gets its own pool
next to the one model per weight mode, and the bench writes its blocks directly (no request is
scheduled on those engines).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pagedllm.dtypes import torch_dtype
from pagedllm.engine.model_runner import build_metadata
from pagedllm.engine.scheduler import ScheduledChunk
from pagedllm.kvstore.spec import kv_spec_for
from pagedllm.kvstore.storage import KVCacheStorage

KV_FORMATS = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
# weight mode -> (dtype, quantization); "gguf" only for a GGUF checkpoint
WEIGHT_MODES = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "gguf": ("float32", "gguf"),
                "int8": ("float32", "int8")}
# weight modes that re-encode a GGUF's tensors whose rows are whole 256-value super-blocks
# (models/kquant_encode.py: round to nearest) and load the copy as float32
REQUANTIZED_MODES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
REFERENCE = ("float32", "float32")
PROMPTS = (
    "Explain in a few sentences how a hash table works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python?",
    "Give three tips for staying focused while studying.",
    "Describe the water cycle to a ten-year-old.",
    "Summarize the causes of the French Revolution.",
    "How do I make a simple tomato sauce?",
    "Why is the sky blue? Answer briefly.",
)
POSITION_BINS = 64  # the KL-by-position curve: mean KL over bins of the longest context


def text_source() -> str:
    return (f"Python {platform.python_version()} standard library, pydoc_data/topics.py (the Language Reference "
            f"sections help() prints), topics in name order")


def reference_text_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the topics' text (raises if it is shorter)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids.extend(tokenizer.encode(topics[name].strip() + "\n\n", add_special_tokens=False))
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"the reference text has only {len(ids)} tokens, fewer than {num_tokens}")


@dataclass
class Scorer:
    """One weight mode's model with one KV format's pool: log-probabilities of a sequence, prefilled
    chunk by chunk through the paged cache."""

    engine: object
    storage: KVCacheStorage
    chunk: int

    def chunks(self, ids: list[int]):
        """Yield (first position, log-softmax rows [T, vocab] float32) chunk by chunk."""
        runner = self.engine.runner
        bs = self.storage.block_size
        blocks = list(range(-(-len(ids) // bs)))
        for start in range(0, len(ids), self.chunk):
            end = min(start + self.chunk, len(ids))
            step = ScheduledChunk("accuracy", ids[start:end], start, blocks[:-(-end // bs)], sample=True)
            input_ids, positions, meta = build_metadata([step], bs, runner.device)
            hidden = runner.model.forward(input_ids, positions, meta, self.storage, runner.backend)
            yield start, torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """The greedy continuation: the prompt prefilled in chunks, then one decode step a token."""
        *_, (_, rows) = self.chunks(prompt)
        ids = list(prompt)
        for _ in range(new_tokens):
            ids.append(int(rows[-1].argmax()))
            rows = self._next(ids)
        return ids[len(prompt):]

    def _next(self, ids: list[int]) -> torch.Tensor:
        """The last position's row, the earlier ones already cached (a decode step)."""
        runner = self.engine.runner
        bs = self.storage.block_size
        step = ScheduledChunk("accuracy", ids[-1:], len(ids) - 1, list(range(-(-len(ids) // bs))), sample=True)
        input_ids, positions, meta = build_metadata([step], bs, runner.device)
        hidden = runner.model.forward(input_ids, positions, meta, self.storage, runner.backend)
        return torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)


@dataclass
class Tally:
    """Sums over scored positions for one configuration."""

    nll: float = 0.0
    kl: float = 0.0
    count: int = 0
    agree: int = 0

    def add(self, logp: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Rows' log-probs (this configuration and the reference) and next tokens; returns per-row KL."""
        kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)
        self.nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        self.kl += float(kl.sum())
        self.count += len(targets)
        self.agree += int((logp.argmax(-1) == targets).sum())
        return kl


def _score(scorer: Scorer, ids: list[int], first: int, ref_rows: torch.Tensor | None, tally: Tally):
    """Score positions ``first..len-2`` of ``ids`` (predicting ``first+1..``); with ``ref_rows``
    None this is the reference: its rows are returned. Returns (reference rows, per-position KL)."""
    rows, kls = [], []
    targets = torch.tensor(ids[1:])
    for start, logp in scorer.chunks(ids):
        lo, hi = max(start, first), min(start + len(logp), len(ids) - 1)
        if lo >= hi:
            continue
        mine = logp[lo - start:hi - start]
        ref = mine if ref_rows is None else ref_rows[lo - first:hi - first]
        kls.append(tally.add(mine, ref, targets[lo:hi]))
        if ref_rows is None:
            rows.append(mine)
    return (torch.cat(rows) if rows else ref_rows), torch.cat(kls)


def requantized_copy(model: str | None, kind: str) -> tuple[Path, dict]:
    """The GGUF ``model`` (default: the embedded one) with every tensor whose rows are whole 256-value
    super-blocks re-encoded as ``kind``, and what was re-encoded: the tensors, their share of the
    decoder's projection weights, their relative RMS error. Written once into the cache folder
    (``requantized/<model>.<key>.<kind>/``, keyed like the GGUF cache: the GGUF and its summary) by
    ``folder_written_once``, so a failed or concurrent write leaves no half-written file."""
    import gguf

    from pagedllm.cache_dir import cache_dir, folder_written_once
    from pagedllm.models import kquant_encode
    from pagedllm.models.loader import gguf_cache_key, resolve_model_path

    source = resolve_model_path(model)
    if source.suffix != ".gguf":
        raise SystemExit(f"weight mode {kind.lower()} re-encodes a GGUF's tensors; {source} is not a GGUF")
    folder = cache_dir() / "requantized" / f"{source.stem}.{gguf_cache_key(source)}.{kind}"
    name = f"{source.stem}.{kind}.gguf"
    if (folder / name).exists() and (folder / "summary.json").exists():
        return folder / name, json.loads((folder / "summary.json").read_text())
    with folder_written_once(folder) as tmp:
        names = kquant_encode.requantize_gguf(source, tmp / name,
                                              lambda tensor: kind if tensor.startswith("blk.") else None)
        original = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
        squared_error = squared_norm = 0.0
        for t in gguf.GGUFReader(str(tmp / name)).tensors:
            if t.name in names:
                a = torch.from_numpy(gguf.quants.dequantize(original[t.name].data, original[t.name].tensor_type).copy())
                b = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
                squared_error += float(((a - b) ** 2).sum())
                squared_norm += float((a ** 2).sum())
        projections = sum(int(t.n_elements) for t in original.values()
                          if t.name.startswith("blk.") and len(t.shape) == 2)
        summary = {"kind": kind, "tensors": len(names),
                   "share_of_projection_weights": sum(int(original[n].n_elements) for n in names) / max(projections, 1),
                   "relative_rms_error": math.sqrt(squared_error / max(squared_norm, 1e-30))}
        (tmp / "summary.json").write_text(json.dumps(summary))
    return folder / name, summary


def run(args) -> dict:
    from pagedllm.engine.builder import build_engine

    kv_formats = [f.strip() for f in args.kv_cache_dtypes.split(",")]
    weights = [w.strip() for w in args.weights.split(",")]
    contexts = sorted(int(c) for c in args.contexts.split(","))
    configs = [(w, f) for w in weights for f in kv_formats]
    if args.configs:  # explicit weight/KV pairs instead of the cross product
        configs = [tuple(pair.strip().split("/", 1)) for pair in args.configs.split(",") if pair.strip()]
        if any(len(c) != 2 for c in configs):
            raise SystemExit(f"--configs: give weight/kv pairs such as float32/int8, got {args.configs!r}")
    if REFERENCE not in configs:
        configs.insert(0, REFERENCE)
    engines, requantized = {}, {}
    for w in dict.fromkeys(w for w, _ in configs):
        if w in REQUANTIZED_MODES:
            model, requantized[w] = requantized_copy(args.model, REQUANTIZED_MODES[w])
            engines[w] = build_engine(model=str(model), dtype="float32", quantization="none",
                                      attention_backend="reference", num_kv_blocks=1)
            continue
        if w not in WEIGHT_MODES:
            modes = ", ".join([*WEIGHT_MODES, *REQUANTIZED_MODES])
            raise SystemExit(f"--weights: no weight mode {w!r} (modes: {modes})")
        dtype, quantization = WEIGHT_MODES[w]
        engines[w] = build_engine(model=args.model, dtype=dtype, quantization=quantization,
                                  attention_backend="reference", num_kv_blocks=1)
    tokenizer = engines[REFERENCE[0]].tokenizer
    text = reference_text_ids(tokenizer, args.text_tokens)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    max_len = max([*contexts, *(len(p) + args.new_tokens for p in prompts)])
    scorers = {}
    for w, f in configs:
        engine = engines[w]
        spec = kv_spec_for(engine.config.model, args.block_size, f, torch_dtype(engine.config.dtype))
        scorers[w, f] = Scorer(engine, KVCacheStorage.allocate(spec, -(-max_len // args.block_size)), args.chunk)
    tallies = {(c, cfg): Tally() for c in [*contexts, "prompts"] for cfg in configs}
    by_position = {cfg: torch.zeros(contexts[-1] - 1, dtype=torch.float64) for cfg in configs}
    windows = [(c, text[i:i + c]) for c in contexts for i in range(0, len(text) - c + 1, c)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        bar = tqdm(total=len(windows) + len(prompts), desc="accuracy", unit="seq", disable=args.quiet)
        for c, ids in windows:
            ref, _ = _score(scorers[REFERENCE], ids, 0, None, tallies[c, REFERENCE])
            for cfg in configs[1:]:
                _, kl = _score(scorers[cfg], ids, 0, ref, tallies[c, cfg])
                if c == contexts[-1]:
                    by_position[cfg] += kl.double()
            bar.update()
        for prompt in prompts:
            continuation = scorers[REFERENCE].greedy(prompt, args.new_tokens)
            ids = prompt + continuation
            ref, _ = _score(scorers[REFERENCE], ids, len(prompt) - 1, None, tallies["prompts", REFERENCE])
            for cfg in configs[1:]:
                _score(scorers[cfg], ids, len(prompt) - 1, ref, tallies["prompts", cfg])
            bar.update()
        bar.close()
    longest = sum(1 for c, _ in windows if c == contexts[-1])
    bf16_bytes = scorers[REFERENCE].storage.spec.bytes_per_block / 2  # float32 KV: twice bf16's bytes
    rows = []
    for w, f in configs:
        spec = scorers[w, f].storage.spec
        row = {"weights": w, "kv_cache_dtype": f, "kv_bytes_per_token": spec.bytes_per_block / spec.block_size,
               "blocks_vs_bf16": bf16_bytes / spec.bytes_per_block}
        for c in contexts:
            t, r = tallies[c, (w, f)], tallies[c, REFERENCE]
            row[f"ppl_{c}"] = math.exp(t.nll / t.count)
            row[f"ppl_{c}_delta_pct"] = 100 * (math.exp((t.nll - r.nll) / t.count) - 1)
            row[f"kl_{c}"] = t.kl / t.count
        if prompts:
            t = tallies["prompts", (w, f)]
            row["agreement"] = t.agree / t.count
            row["kl_prompts"] = t.kl / t.count
        rows.append(row)
    curve = {}
    for cfg in configs[1:]:
        values = (by_position[cfg] / max(longest, 1)).float()
        n = len(values) // POSITION_BINS * POSITION_BINS
        curve[f"{cfg[0]}/{cfg[1]}"] = values[:n].view(-1, n // POSITION_BINS).mean(1).tolist() if n else []
    return {"machine": platform.processor() or platform.machine(), "model": str(engines[REFERENCE[0]].model_path),
            "text_source": text_source(), "text_tokens": len(text), "contexts": contexts,
            "windows": {c: sum(1 for cc, _ in windows if cc == c) for c in contexts},
            "prompts": len(prompts), "new_tokens": args.new_tokens, "chunk": args.chunk,
            "block_size": args.block_size, "reference": "float32 weights, float32 KV", "rows": rows,
            "kl_by_position": {"context": contexts[-1], "bins": POSITION_BINS, "curves": curve},
            "requantized": requantized, "seconds": time.perf_counter() - t0}


def table(report: dict) -> str:
    contexts = report["contexts"]
    head = ["weights", "KV", "bytes/token", "blocks vs bf16"]
    for c in contexts:
        head += [f"ppl@{c}", "vs ref", f"KL@{c}"]
    if report["prompts"]:
        head += ["agreement", "KL prompts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        cells = [r["weights"], r["kv_cache_dtype"], f"{r['kv_bytes_per_token']:.0f}", f"{r['blocks_vs_bf16']:.2f}x"]
        for c in contexts:
            flag = " (!)" if r[f"ppl_{c}_delta_pct"] > 2 else ""
            cells += [f"{r[f'ppl_{c}']:.4f}", f"{r[f'ppl_{c}_delta_pct']:+.2f}%{flag}", f"{r[f'kl_{c}']:.2e}"]
        if report["prompts"]:
            cells += [f"{100 * r['agreement']:.1f}%", f"{r['kl_prompts']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = report["kl_by_position"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in info["curves"].items():
        if not values or max(values) <= 0:
            continue
        width = (info["context"] - 1) / len(values)
        ax.plot([(i + 0.5) * width for i in range(len(values))], values, label=name)
    ax.set_yscale("log")
    ax.set_xlabel(f"position in a {info['context']}-token window")
    ax.set_ylabel("mean KL(reference || configuration)")
    ax.set_title(f"Next-token KL against float32 weights + float32 KV\n{report['text_source'][:90]}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench accuracy``'s flags (the model's; dtype and quantization are the weight modes')."""
    from pagedllm.cli_args import add_option_args

    add_option_args(p, only=("model",))
    p.add_argument("--kv-cache-dtypes", default=",".join(KV_FORMATS), help="KV formats to measure")
    p.add_argument("--weights", default="float32,bfloat16,gguf",
                   help=f"weight modes ({', '.join([*WEIGHT_MODES, *REQUANTIZED_MODES])}; gguf: the checkpoint's "
                        "own GGUF blocks; int8: quantization=int8; q4_k/q5_k/q6_k: a GGUF's tensors of whole "
                        "256-value rows re-encoded so (round to nearest), loaded as float32)")
    p.add_argument("--configs", default=None,
                   help="weight/KV pairs to measure instead of every weight mode x KV format, e.g. "
                        "float32/int8,gguf/float32 (the float32/float32 reference is always measured)")
    p.add_argument("--contexts", default="512,4096", help="perplexity window lengths (tokens)")
    p.add_argument("--text-tokens", type=int, default=20480, help="tokens of the reference text to score")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"chat prompts (at most {len(PROMPTS)})")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt, teacher-forced")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--plot", default=None, help="write the KL-by-position plot here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    report = run(args)
    print(f"{report['model']}; {report['text_tokens']} tokens of {report['text_source']}; "
          f"reference {report['reference']}; {report['seconds']:.0f} s", file=sys.stderr)
    print(table(report))
    for mode, info in report["requantized"].items():
        print(f"{mode}: {info['tensors']} tensors re-encoded as {info['kind']} (round to nearest), "
              f"{100 * info['share_of_projection_weights']:.1f}% of the decoder's projection weights, "
              f"relative RMS error {info['relative_rms_error']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 0
