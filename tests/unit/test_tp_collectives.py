"""The tensor-parallel collectives (gloo over a TCPStore) against known results, over 3 spawned
processes: all-reduce, all-gather, the minimum, and the broadcast of a pickled message."""

from __future__ import annotations

import multiprocessing

import torch

from pagedllm.parallel.collectives import Collectives, free_port


def _rank(rank: int, world: int, port: int, results) -> None:
    c = Collectives("127.0.0.1", port, rank, world)
    summed = c.all_reduce_(torch.arange(4, dtype=torch.float32) * (rank + 1))
    gathered = c.all_gather(torch.tensor([rank * 10, rank * 10 + 1]))
    smallest = c.min_int(100 - 7 * rank)
    message = c.broadcast_object({"step": 3, "ids": [5, 6, rank]} if rank == 0 else None, wait_forever=True)
    big = c.broadcast_object(list(range(100_000)) if rank == 0 else None)
    results.put((rank, summed.tolist(), [g.tolist() for g in gathered], smallest, message, big == list(range(100_000))))


def test_collectives_over_three_processes_give_the_known_results():
    world, port = 3, free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    workers = [ctx.Process(target=_rank, args=(r, world, port, results), daemon=True) for r in range(1, world)]
    for w in workers:
        w.start()
    _rank(0, world, port, results)
    got = sorted(results.get(timeout=60) for _ in range(world))
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    for _, summed, gathered, smallest, message, big in got:
        assert summed == [0.0, 6.0, 12.0, 18.0]  # (1 + 2 + 3) * [0, 1, 2, 3]
        assert gathered == [[0, 1], [10, 11], [20, 21]]
        assert smallest == 86
        assert message == {"step": 3, "ids": [5, 6, 0]}  # rank 0's, on every rank
        assert big
    assert [g[0] for g in got] == [0, 1, 2]
