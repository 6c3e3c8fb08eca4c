"""``pagedllm bench peers``: pagedllm against vLLM's own CPU build, offline, on the same prompts.

Workloads (each run gets fresh seeded random token-id prompts, the same for both engines, so no
prefix-cache hits): *decode* ``C`` concurrent requests of ``--input-len`` prompt tokens and
``--output-len`` new tokens (greedy, EOS ignored), reported as output tokens/s end to end; and
*prefill* ``N x L``: N prompts of L tokens with ``max_tokens=1``, reported as prompt tokens/s.

pagedllm runs in this process (one ``LLM``); vLLM runs in one long-lived worker under the peer
venv's Python (``bench/peer_vllm_worker.py``, from ``make peers``), so its start-up compile happens
once and only warm runs count. Between its jobs the worker's process group is paused (SIGSTOP),
so an idle vLLM takes no CPU from pagedllm's runs. Each engine first runs one untimed warm-up job; then for every
round and workload the two run back to back (pagedllm, then vLLM), and the report gives medians
over rounds and the ratio pagedllm / vLLM of the medians. Without the peer venv the vLLM part is
skipped with a message saying how to get it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.machine import machine_info, machine_steal_seconds

WORKER = Path(__file__).with_name("peer_vllm_worker.py")
PEER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


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
        from pagedllm.bench.traces import prompt_token_ids

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


class PeerWorker:
    """The vLLM worker process: one JSON job per line in, one result per line out."""

    def __init__(self, python: str, model: str, dtype: str, max_num_seqs: int, worker: Path = WORKER,
                 timeout_s: float = 1800.0) -> None:
        env = {**os.environ, **PEER_ENV}
        iomp = sorted(Path(python).resolve().parent.parent.glob("lib/libiomp5.so"))
        if iomp:
            env["LD_PRELOAD"] = str(iomp[0])  # vLLM's CPU build expects Intel's OpenMP preloaded
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-peer-vllm-{os.getpid()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen([python, str(worker), model, dtype, str(max_num_seqs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)  # its own process group, to pause it whole
        self.timeout_s = timeout_s
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"the vLLM worker did not start: {ready}")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """Pause (SIGSTOP) or resume (SIGCONT) the worker and the engine processes it spawned: a
        paused peer takes no CPU while pagedllm runs (its OpenMP threads and engine loop may
        spin or poll when idle), so each engine has the cores to itself during its own runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"the vLLM worker exited with {self.proc.returncode}; its log: {self.log.name}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: int | list[int]) -> dict:
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            self._signal(signal.SIGSTOP)

    def close(self, graceful: bool = True) -> None:
        """Let the worker exit (its stdin closed) or, when not ``graceful`` or when it does not exit
        within a minute, kill its whole process group: vLLM's engine processes must not outlive
        the benchmark (left behind, they would compete with the next run)."""
        if self.proc.poll() is None and graceful:
            self._signal(signal.SIGCONT)
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group outlives its leader: kill what is left
        self.proc.wait()
        self.log.close()


class _Terminated(Exception):
    """SIGTERM while the peer runs: unwinds to the ``finally`` that kills the peer's process group."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def run_pagedllm(llm, prompts: list[list[int]], max_tokens: int | list[int]) -> dict:
    from pagedllm import SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}


def rate(result: dict, workload: Workload) -> float:
    """Prompt tokens/s for a prefill workload, output tokens/s for a decode one."""
    tokens = result["prompt_tokens"] if workload.is_prefill else result["output_tokens"]
    return tokens / result["seconds"]


def main(args) -> dict:
    from tqdm import tqdm

    from pagedllm import LLM

    if args.trace:  # the trace alone; at most 256 sequences at once (vLLM's default), the same for both
        from pagedllm.bench.traces import read_trace

        trace = read_trace(args.trace)
        workloads, max_num_seqs = [], min(256, max(64, len(trace)))
    else:
        workloads = parse_workloads(args.concurrency, args.prefill, args.input_len, args.output_len)
        max_num_seqs = max(64, *(w.num_prompts for w in workloads))
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
              quantization=args.quantization, max_num_seqs=max_num_seqs)
    vocab = llm.engine.config.model.vocab_size
    if args.trace:
        tokenizer = llm.get_tokenizer()
        workloads = [TraceWorkload.from_trace(f"trace {Path(args.trace).name}", trace, vocab,
                                              tokenizer.encode if tokenizer is not None else None)]
    peer, skipped = None, None
    if not Path(args.peer_python).exists():
        skipped = f"vLLM part skipped: {args.peer_python} not found (run `make peers` to install vLLM's CPU build)"
    elif not Path(args.peer_model).exists():
        skipped = f"vLLM part skipped: {args.peer_model} not found (run `make peers` to write the HF folder)"
    else:
        print(f"starting vLLM's offline engine ({args.peer_python}); its first start compiles for minutes",
              file=sys.stderr)
        peer = PeerWorker(args.peer_python, args.peer_model, args.dtype, max_num_seqs,
                          Path(args.peer_worker) if args.peer_worker else WORKER)
    if skipped:
        print(skipped, file=sys.stderr)
    runs: dict[str, dict[str, list]] = {w.name: {"pagedllm": [], "vllm": []} for w in workloads}
    # `kill` (SIGTERM) would otherwise end this process at once and leave the peer's group running
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if peer else None
    graceful = True
    try:
        engines = {"pagedllm": lambda prompts, max_tokens: run_pagedllm(llm, prompts, max_tokens)}
        if peer:
            engines["vllm"] = peer.run
        warm = Workload("warm-up", 2, 16, 4).prompts(vocab, f"{args.seed}:warm-up")
        for engine in engines.values():
            engine(warm, 4)
        with tqdm(total=args.rounds * len(workloads), desc="bench peers", disable=args.no_progress,
                  file=sys.stderr) as bar:
            for round_ in range(args.rounds):
                for w in workloads:
                    prompts = w.prompts(vocab, f"{args.seed}:{w.name}:{round_}")
                    for name, engine in engines.items():
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
                    bar.update(1)
    except _Terminated:
        graceful = False
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        if peer:
            peer.close(graceful)
            signal.signal(signal.SIGTERM, previous_sigterm)
    report = {"settings": {"dtype": args.dtype, "quantization": llm.engine.config.quantization,
                           "rounds": args.rounds, "input_len": args.input_len, "output_len": args.output_len,
                           "max_num_seqs": max_num_seqs, "peer_python": args.peer_python,
                           "peer_model": args.peer_model, "seed": args.seed, "trace": args.trace},
              "machine": machine_info(), "vllm_skipped": skipped, "workloads": []}
    for w in workloads:
        ours = [r["tokens_per_s"] for r in runs[w.name]["pagedllm"]]
        theirs = [r["tokens_per_s"] for r in runs[w.name]["vllm"]]
        row = {"name": w.name, "unit": "prompt tok/s" if w.is_prefill else "output tok/s",
               "pagedllm": statistics.median(ours), "pagedllm_runs": ours,
               "vllm": statistics.median(theirs) if theirs else None, "vllm_runs": theirs,
               "runs": runs[w.name]}
        row["ratio"] = row["pagedllm"] / row["vllm"] if theirs else None
        report["workloads"].append(row)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def format_report(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [f"{m['cpu']}, {m['cores']} cores, {' '.join(m['flags']) or 'no avx512/amx'}; {s['dtype']}, "
             f"medians of {s['rounds']} alternating rounds",
             "| workload | unit | pagedllm | vLLM | pagedllm / vLLM |", "|---|---|---:|---:|---:|"]
    for row in report["workloads"]:
        vllm = "-" if row["vllm"] is None else f"{row['vllm']:.1f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['name']} | {row['unit']} | {row['pagedllm']:.1f} | {vllm} | {ratio} |")
    if report["vllm_skipped"]:
        lines.append(report["vllm_skipped"])
    return "\n".join(lines)
