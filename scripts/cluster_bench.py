"""Prefix-aware against power-of-two (and round-robin) routing on a real cluster: for each policy,
``pagedllm serve --replicas N --routing POLICY`` is started (a local Ray cluster), one multi-turn
chat trace is replayed through it by ``pagedllm bench serve --trace`` (``loadgen/serve_bench.py``),
and the cluster's ``/metrics`` give the prefix-cache hit rate (tokens found / looked up, over every
replica) and the requests each replica served; then the cluster is stopped (SIGINT).

The trace (``chat_trace``): ``--conversations`` conversations starting at ``--rate`` per second,
``--turns`` turns each, a think time apart; every turn's prompt is the shared system prompt, the
conversation so far and a new user message, so a turn extends the previous turn's prompt.

    .venv/bin/python scripts/cluster_bench.py --json docs/data/cluster_routing_<date>.json \\
        --plot docs/plots/cluster_routing.png

One report: per policy, hit rate, TTFT p50/p99, output tokens/s, requests per replica, and the ratios
of prefix-aware to power-of-two; the plot draws hit rate and TTFT p50 side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.config import CacheConfig
from pagedllm.loadgen.serve_bench import ServeBenchConfig, run
from pagedllm.machine import machine_info
from pagedllm.workloads.traces import TraceRequest, write_trace


def chat_trace(conversations: int, turns: int, rate: float, system_len: int, user_len: int, answer_len: int,
               think_s: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(f"cluster-chat-{seed}")
    out, start = [], 0.0
    for c in range(conversations):
        start += rng.expovariate(rate)
        t, history = start, system_len
        for k in range(turns):
            user = max(8, round(rng.gauss(user_len, user_len / 4)))
            out.append(TraceRequest(arrival=round(t, 6), prompt_len=history + user, output_len=answer_len,
                                    prefix_id="system", prefix_len=system_len, conversation=f"c{c}", turn=k))
            history += user + answer_len
            t += think_s * (0.5 + rng.random())
    return sorted(out, key=lambda r: r.arrival)


def hit_rate_ceiling(trace: list[TraceRequest], block_size: int) -> float:
    """The highest prefix-cache hit rate any routing could reach on ``trace``: every turn on its
    conversation's replica with nothing evicted, so its previous turn's prompt is cached (not the
    answer: the replay does not wait for it, and a turn's words after the previous prompt come from
    the conversation's word stream, ``workloads/text.py``), and every other request finds the shared
    system prompt; only full blocks are found, and a prompt's last token is always computed."""
    previous: dict[str, int] = {}
    found = looked_up = 0
    for i, r in enumerate(trace):
        held = previous.get(r.conversation, r.prefix_len if i else 0)
        found += min(held, r.prompt_len - 1) // block_size * block_size
        looked_up += r.prompt_len
        previous[r.conversation] = r.prompt_len
    return found / looked_up


def engine_block_size(engine_args: list[str]) -> int:
    """The replicas' block size: ``--block-size N`` among the serve flags, else the engine's default."""
    for i, a in enumerate(engine_args):
        if a == "--block-size" and i + 1 < len(engine_args):
            return int(engine_args[i + 1])
        if a.startswith("--block-size="):
            return int(a.split("=", 1)[1])
    return CacheConfig().block_size


def metric_sum(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their replica label."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(value)
    return out


def serve(args, routing: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--replicas", str(args.replicas), "--routing", routing,
           "--port", str(port), "--replica-cpus", str(args.replica_cpus), *args.engine_args]
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - read on failure
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    proc.log = log
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the cluster exited:\n{log.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the cluster did not start in 10 minutes")


def one_policy(args, routing: str, trace_path: str, port: int) -> dict:
    proc = serve(args, routing, port)
    try:
        report = run(ServeBenchConfig(base_url=f"http://127.0.0.1:{port}/v1", trace=trace_path, num_warmups=0,
                                      timeout_s=900, progress=True))
        time.sleep(2.5)  # the replicas' next reports carry the last requests
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        router = httpx.get(f"http://127.0.0.1:{port}/cluster", timeout=30).json()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    hits = sum(metric_sum(text, "pagedllm:prefix_cache_hits_total").values())
    queries = sum(metric_sum(text, "pagedllm:prefix_cache_queries_total").values())
    served = metric_sum(text, "pagedllm:request_success_total")
    return {"routing": routing, "hit_rate": hits / queries if queries else None, "prefix_cache_hits": hits,
            "prefix_cache_queries": queries, "requests_per_replica": sorted(served.values(), reverse=True),
            "completed": report["completed"], "failed": report["failed"], "ttft_ms": report["ttft_ms"],
            "tpot_ms": report["tpot_ms"], "output_throughput": report["output_throughput"],
            "duration_s": report["duration_s"], "router_reasons": router.get("reasons", {}),
            "router_decisions": router.get("decisions", [])}


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["routing"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(names, [100 * r["hit_rate"] for r in results], color="#1d4ed8")
    a.set_ylabel("prefix-cache hit rate (%)")
    b.bar(names, [r["ttft_ms"]["p50"] for r in results], color="#ea580c", label="p50")
    b.set_ylabel("TTFT p50 (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routing", default="prefix-aware,power-of-two,round-robin")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--rate", type=float, default=0.5, help="conversations starting per second")
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--user-len", type=int, default=96)
    p.add_argument("--answer-len", type=int, default=24)
    p.add_argument("--think", type=float, default=6.0, help="mean seconds between a conversation's turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8390)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--trace-out", default=None, help="also write the trace here (for `pagedllm simulate --trace`)")
    p.add_argument("engine_args", nargs="*", help="more `pagedllm serve` flags, after --")
    args = p.parse_args()
    trace = chat_trace(args.conversations, args.turns, args.rate, args.system_len, args.user_len, args.answer_len,
                       args.think, args.seed)
    if args.trace_out:
        write_trace(args.trace_out, trace)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = str(Path(tmp) / "chat.jsonl")
        write_trace(trace_path, trace)
        results = [one_policy(args, routing, trace_path, args.port) for routing in args.routing.split(",")]
    by = {r["routing"]: r for r in results}
    summary = {"hit_rate_ceiling": hit_rate_ceiling(trace, engine_block_size(args.engine_args))}
    if "prefix-aware" in by and "power-of-two" in by:
        pa, p2 = by["prefix-aware"], by["power-of-two"]
        summary.update(hit_rate_ratio=pa["hit_rate"] / p2["hit_rate"] if p2["hit_rate"] else None,
                       ttft_p50_ratio=p2["ttft_ms"]["p50"] / pa["ttft_ms"]["p50"])
    for r in results:
        print(f"{r['routing']:>13}: hit rate {100 * r['hit_rate']:.1f}%, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
              f"p99 {r['ttft_ms']['p99']:.0f} ms, {r['output_throughput']:.1f} output tok/s, "
              f"requests per replica {[int(x) for x in r['requests_per_replica']]}, failed {r['failed']}")
    print(f"the trace's hit-rate ceiling (every turn where its previous turn is cached, nothing evicted): "
          f"{100 * summary['hit_rate_ceiling']:.1f}%")
    if "hit_rate_ratio" in summary:
        print(f"prefix-aware vs power-of-two: hit rate x{summary['hit_rate_ratio']:.2f}, "
              f"TTFT p50 {summary['ttft_p50_ratio']:.2f}x lower")
    out = {"args": vars(args), "requests": len(trace), "machine": machine_info(), "results": results,
           "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.plot:
        cpu = out["machine"].get("cpu", "this machine")
        plot(results, args.plot, f"{args.replicas} replicas, chat trace ({len(trace)} requests), {cpu}")


if __name__ == "__main__":
    main()
