"""A burst of one-token completions through ``pagedllm serve --replicas 2`` (the tiny random Llama of
tests/cluster/test_ray_serve.py), optionally with busy loops taking the cores: how many requests'
routing decisions never appear in the ingress's ``/cluster``, and how many requests the router still
counts in flight on each replica once every answer is back (both should be 0).

    .venv/bin/python scripts/router_burst.py --requests 600 --concurrency 16 --busy 2

Session 40 (docs/benchmarks.md, "The suite's time") ran it at the code before the router fix from a
worktree (``git worktree add /tmp/base 805b4cc``, then ``PYTHONPATH=/tmp/base/src:/tmp/base`` with
``cd /tmp/base``) and after it, alternating.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path.cwd()))  # the tests' helpers, from the checkout this runs in

from tests.conftest import make_tiny_checkpoint  # noqa: E402
from tests.server.conftest import ServerProcess  # noqa: E402


def busy_loop(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the cluster")
    args = p.parse_args()
    folder = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama", seed=2, with_tokenizer=True)
    ray_dir = tempfile.mkdtemp(prefix="pgr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    server = ServerProcess("--replicas", "2", "--replica-cpus", "0.5", "--routing-load-threshold", "1",
                           "--model", folder, "--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "8",
                           "--max-num-seqs", "4", "--served-model-name", "tiny", env={"RAY_TMPDIR": ray_dir},
                           timeout=240)
    stop = multiprocessing.Event()
    loops = [multiprocessing.Process(target=busy_loop, args=(stop,)) for _ in range(args.busy)]
    for loop in loops:
        loop.start()
    try:
        def answered(i: int) -> str:
            r = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": f"tell me {i} " * 6, "max_tokens": 1})
            r.raise_for_status()
            return r.json()["id"] + "-0"

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            ids = list(pool.map(answered, range(args.requests)))
        time.sleep(3)  # Ray's late callbacks
        view = httpx.get(server.url + "/cluster", timeout=30).json()
        logged = {d["request_id"] for d in view["decisions"]}
        print(f"requests {args.requests}, concurrency {args.concurrency}, busy loops {args.busy}: "
              f"decisions lost {sum(rid not in logged for rid in ids)}, still in flight "
              f"{[r['in_flight'] for r in view['replicas']]}, reasons {view['reasons']}", flush=True)
    finally:
        stop.set()
        for loop in loops:
            loop.join()
        server.stop(signal.SIGINT, timeout=60)


if __name__ == "__main__":
    main()
