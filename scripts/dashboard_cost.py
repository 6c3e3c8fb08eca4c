"""What ``/dashboard/state`` costs the engine thread: ``dashboard_state`` on a full pool.

    .venv/bin/python scripts/dashboard_cost.py [num_blocks ...]     (default: 1456 65536)

Per pool size, a paged manager (block size 16) filled as a busy server's would be: 32 requests of
n = 4 (four tables sharing each block: a quarter of the pool), 64 requests holding blocks of their
own (half), and 32 finished requests whose blocks stay cached (a quarter), plus 64 requests
waiting. Prints the median time of ``dashboard_state`` (on the engine thread) and of its JSON
encoding (on the event loop, not the engine thread), and the same for an idle pool.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from pagedllm.bench.timers import median_ms
from pagedllm.kvcache.block_map import block_map
from pagedllm.kvcache.manager import KVCacheManager
from pagedllm.server.dashboard_state import dashboard_state
from pagedllm.server.metrics import ServerMetrics

BLOCK_SIZE = 16
METRICS = ServerMetrics()  # the page's token counter (zero here)


def busy_manager(num_blocks: int) -> tuple[KVCacheManager, list]:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    per = num_blocks // 128
    tokens = per * BLOCK_SIZE
    requests = []
    for i in range(32):  # n = 4: siblings share every block of the parent
        rid = f"cmpl-{i:04d}-0"
        assert kv.allocate_slots(rid, tokens)
        kv.cache_full_blocks(rid, [i] * tokens, tokens)
        for k in range(1, 4):
            kv.fork(rid, f"cmpl-{i:04d}-0-{k}", tokens)
        requests += [rid] + [f"cmpl-{i:04d}-0-{k}" for k in range(1, 4)]
    for i in range(64):  # one table each
        rid = f"cmpl-{100 + i:04d}-0"
        assert kv.allocate_slots(rid, tokens)
        requests.append(rid)
    for i in range(32):  # finished: blocks cached, evictable
        rid = f"done-{i}"
        assert kv.allocate_slots(rid, tokens)
        kv.cache_full_blocks(rid, [1000 + i] * tokens, tokens)
        kv.free(rid)
    kv.check_invariants()
    return kv, requests


def fake_engine(kv: KVCacheManager, running_ids: list[str], waiting: int = 64) -> SimpleNamespace:
    req = lambda rid: SimpleNamespace(request_id=rid, num_computed_tokens=100, num_tokens=101,
                                      num_prompt_tokens=64, max_tokens=200, status=SimpleNamespace(value="running"))
    sched = SimpleNamespace(running=[req(r) for r in running_ids], waiting=[req(f"w{i}") for i in range(waiting)],
                            swapped=[])
    stats = lambda: {**kv.stats(), "num_steps": 1}  # what Engine.stats() adds that the page reads
    return SimpleNamespace(stats=stats, kv_block_map=lambda: block_map(kv),
                           request_queues=lambda: (sched.running, [*sched.waiting, *sched.swapped]))


def main(sizes: list[int]) -> None:
    for n in sizes:
        kv, running = busy_manager(n)
        engine = fake_engine(kv, running)
        state = dashboard_state(engine, METRICS)
        state_ms = median_ms(lambda e=engine: dashboard_state(e, METRICS), 30, warmup=False)
        json_ms = median_ms(lambda s=state: json.dumps(s), 30, warmup=False)
        print(f"{n:>6} blocks, full ({state['counts']}): state {state_ms:.2f} ms "
              f"on the engine thread, JSON {json_ms:.2f} ms "
              f"({len(json.dumps(state)) / 1024:.0f} KiB) on the event loop")
        idle = fake_engine(KVCacheManager(n, BLOCK_SIZE), [], waiting=0)
        idle_ms = median_ms(lambda e=idle: dashboard_state(e, METRICS), 30, warmup=False)
        print(f"{n:>6} blocks, idle: state {idle_ms:.2f} ms")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1456, 65536])
