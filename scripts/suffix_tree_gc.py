"""The cost of a full garbage collection beside a large suffix tree (docs/speculative.md).

Builds the global tree of ``--outputs`` random outputs of ``--length`` tokens at ``--depth``, then
times ``gc.collect()`` (median of ``--repeats``). With a Python object per node (before 9931e8b)
every full collection walked the nodes; the flat arrays of ints are not tracked by the collector.
Run: ``.venv/bin/python scripts/suffix_tree_gc.py``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from pagedllm.engine.speculative.suffix import SuffixTree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", type=int, default=300)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = random.Random(0)
    tree = SuffixTree(args.depth)
    outputs = [[rng.randrange(args.vocab) for _ in range(args.length)] for _ in range(args.outputs)]
    t0 = time.perf_counter()
    for out in outputs:
        tree.add(out)
    add_ms = (time.perf_counter() - t0) / args.outputs * 1e3
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    print(f"{tree.num_nodes} nodes; add {add_ms:.2f} ms per output; full collection "
          f"{statistics.median(times) * 1e3:.1f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
