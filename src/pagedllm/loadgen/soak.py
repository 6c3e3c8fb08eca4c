"""``pagedllm bench soak``: a bounded soak of a running server under mixed hostile load (issue 21).

``clients`` concurrent loopback clients send, for ``duration_s``, a mix of valid greedy requests
(plain and streamed; each answer must equal the one the idle server gave for that prompt),
invalid ones (each must be a 400), streams cancelled after their first chunk, prompts over the
context (400) and connections dropped mid-request; every ``kill_every_s`` seconds every client
is killed at once (its connections dropped, whatever they were doing) and restarted. Meanwhile
``/health`` is polled and the server process's RSS sampled.

The report: requests by kind, wrong answers, unexpected statuses, health failures (engine
deaths), KV blocks not free once the server is idle again (leaks), and RSS after the warm-up
(the first ``warmup_s``) and at the end. Invariant checked by its test: all of those are 0 and the
RSS growth after the warm-up stays under 50 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "The quick brown fox",
           "In the beginning", "Water boils at", "A list of colours: red,", "Dear Sir or Madam,"]
INVALID = [{"temperature": -1}, {"max_tokens": True}, {"top_k": 2**63}, {"cache_salt": "\ud800"},
           {"n": 0}, {"logprobs": 99}, {"stop": ["x"] * 1000}, {"model": "nope"}, {"prompt": []}]
KINDS = ("valid", "valid_stream", "invalid", "cancelled", "oversized", "dropped")
WEIGHTS = (30, 15, 20, 15, 10, 10)


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^pagedllm:{name} (\S+)$", text, re.M).group(1))


class Soak:
    def __init__(self, base_url: str, model: str, max_model_len: int, expected: dict[str, str], seed: int) -> None:
        self.base_url, self.model, self.max_model_len, self.expected = base_url, model, max_model_len, expected
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.wrong: list[str] = []
        self.unexpected: list[str] = []

    def body(self, prompt: str, **extra) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        prompt = self.rng.choice(PROMPTS)
        if kind == "valid":
            r = await client.post("/v1/completions", json=self.body(prompt))
            self.check(kind, r.status_code, 200, r.text)
            if r.status_code == 200 and r.json()["choices"][0]["text"] != self.expected[prompt]:
                self.wrong.append(f"{prompt!r}: {r.json()['choices'][0]['text']!r}")
        elif kind == "valid_stream":
            text = ""
            async with client.stream("POST", "/v1/completions", json=self.body(prompt, stream=True)) as r:
                self.check(kind, r.status_code, 200, "")
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c["text"] for c in json.loads(line[6:]).get("choices", []))
            if r.status_code == 200 and text != self.expected[prompt]:
                self.wrong.append(f"stream {prompt!r}: {text!r}")
        elif kind == "invalid":
            bad = {**self.body(prompt), **self.rng.choice(INVALID)}
            r = await client.post("/v1/completions", content=json.dumps(bad),
                                  headers={"content-type": "application/json"})
            self.check(kind, r.status_code, (400, 404), r.text)
        elif kind == "cancelled":
            async with client.stream("POST", "/v1/completions",
                                     json=self.body(prompt, stream=True, max_tokens=64, ignore_eos=True)) as r:
                async for _ in r.aiter_lines():
                    break  # hang up after the first line
        elif kind == "oversized":
            ids = [self.rng.randrange(100, 1000) for _ in range(self.max_model_len + 1)]
            r = await client.post("/v1/completions", json={**self.body(""), "prompt": ids})
            self.check(kind, r.status_code, 400, r.text)
        else:  # dropped: half a request, then the connection closes
            await asyncio.to_thread(self.drop)
        self.counts[kind] += 1

    def drop(self) -> None:
        host, port = self.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n{\"prompt\": \"half")

    def check(self, kind: str, status: int, want, text: str) -> None:
        if status not in (want if isinstance(want, tuple) else (want,)):
            self.unexpected.append(f"{kind}: {status} {text[:200]}")


async def _soak(base_url: str, server_pid: int | None, duration_s: float, clients: int, kill_every_s: float,
                warmup_s: float, seed: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as admin:
        models = (await admin.get("/v1/models")).json()["data"][0]
        expected = {}
        for p in PROMPTS:  # the idle server's greedy answers
            r = await admin.post("/v1/completions", json={"model": models["id"], "prompt": p, "max_tokens": 8,
                                                          "temperature": 0})
            expected[p] = r.json()["choices"][0]["text"]
        soak = Soak(base_url, models["id"], models["max_model_len"], expected, seed)
        health_failures: list[str] = []
        rss: list[tuple[float, int]] = []
        start = time.monotonic()
        kills = 0

        async def client_loop(client: httpx.AsyncClient) -> None:
            while time.monotonic() - start < duration_s:
                await soak.one(client)

        async def monitor() -> None:
            while time.monotonic() - start < duration_s:
                r = await admin.get("/health")
                if r.status_code != 200:
                    health_failures.append(f"{r.status_code} {r.text[:200]}")
                if server_pid is not None:
                    rss.append((time.monotonic() - start, rss_bytes(server_pid)))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(monitor())
        while time.monotonic() - start < duration_s:
            limits = httpx.Limits(max_connections=clients * 2)
            async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
                tasks = [asyncio.create_task(client_loop(client)) for _ in range(clients)]
                left = duration_s - (time.monotonic() - start)
                done, pending = await asyncio.wait(tasks, timeout=max(0.0, min(kill_every_s, left)))
                for t in pending:  # the kill: every client at once, mid-request
                    t.cancel()
                for t in pending:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
                kills += bool(pending)
                for t in done:
                    if t.exception() is not None:
                        soak.unexpected.append(f"client error: {t.exception()!r}")
        await watcher
        # idle again: nothing running or waiting, and every block free (cached ones count as free)
        deadline = time.monotonic() + 60
        while True:
            text = (await admin.get("/metrics")).text
            idle = _metric(text, "num_requests_running") == 0 and _metric(text, "num_requests_waiting") == 0
            leaked = int(_metric(text, "num_blocks") - _metric(text, "num_free_blocks"))
            if (idle and leaked == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        final = await admin.get("/health")
    after_warmup = next((b for t, b in rss if t >= warmup_s), None)
    end_rss = rss_bytes(server_pid) if server_pid is not None else None
    return {"duration_s": duration_s, "clients": clients, "kill_every_s": kill_every_s, "kills": kills,
            "requests": dict(soak.counts), "wrong": soak.wrong, "unexpected": soak.unexpected,
            "health_failures": health_failures, "healthy_after": final.status_code == 200, "idle": idle,
            "leaked_blocks": leaked, "rss_after_warmup_mb": None if after_warmup is None else after_warmup / 2**20,
            "rss_end_mb": None if end_rss is None else end_rss / 2**20,
            "rss_growth_mb": None if after_warmup is None or end_rss is None else (end_rss - after_warmup) / 2**20}


def run_soak(base_url: str, server_pid: int | None = None, duration_s: float = 600.0, clients: int = 32,
             kill_every_s: float = 3.0, warmup_s: float | None = None, seed: int = 0) -> dict:
    """Soak the server at ``base_url`` (``http://host:port``); see the module docstring."""
    warmup = warmup_s if warmup_s is not None else min(60.0, duration_s / 5)
    return asyncio.run(_soak(base_url.rstrip("/").removesuffix("/v1"), server_pid, duration_s, clients,
                             kill_every_s, warmup, seed))


def main(args) -> None:
    report = run_soak(args.base_url, args.server_pid, args.duration, args.clients, args.kill_every, seed=args.seed)
    print(json.dumps({k: v for k, v in report.items() if k not in ("wrong", "unexpected", "health_failures")}))
    for key in ("wrong", "unexpected", "health_failures"):
        print(f"{key}: {len(report[key])}" + "".join(f"\n  {x}" for x in report[key][:10]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm bench soak``'s flags."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--server-pid", type=int, default=None, help="sample this local process's RSS")
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 10 minutes)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--kill-every", type=float, default=3.0, help="seconds between kills of every client")
