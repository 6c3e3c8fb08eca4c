"""``pagedllm bench speculative``: speculative decoding (ngram, suffix) against none, per workload
and batch size, in alternating runs.

Three seeded workloads, each a chat request per prompt, greedy, at most ``--max-tokens`` tokens:

- ``edit``: a passage of English (a Python standard-library docstring, picked by the seed) to be
  repeated with one word replaced: most of the answer is text the prompt already holds;
- ``code``: a standard-library Python function to be written out again with a variable renamed:
  code completion that repeats its context;
- ``random``: a run of random common words to be continued: nothing to copy.

For each batch size B (``--batch-sizes``) B requests start together on an engine of
``max_num_seqs`` B; each method has its own engine (the same options otherwise), and every round
(``--repeats``) runs the methods one after another on fresh prompts (no method sees a prompt, or
its answer, twice: the suffix method's tree of earlier outputs learns only from other texts).
Reported per workload, batch size and method: output tokens/s (tokens over the wall time of the
batch), its ratio to no speculation, TPOT p50/p99 over the requests (time after the first token
over the tokens after it), the acceptance rate and mean accepted length; the median of the rounds.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import statistics
import time

from pagedllm.workloads.text import WORDS

# the texts the edit and code prompts are made of: docstrings and functions of these modules
MODULES = ("json", "argparse", "collections", "textwrap", "shlex", "string", "difflib", "csv", "random",
           "statistics", "fractions", "decimal", "pathlib", "zipfile", "tarfile", "email.message", "http.client",
           "urllib.parse", "logging", "unittest.case", "threading", "queue", "heapq", "bisect", "functools",
           "calendar", "datetime", "configparser", "pprint", "inspect", "ast", "tokenize", "shutil", "tempfile",
           "glob", "fnmatch", "gzip", "base64", "hashlib", "secrets", "uuid", "ipaddress", "smtplib", "ftplib",
           "socketserver", "wave", "mimetypes", "plistlib", "sched", "selectors", "subprocess", "trace", "typing",
           "asyncio.events", "asyncio.streams", "asyncio.tasks", "concurrent.futures._base", "contextlib",
           "dataclasses", "enum", "importlib.abc", "io", "optparse", "gettext", "locale", "codecs", "pickle",
           "shelve", "timeit", "pstats", "pdb", "doctest", "pydoc", "xml.etree.ElementTree", "xml.dom.minidom",
           "email.utils", "email.parser", "http.server", "http.cookiejar", "urllib.request", "mailbox", "netrc",
           "html.parser", "json.decoder", "json.encoder", "multiprocessing.pool", "operator", "weakref",
           "numbers", "copy", "os", "runpy", "tracemalloc", "wsgiref.handlers", "xmlrpc.client", "zipimport")
WORKLOADS = ("edit", "code", "random")


def _corpus() -> tuple[list[str], list[str]]:
    """(docstrings of 400-1,200 characters, function sources of 400-1,500), sorted: seeded picks
    are the same on every run of this Python."""
    docs, codes = set(), set()
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objects = []
        for attr, obj in vars(mod).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            objects.append(obj)
            if inspect.isclass(obj):
                objects += [m for n, m in vars(obj).items() if not n.startswith("_") and inspect.isfunction(m)]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and 400 <= len(doc) <= 1200:
                docs.add(doc)
            if inspect.isfunction(obj):
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 400 <= len(src) <= 1500:
                    codes.add(inspect.cleandoc(src) if src.startswith(" ") else src)
    return sorted(docs), sorted(codes)


def _words(text: str) -> list[str]:
    return sorted({w for w in text.replace("\n", " ").split(" ") if w.isalpha() and len(w) > 4})


def make_prompts(workload: str, count: int, rng: random.Random, pools: dict[str, list[str]]) -> list[list[dict]]:
    """``count`` chat conversations of ``workload``, each text drawn without replacement from ``pools``."""
    out = []
    for _ in range(count):
        if workload == "random":
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(64, 256)))
            out.append([{"role": "user", "content": "Continue this text:\n\n" + text}])
            continue
        pool = pools[workload]
        if not pool:
            raise ValueError(f"the {workload} workload ran out of texts: fewer rounds or batch sizes")
        text = pool.pop(rng.randrange(len(pool)))
        old = rng.choice(_words(text) or ["the"])
        new = rng.choice(WORDS)
        if workload == "edit":
            ask = f"Repeat the following text exactly, but replace the word \"{old}\" with \"{new}\".\n\n{text}"
        else:
            ask = (f"Rewrite this Python function with every \"{old}\" renamed to \"{new}\". Show the whole "
                   f"function.\n\n```python\n{text}```")
        out.append([{"role": "user", "content": ask}])
    return out


def _run(llm, convs, params) -> dict:
    """One batch to completion: output tokens/s, TPOTs, and what speculation did meanwhile."""
    stats = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]

    def delta(key: str) -> float:
        return after.get(key, 0) - stats.get(key, 0)

    drafts, drafted, accepted = (delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens"),
                                 delta("spec_decode_num_accepted_tokens"))
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else 0.0,
            "tpot_p99_ms": 1e3 * _quantile(tpots, 0.99) if tpots else 0.0,
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(args) -> dict:
    from pagedllm import LLM, SamplingParams, cpu_features

    methods = ["none", *[m for m in args.methods.split(",") if m]]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown {w!r} (one of {', '.join(WORKLOADS)})")
    common = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, block_size=args.block_size,
                  kv_cache_memory=args.kv_cache_memory, seed=args.seed)
    spec = {m: None if m == "none" else {"method": m, "num_speculative_tokens": args.num_speculative_tokens}
            for m in methods}
    docs, codes = _corpus()
    rng = random.Random(args.seed)
    pools = {"edit": list(docs), "code": list(codes)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    same_outputs = {}
    for b in batch_sizes:
        llms = {m: LLM(**common, max_num_seqs=b, speculative_config=spec[m]) for m in methods}
        for llm in llms.values():  # first-call costs out of the runs; every engine's prefix cache alike
            llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=4), use_tqdm=False)
        for w in workloads:
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for r in range(args.repeats):
                convs = make_prompts(w, b, rng, pools)
                order = methods if r % 2 == 0 else methods[::-1]  # alternate who goes first
                for m in order:
                    runs[m].append(_run(llms[m], convs, params))
                base_outputs = runs["none"][-1]["outputs"]
                for m in methods[1:]:
                    same_outputs.setdefault((w, b, m), []).append(runs[m][-1]["outputs"] == base_outputs)
            base = statistics.median(x["tok_s"] for x in runs["none"])
            for m in methods:
                xs = runs[m]
                drafted = sum(x["draft_tokens"] for x in xs)
                row = {"workload": w, "batch": b, "method": m,
                       "tok_s": statistics.median(x["tok_s"] for x in xs),
                       "all_tok_s": [round(x["tok_s"], 1) for x in xs],
                       "tpot_p50_ms": statistics.median(x["tpot_p50_ms"] for x in xs),
                       "tpot_p99_ms": statistics.median(x["tpot_p99_ms"] for x in xs),
                       "acceptance_rate": sum(x["accepted_tokens"] for x in xs) / drafted if drafted else 0.0,
                       "mean_accepted_length": (1 + sum(x["accepted_tokens"] for x in xs) /
                                                sum(x["drafts"] for x in xs)) if drafted else 0.0,
                       "identical_outputs": all(same_outputs.get((w, b, m), [True]))}
                row["speedup"] = row["tok_s"] / base
                rows.append(row)
                print(f"{w:6s} batch {b:3d} {m:6s} {row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  "
                      f"TPOT p50 {row['tpot_p50_ms']:.1f} p99 {row['tpot_p99_ms']:.1f} ms  "
                      f"accept {row['acceptance_rate']:.2f}  len {row['mean_accepted_length']:.2f}", flush=True)
        for llm in llms.values():
            llm.shutdown()
        del llms
    cpu = cpu_features.current().describe()
    print(f"\nCPU {cpu}; {args.dtype}, greedy, at most {args.max_tokens} tokens; median of {args.repeats} rounds")
    print("| workload | batch | method | output tok/s | vs none | TPOT p50 / p99 ms | acceptance | mean accepted "
          "length | same tokens |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        spec_cols = ("-", "-") if row["method"] == "none" else (f"{row['acceptance_rate']:.2f}",
                                                               f"{row['mean_accepted_length']:.2f}")
        same = "-" if row["method"] == "none" else ("yes" if row["identical_outputs"] else "no")
        print(f"| {row['workload']} | {row['batch']} | {row['method']} | {row['tok_s']:.1f} | "
              f"{row['speedup']:.2f}x | {row['tpot_p50_ms']:.1f} / {row['tpot_p99_ms']:.1f} | {spec_cols[0]} | "
              f"{spec_cols[1]} | {same} |")
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "cpu": cpu, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench speculative``'s flags."""
    p.add_argument("--methods", default="ngram,suffix", help="comma-separated, each against none")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=2, help="rounds, each on fresh prompts; the median is reported")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=7)
