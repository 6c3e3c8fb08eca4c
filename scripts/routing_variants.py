"""Prefix-aware routing rules tried in session 41 and not kept, against the shipped one, on the
simulator (docs/cluster.md, "Session 41: the match rate and random ties"): each rule is the shipped
``PrefixAware`` with one change, run through ``pagedllm simulate --replicas`` for seeds 0-4, and the
medians printed (run from the repository's root: the trace's path is relative).

- ``shipped``: a request whose best replica caches under half its full blocks goes to the least
  loaded replica;
- ``short_p2c``: such a request goes by power of two choices instead;
- ``short_idle_holder``: such a request stays on its prefix holder while the holder is as idle as
  the least-loaded replica (a load threshold of 0 for short prefixes), else the least loaded.

    .venv/bin/python scripts/routing_variants.py shipped short_p2c short_idle_holder
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pagedllm.cli import main
from pagedllm.cluster import routing, sim_replicas

WORKLOADS = {
    "chat 1000 x8": "--workload chat --num-requests 1000 --rate 4 --model llama-2-13b --kv-memory 8GiB --replicas 8",
    "chat 400 x8": "--workload chat --num-requests 400 --rate 4 --model llama-2-13b --kv-memory 8GiB --replicas 8",
    "chat 120 x2": "--workload chat --num-requests 120 --rate 2 --model llama-2-7b --kv-memory 4GiB --replicas 2",
    "chat 60 x4": "--workload chat --num-requests 60 --rate 0.5 --model llama-2-7b --kv-memory 4GiB --replicas 4",
    "trace x8": "--trace docs/data/cluster_routing_chat_trace_20261206.jsonl --model llama-2-13b --kv-memory 8GiB "
                "--replicas 8",
}


class Variant(routing.PrefixAware):
    rule = "shipped"

    def choose(self, hashes, replicas):
        matched = [r.prefix_blocks(hashes) for r in replicas]
        best = max(matched)
        short = best > 0 and best / len(hashes) < self.min_match_rate
        if self.rule == "shipped" or best == 0 or not short:
            return super().choose(hashes, replicas)
        self._decided("short_prefix")
        if self.rule == "short_p2c":
            return self.fallback.choose(hashes, replicas)
        holder = self._least_loaded([k for k, m in enumerate(matched) if m == best], replicas)
        least = min(r.load for r in replicas)
        if replicas[holder].load == least and not replicas[holder].saturated:
            return holder
        return self._least_loaded(range(len(replicas)), replicas)


def make_policy(name, seed=0, **settings):
    if name != "prefix-aware":
        return routing.make_policy(name, seed, **settings)
    return Variant(settings.get("load_threshold", routing.DEFAULT_LOAD_THRESHOLD), seed,
                   settings.get("min_match_rate", routing.DEFAULT_MIN_MATCH_RATE))


def run(rule: str, flags: str, seed: int, out: Path) -> dict:
    Variant.rule = rule
    argv = f"simulate {flags} --device a100-80gb --routing prefix-aware --no-progress --seed {seed} --json {out}"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv.split()) == 0
    return json.loads(out.read_text())["results"]["prefix-aware"]


if __name__ == "__main__":
    sim_replicas.make_policy = make_policy
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        for workload, flags in WORKLOADS.items():
            for rule in sys.argv[1:] or ["shipped", "short_p2c", "short_idle_holder"]:
                runs = [run(rule, flags, seed, out) for seed in range(5)]
                p50 = statistics.median(r["ttft_p50_s"] for r in runs) * 1000
                p99 = statistics.median(r["ttft_p99_s"] for r in runs) * 1000
                hit = statistics.median(r["prefix_cache_hit_rate"] for r in runs) * 100
                idle = sum(sum(1 for n in r["requests_per_replica"] if n == 0) for r in runs)
                print(f"{workload:13} {rule:18} hit {hit:5.1f}%  TTFT p50 {p50:4.0f} ms  p99 {p99:5.0f} ms  "
                      f"idle replica-runs {idle}", flush=True)
