"""``pagedllm bench grammar-libs``: xgrammar against llguidance on this CPU, as the engine would use them.

With the engine's tokenizer (the embedded SmolLM2's by default, vocabulary 49,152) it measures,
for each library in a fresh subprocess (so that memory figures are its own):

- the tokenizer info, built once per engine;
- compiling a few JSON schemas and ``json_object`` (cold: no cache), up to a ready matcher and its
  first mask (llguidance builds lazily, so "compiled" means "able to answer the first mask" for
  both);
- one decode step at batch ``--batch``: fill the allowed-token bitmask of every row (the library's
  multi-threaded batch call), apply it to a ``[batch, vocab]`` float32 logits tensor, and accept
  each row's next token. The rows walk real JSON outputs (documents valid for their schema,
  tokenized as the model would write them, then EOS) and restart when done, so every step has
  ``batch`` rows at varied points of their documents. Median and p90 over ``--steps`` steps;
- memory: the process's resident set after importing the library, after the tokenizer info, the
  compiled grammars and the batch of matchers, and its peak.

A library that is not installed is skipped (``pip install --no-deps xgrammar==0.2.8
apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1`` brings both; the engine depends on llguidance).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

LIBRARIES = ("xgrammar", "llguidance")

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "title": {"type": "string", "maxLength": 40},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["id", "title", "price", "in_stock", "tags"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {
                "type": "array",
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 10},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "shipping": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "zip": {"type": "string", "maxLength": 10}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["order_id", "status", "items", "shipping"],
        "additionalProperties": False,
    },
}

_WORDS = ["alpha", "bravo", "cargo", "delta", "echo", "fox", "gamma", "harbor", "indigo", "jet", "kilo", "lima"]


def sample_document(kind: str, rng: random.Random) -> dict:
    """A document valid for ``SCHEMAS[kind]`` (``json_object``: any of them)."""
    if kind == "json_object":
        kind = rng.choice(sorted(SCHEMAS))
    w = lambda: rng.choice(_WORDS)  # noqa: E731
    if kind == "person":
        return {"name": f"{w().title()} {w().title()}", "age": rng.randint(1, 99),
                "role": rng.choice(["admin", "user", "guest"])}
    if kind == "product":
        return {"id": rng.randint(1, 10**6), "title": f"The {w()} {w()} kit", "price": round(rng.uniform(1, 500), 2),
                "in_stock": rng.random() < 0.5, "tags": [w() for _ in range(rng.randint(0, 4))]}
    return {"order_id": f"{rng.choice('ABCXYZ')}{rng.choice('ABCXYZ')}-{rng.randint(1000, 9999)}",
            "status": rng.choice(["pending", "shipped", "delivered", "cancelled"]),
            "items": [{"sku": f"{w()[:6]}{rng.randint(10, 99)}", "qty": rng.randint(1, 9)}
                      for _ in range(rng.randint(1, 5))],
            "shipping": {"city": w().title(), "zip": str(rng.randint(10000, 99999))}}


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


class _XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab = vocab

    def compile(self, kind: str, schema: dict | None):
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def own_apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


class _LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf  # not llguidance.torch: its import compiles a kernel with torch.compile

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = vocab

    def compile(self, kind: str, schema: dict | None):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema if kind != "json_object" else {"type": "object"})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tokenizer, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self, rows: int):
        import torch

        return torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers, bitmask) -> None:  # llguidance.torch.fill_next_token_bitmask_par, without importing it
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    own_apply = None  # llguidance.torch's apply is a torch.compile'd kernel (a C++ build on first use on CPU)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


def measure(lib_name: str, batch: int, steps: int, threads: int, seed: int) -> dict:
    """Everything for one library, in this process."""
    import importlib
    import importlib.metadata

    import torch

    from pagedllm.engine.structured_output import BitmaskApplier
    from pagedllm.models.loader import default_model_path
    from pagedllm.models.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    tok = Tokenizer.load(default_model_path(), is_gguf=True)
    vocab, eos = len(tok.hf), [tok.eos_token_id]
    rss0, _ = _rss_mib()
    t0 = time.perf_counter()
    importlib.import_module(lib_name)
    t_import = time.perf_counter() - t0
    rss_import, _ = _rss_mib()
    t0 = time.perf_counter()
    lib = {"xgrammar": _XGrammar, "llguidance": _LLGuidance}[lib_name](tok.hf, vocab, eos, threads)
    t_info = time.perf_counter() - t0
    rss_info, _ = _rss_mib()
    kinds = [*SCHEMAS, "json_object"]
    compiled, compile_s = {}, {}
    for kind in kinds:
        t0 = time.perf_counter()
        compiled[kind] = lib.compile(kind, SCHEMAS.get(kind))
        m = lib.matcher(compiled[kind])
        lib.fill([m], lib.bitmask(1))
        compile_s[kind] = time.perf_counter() - t0
    rss_compiled, _ = _rss_mib()

    rng = random.Random(seed)
    rows = []
    for i in range(batch):
        kind = kinds[i % len(kinds)]
        docs = [tok.encode(json.dumps(sample_document(kind, rng)), add_special_tokens=False) + eos for _ in range(8)]
        rows.append({"kind": kind, "docs": docs, "doc": i % 8, "pos": (7 * i) % len(docs[i % 8]),
                     "matcher": lib.matcher(compiled[kind])})
    for r in rows:  # start each row part-way into its document, so rows are at varied points
        for t in r["docs"][r["doc"]][:r["pos"]]:
            assert lib.accept(r["matcher"], t)
    bitmask = lib.bitmask(batch)
    applier = BitmaskApplier()
    logits = torch.randn(batch, vocab)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": [], "step": [], "own_apply": []}
    allowed = []
    for step in range(steps + 10):
        t0 = time.perf_counter()
        lib.fill([r["matcher"] for r in rows], bitmask)
        t1 = time.perf_counter()
        applier.apply(logits, bitmask)
        t2 = time.perf_counter()
        for r in rows:
            doc = r["docs"][r["doc"]]
            token = doc[r["pos"]]
            if not lib.accept(r["matcher"], token):
                raise AssertionError(f"{lib_name} rejected token {token} of a valid {r['kind']} document")
            r["pos"] += 1
            if r["pos"] == len(doc):  # the document and its EOS are done: start the next one
                lib.reset(r["matcher"])
                r["doc"], r["pos"] = (r["doc"] + 1) % len(r["docs"]), 0
        t3 = time.perf_counter()
        if step % 16 == 0:
            allowed.append(float(torch.isfinite(logits).sum()) / batch)
        logits.normal_()
        if lib.own_apply is not None:
            t4 = time.perf_counter()
            lib.own_apply(logits, bitmask)
            own = time.perf_counter() - t4
            logits.normal_()
        if step >= 10:  # warm-up steps are not counted
            for key, value in (("fill", t1 - t0), ("apply", t2 - t1), ("accept", t3 - t2), ("step", t3 - t0)):
                times[key].append(value)
            if lib.own_apply is not None:
                times["own_apply"].append(own)
    rss_end, peak = _rss_mib()

    def ms(xs: list[float]) -> dict | None:
        if not xs:
            return None
        xs = sorted(xs)
        return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))]}

    return {
        "library": lib_name, "version": importlib.metadata.version(lib_name), "batch": batch, "steps": steps,
        "threads": threads, "vocab": vocab, "import_s": t_import, "tokenizer_info_s": t_info, "compile_s": compile_s,
        **{key: ms(values) for key, values in times.items()},
        "mean_allowed_tokens_per_row": statistics.mean(allowed),
        "rss_mib": {"import": rss_import - rss0, "tokenizer_info": rss_info - rss_import,
                    "compiled": rss_compiled - rss_info, "matchers_and_steps": rss_end - rss_compiled,
                    "total_added": rss_end - rss0, "peak": peak},
    }


def cpu_description() -> str:
    """``lscpu``'s model name and the AVX-512 / AMX flags of this machine."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    name, flags = "unknown CPU", []
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            name = value.strip()
        elif key.strip() == "Flags":
            flags = [f for f in value.split() if f.startswith(("avx512", "amx"))]
    return f"{name}; {os.cpu_count()} CPUs; flags: {' '.join(flags) or 'no avx512/amx'}"


def _print_report(reports: list[dict], machine: str) -> None:
    print(f"machine: {machine}")
    batch = reports[0]["batch"]

    def row(label: str, cell) -> None:
        print(f"| {label} | " + " | ".join(cell(r) for r in reports) + " |")

    def timing(r: dict, part: str) -> str:
        return "-" if r.get(part) is None else f"{r[part]['median_ms']:.3f} ({r[part]['p90_ms']:.3f})"

    print("| | " + " | ".join(r["library"] + " " + r["version"] for r in reports) + " |")
    print("|---|" + "---:|" * len(reports))
    row("import, s", lambda r: f"{r['import_s']:.2f}")
    row("tokenizer info (once per engine), s", lambda r: f"{r['tokenizer_info_s']:.2f}")
    for k in reports[0]["compile_s"]:
        row(f"compile `{k}` (cold, to first mask), ms", lambda r, k=k: f"{1e3 * r['compile_s'][k]:.1f}")
    row(f"fill bitmask, batch {batch}: median (p90), ms", lambda r: timing(r, "fill"))
    row(f"apply to [{batch}, {reports[0]['vocab']}] float32 (engine's), ms", lambda r: timing(r, "apply"))
    row(f"accept {batch} tokens, ms", lambda r: timing(r, "accept"))
    row("step = fill + apply + accept, ms", lambda r: timing(r, "step"))
    row("the library's own apply kernel, ms", lambda r: timing(r, "own_apply"))
    row("mean allowed tokens per row", lambda r: f"{r['mean_allowed_tokens_per_row']:.0f}")
    for key in ("import", "tokenizer_info", "compiled", "matchers_and_steps", "total_added"):
        row(f"RSS added: {key}, MiB", lambda r, key=key: f"{r['rss_mib'][key]:.1f}")


def main(args) -> dict:
    if getattr(args, "single", None):  # the child process: one library
        report = measure(args.single, args.batch, args.steps, args.threads, args.seed)
        print(json.dumps(report))
        return report
    import importlib.util

    libs = [name for name in LIBRARIES if importlib.util.find_spec(name) is not None]
    for name in sorted(set(LIBRARIES) - set(libs)):
        print(f"{name}: not installed, skipped", file=sys.stderr)
    runs: dict[str, list[dict]] = {name: [] for name in libs}
    for _ in range(args.repeats):  # alternate the libraries, each run in a fresh process
        for name in libs:
            cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "grammar-libs", "--single", name, "--batch",
                   str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads), "--seed",
                   str(args.seed)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{out.stderr}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    # the run with the fastest median step: other processes on a shared machine only slow runs down
    reports = [min(rs, key=lambda r: r["step"]["median_ms"]) for rs in runs.values()]
    machine = cpu_description()
    if reports:
        _print_report(reports, machine)
    result = {"machine": machine, "reports": reports}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench grammar-libs``'s flags."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--repeats", type=int, default=3, help="runs per library (alternating); the fastest is shown")
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)  # one library, in a child process
