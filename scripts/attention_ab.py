"""Two builds of the CPU attention extension, A and B, timed in one process on the same inputs.

    python scripts/attention_ab.py A.so B.so 64x128,64x512 [prefill]

Each build is loaded from its own copy of the .so and the two are called alternately (ABBA...),
so the machine's drift lands on both; outputs must be identical. Prints median ms and B/A.
(SmolLM2's heads, block 16, bf16, random K/V in shuffled blocks: ``bench attention``'s cases.)
"""

import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.attention.random_case import random_paged_case


def load(path: str, folder: Path):
    folder.mkdir()
    copy = folder / "_paged_attention_cpu.so"
    shutil.copy(path, copy)
    spec = importlib.util.spec_from_file_location("_paged_attention_cpu", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    a, b = load(sys.argv[1], tmp / "A"), load(sys.argv[2], tmp / "B")
    prefill = len(sys.argv) > 4 and sys.argv[4] == "prefill"
    gen = torch.Generator().manual_seed(0)
    for case in sys.argv[3].split(","):
        batch, ctx = (int(x) for x in case.split("x"))
        q, kv, meta, *_ = random_paged_case(batch, ctx, 16, torch.bfloat16, gen, "cpu", prefill=prefill)
        args = (q, kv.tensors, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
        assert torch.equal(a.paged_attention(*args), b.paged_attention(*args)), "the builds' outputs differ"
        times = {"A": [], "B": []}
        for i in range(6 if prefill else 40):
            for name, m in ((("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a))):
                t0 = time.perf_counter()
                m.paged_attention(*args)
                times[name].append(time.perf_counter() - t0)
        ma, mb = (statistics.median(times[k]) * 1e3 for k in "AB")
        print(f"{case}{' prefill' if prefill else ''}: A {ma:.3f} ms  B {mb:.3f} ms  B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
