"""``pagedllm bench peers``: pagedllm against other engines on this CPU, offline, on the same prompts.

Workloads (each run gets fresh seeded random token-id prompts, the same for every engine, so no
prefix-cache hits): *decode* ``C`` concurrent requests of ``--input-len`` prompt tokens and
``--output-len`` new tokens (greedy, EOS ignored), reported as output tokens/s end to end; and
*prefill* ``N x L``: N prompts of L tokens with ``max_tokens=1``, reported as prompt tokens/s.

The peers (``--peer``): vLLM's CPU build at each dtype of ``--peer-dtype`` (on a CPU without
native bf16 its bf16 GEMMs convert in the inner loop, so both bf16 and float32 are tried and the
faster counts), and llama.cpp on the same GGUF file (``peer_scripts/llamacpp_worker.py``). pagedllm runs
in this process (one ``LLM``); each peer setting in one long-lived worker under its own venv's
Python (``bench/peer_workers.py``), so start-up compiles happen once and only warm runs count.
Each engine first runs one untimed warm-up job; then for every round and workload all run back
to back (pagedllm first), and the report gives medians over rounds, each peer's fastest setting
per workload and the ratio pagedllm / that median, and each peer's greedy agreement with ours.
After round 1 a peer setting more than ``--peer-drop`` times slower than that peer's fastest on
a workload is not run again on it (it cannot be the one that counts; 0 keeps all). A peer whose
venv is missing is skipped with a message saying how to get it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.peer_workers import PeerWorker, peer_specs
from pagedllm.machine import machine_info, machine_steal_seconds


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    prompt_len: int
    max_tokens: int

    @property
    def is_prefill(self) -> bool:
        return self.max_tokens == 1

    def prompts(self, vocab_size: int, seed: str) -> list[list[int]]:
        rng = random.Random(seed)
        low, high = 100, vocab_size - 100  # clear of the special tokens at either end
        return [[rng.randrange(low, high) for _ in range(self.prompt_len)] for _ in range(self.num_prompts)]


@dataclass(frozen=True)
class TraceWorkload:
    """A trace's requests, all at once (the peers run offline: arrival times are not replayed), each
    with its own output length; shared prefixes and conversations stay shared. Every round puts its
    own first token before every prompt, so one round's KV is never a prefix-cache hit in the next
    while the sharing within a round remains (both engines cache prefixes by default)."""

    name: str
    base_prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]
    is_prefill = False

    @classmethod
    def from_trace(cls, name: str, trace: list, vocab_size: int, tokenize) -> TraceWorkload:
        from pagedllm.workloads.traces import prompt_token_ids

        if tokenize is None and any(r.prompt is not None for r in trace):
            raise ValueError("the trace has text prompts, and the model has no tokenizer")
        prompts = tuple(tuple(tokenize(r.prompt) if r.prompt is not None else prompt_token_ids(r, vocab_size, i))
                        for i, r in enumerate(trace))
        return cls(name, prompts, tuple(r.output_len for r in trace))

    @property
    def num_prompts(self) -> int:
        return len(self.base_prompts)

    @property
    def max_tokens(self) -> list[int]:
        return list(self.output_lens)

    def prompts(self, vocab_size: int, seed: str) -> list[list[int]]:
        first = random.Random(seed).randrange(100, vocab_size - 100)
        return [[first, *p] for p in self.base_prompts]


def expected_output_tokens(w: Workload | TraceWorkload) -> int:
    return sum(w.max_tokens) if isinstance(w.max_tokens, list) else w.num_prompts * w.max_tokens


def parse_workloads(concurrency: str, prefill: str, input_len: int, output_len: int) -> list[Workload]:
    """``"1,8"`` and ``"32x128,8x1024"`` -> workloads (raises ValueError naming a bad item)."""
    out: list[Workload] = []
    for item in dict.fromkeys(filter(None, (s.strip() for s in concurrency.split(",")))):  # each once
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--concurrency: {item!r} is not a positive count")
        out.append(Workload(f"decode x{item}", int(item), input_len, output_len))
    for item in dict.fromkeys(filter(None, (s.strip() for s in prefill.split(",")))):
        n, _, length = item.partition("x")
        if not (n.isdigit() and length.isdigit() and int(n) > 0 and int(length) > 0):
            raise ValueError(f"--prefill: {item!r} is not NxL (e.g. 32x128)")
        out.append(Workload(f"prefill {n}x{length}", int(n), int(length), 1))
    if not out:
        raise ValueError("no workloads: give --concurrency and/or --prefill")
    return out


def run_pagedllm(llm, prompts: list[list[int]], max_tokens: int | list[int]) -> dict:
    from pagedllm import SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def rate(result: dict, workload: Workload) -> float:
    """Prompt tokens/s for a prefill workload, output tokens/s for a decode one."""
    tokens = result["prompt_tokens"] if workload.is_prefill else result["output_tokens"]
    return tokens / result["seconds"]


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs for the same prompts agree: ``prefix``, the share of each
    request's tokens before the first that differs (averaged over requests), and ``identical``,
    the share of requests equal throughout."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"{len(ours)} outputs against {len(theirs)}")
    prefixes, identical = [], 0
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(same / max(len(a), len(b), 1))
        identical += a == b
    return {"prefix": statistics.fmean(prefixes), "identical": identical / len(ours)}


def context_per_sequence(workloads: list) -> int:
    """The longest prompt + output of any request, rounded up to 256 (llama.cpp's per-sequence context)."""
    longest = 16 + 4  # the warm-up job
    for w in workloads:
        outs = w.max_tokens if isinstance(w.max_tokens, list) else [w.max_tokens] * w.num_prompts
        lens = [len(p) for p in w.base_prompts] if isinstance(w, TraceWorkload) else [w.prompt_len] * w.num_prompts
        longest = max(longest, 1 + max(n + m for n, m in zip(lens, outs, strict=True)))
    return -(-longest // 256) * 256


class _Terminated(Exception):
    """SIGTERM while a peer runs: unwinds to the ``finally`` that kills the peers' process groups."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def _median(results: list[dict]) -> float | None:
    return statistics.median(r["tokens_per_s"] for r in results) if results else None


def summarize_workload(w, runs: dict[str, list[dict]], specs: list, dropped: dict[str, str]) -> dict:
    """One report row: every engine's median, each peer's best setting and our ratio to it, and the
    greedy agreement of each peer with ours over the rounds both ran (decode workloads)."""
    ours = runs["pagedllm"]
    row = {"name": w.name, "unit": "prompt tok/s" if w.is_prefill else "output tok/s",
           "pagedllm": _median(ours), "pagedllm_runs": [r["tokens_per_s"] for r in ours],
           "settings": {}, "peers": {}, "runs": runs}
    for spec in specs:
        theirs = runs[spec.label]
        entry = {"median": _median(theirs), "runs": [r["tokens_per_s"] for r in theirs],
                 "dropped": dropped.get(spec.label)}
        if not w.is_prefill:
            pairs = [(a["token_ids"], b["token_ids"]) for a, b in zip(ours, theirs, strict=False) if "token_ids" in b]
            if pairs:
                scores = [greedy_agreement(a, b) for a, b in pairs]
                entry["agreement"] = {k: statistics.fmean(s[k] for s in scores) for k in ("prefix", "identical")}
        row["settings"][spec.label] = entry
    for peer in dict.fromkeys(spec.peer for spec in specs):
        mine = [s for s in specs if s.peer == peer and row["settings"][s.label]["median"] is not None]
        if mine:
            best = max(mine, key=lambda s: row["settings"][s.label]["median"])
            median = row["settings"][best.label]["median"]
            row["peers"][peer] = {"best": best.setting, "median": median, "ratio": row["pagedllm"] / median}
    return row


def main(args) -> dict:
    from tqdm import tqdm

    from pagedllm import LLM
    from pagedllm.models.loader import resolve_model_path

    if args.trace:  # the trace alone; at most 256 sequences at once (vLLM's default), the same for both
        from pagedllm.workloads.traces import read_trace

        trace = read_trace(args.trace)
        workloads, max_num_seqs = [], min(256, max(64, len(trace)))
    else:
        workloads = parse_workloads(args.concurrency, args.prefill, args.input_len, args.output_len)
        max_num_seqs = max(64, *(w.num_prompts for w in workloads))
    if args.llamacpp_model is None:  # llama.cpp runs the very GGUF file we load, when we load one
        path = resolve_model_path(args.model)
        args.llamacpp_model = str(path) if path.suffix == ".gguf" else None
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
              quantization=args.quantization, max_num_seqs=max_num_seqs)
    vocab = llm.engine.config.model.vocab_size
    if args.trace:
        tokenizer = llm.get_tokenizer()
        workloads = [TraceWorkload.from_trace(f"trace {Path(args.trace).name}", trace, vocab,
                                              tokenizer.encode if tokenizer is not None else None)]
    specs, skipped = peer_specs(args, max_num_seqs, context_per_sequence(workloads), os.cpu_count() or 1)
    for message in skipped:
        print(message, file=sys.stderr)
    runs: dict[str, dict[str, list]] = {w.name: {"pagedllm": [], **{s.label: [] for s in specs}} for w in workloads}
    dropped: dict[str, dict[str, str]] = {w.name: {} for w in workloads}
    workers: list[PeerWorker] = []
    # `kill` (SIGTERM) would otherwise end this process at once and leave the peers' groups running
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if specs else None
    graceful = True
    try:
        for spec in specs:
            note = "; vLLM's first start compiles for minutes" if spec.peer == "vllm" else ""
            print(f"starting {spec.label} ({spec.argv[0]}){note}", file=sys.stderr)
            workers.append(PeerWorker(spec))
        engines = {"pagedllm": lambda prompts, max_tokens: run_pagedllm(llm, prompts, max_tokens)}
        engines.update({worker.spec.label: worker.run for worker in workers})
        warm = Workload("warm-up", 2, 16, 4).prompts(vocab, f"{args.seed}:warm-up")
        for engine in engines.values():
            engine(warm, 4)
        with tqdm(total=args.rounds * len(workloads), desc="bench peers", disable=args.no_progress,
                  file=sys.stderr) as bar:
            for round_ in range(args.rounds):
                for w in workloads:
                    prompts = w.prompts(vocab, f"{args.seed}:{w.name}:{round_}")
                    for name, engine in engines.items():
                        if name in dropped[w.name]:
                            continue
                        steal = machine_steal_seconds()
                        result = engine(prompts, w.max_tokens)
                        after = machine_steal_seconds()
                        result["machine_steal_s"] = None if steal is None or after is None else round(after - steal, 3)
                        expected = expected_output_tokens(w)
                        if result["output_tokens"] != expected:
                            raise RuntimeError(f"{name} generated {result['output_tokens']} tokens for {w.name}, "
                                               f"expected {expected}")
                        result["tokens_per_s"] = rate(result, w)
                        runs[w.name][name].append(result)
                    if round_ == 0 and args.peer_drop > 0:
                        dropped[w.name] = settings_to_drop(specs, runs[w.name], args.peer_drop)
                    bar.update(1)
    except _Terminated:
        graceful = False
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        for worker in workers:
            worker.close(graceful)
        if specs:
            signal.signal(signal.SIGTERM, previous_sigterm)
    report = {"settings": {"dtype": args.dtype, "quantization": llm.engine.config.quantization,
                           "kernels": llm.engine.kernels_line(), "rounds": args.rounds, "input_len": args.input_len,
                           "output_len": args.output_len, "max_num_seqs": max_num_seqs,
                           "peers": [s.label for s in specs], "peer_python": args.peer_python,
                           "peer_model": args.peer_model, "llamacpp_python": args.llamacpp_python,
                           "llamacpp_model": args.llamacpp_model, "peer_drop": args.peer_drop,
                           "seed": args.seed, "trace": args.trace},
              "machine": machine_info(), "skipped": skipped,
              "peer_info": {w.spec.label: {k: v for k, v in w.ready.items() if k != "ready"} for w in workers},
              "workloads": [summarize_workload(w, runs[w.name], specs, dropped[w.name]) for w in workloads]}
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def settings_to_drop(specs: list, runs: dict[str, list[dict]], ratio: float) -> dict[str, str]:
    """After the first round: each peer setting more than ``ratio`` times slower than that peer's
    fastest setting on the workload, with the reason (it cannot be the setting that counts)."""
    out = {}
    for spec in specs:
        best = max(runs[s.label][0]["tokens_per_s"] for s in specs if s.peer == spec.peer)
        mine = runs[spec.label][0]["tokens_per_s"]
        if mine * ratio < best:
            out[spec.label] = f"{best / mine:.1f}x slower than {spec.peer}'s fastest setting in round 1"
    return out


def format_report(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    labels = s["peers"]
    peers = list(dict.fromkeys(label.split(" ")[0] for label in labels))
    head = ["workload", "unit", "pagedllm", *labels, *(f"pagedllm / {p} at best" for p in peers)]
    lines = [f"{m['cpu']}, {m['cores']} cores, {' '.join(m['flags']) or 'no avx512/amx'}; pagedllm {s['dtype']} "
             f"({s['kernels']}); medians of {s['rounds']} alternating rounds",
             "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for row in report["workloads"]:
        cells = [row["name"], row["unit"], f"{row['pagedllm']:.1f}"]
        for label in labels:
            entry = row["settings"][label]
            cell = f"{entry['median']:.1f}"
            if entry.get("agreement"):
                cell += f" (agree {entry['agreement']['prefix']:.0%})"
            cells.append(cell + (" dropped after round 1" if entry["dropped"] else ""))
        for peer in peers:
            best = row["peers"].get(peer)
            cells.append(f"{best['ratio']:.2f}x ({best['best']})" if best else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += report["skipped"]
    if any("agreement" in e for row in report["workloads"] for e in row["settings"].values()):
        lines.append("agree: the share of each request's greedy tokens before its first difference from ours")
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench peers``'s flags."""
    p.add_argument("--concurrency", default="1,8,32,64", help="decode workloads: concurrent requests, comma-separated")
    p.add_argument("--prefill", default="32x128,64x128,32x512,8x1024,4x2048",
                   help="prefill workloads: NxL (N prompts of L tokens, max_tokens 1), comma-separated")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the decode workloads")
    p.add_argument("--output-len", type=int, default=128, help="new tokens of the decode workloads")
    p.add_argument("--trace", default=None, help="a JSONL trace instead of the workloads above: its requests all "
                                                 "at once, each with its output length")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer", default="vllm", help="the peers, comma-separated: vllm, llama.cpp")
    p.add_argument("--peer-dtype", default="bfloat16,float32",
                   help="vLLM's dtypes to try, comma-separated; the faster counts per workload")
    p.add_argument("--peer-drop", type=float, default=2.0,
                   help="after round 1, stop running a peer setting this many times slower than that peer's "
                        "fastest on a workload (0: run all every round)")
    p.add_argument("--peer-python", default=".venv-peers/bin/python", help="the vLLM venv's Python (make peers)")
    p.add_argument("--peer-model", default=".peers/SmolLM2-135M-Instruct", help="the HF folder make peers writes")
    p.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python",
                   help="the llama.cpp venv's Python (make peers)")
    p.add_argument("--llamacpp-model", default=None,
                   help="the GGUF llama.cpp runs (default: the --model file when it is a GGUF)")
    p.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)  # tests: a stand-in worker script
    p.add_argument("--no-progress", action="store_true")
