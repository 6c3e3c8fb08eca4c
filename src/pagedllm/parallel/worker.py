"""A tensor-parallel worker process (ranks 1..N-1): it loads its shard of the model, allocates its
KV pool (its KV heads, the block count the ranks agree on), then runs each step rank 0 sends:
the KV block moves and the model's forward over its heads (its all-reduces meet the other ranks'),
never sampling. It leaves on a stop message, when rank 0's sockets close, or when the engine's
process is gone (checked every second), so no worker outlives its engine. It ignores Ctrl-C:
rank 0 takes it and stops the workers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import torch

from pagedllm.engine.builder import load_shard
from pagedllm.engine.engine import KVPool
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.parallel.collectives import Collectives
from pagedllm.parallel.handle import START_TIMEOUT_S, RankHandle
from pagedllm.parallel.step_message import StepDecoder


def _exit_with_parent(engine_pid: int) -> None:
    """End this process once the engine's is gone: its parent changed (a fork server's worker is
    re-parented when the server leaves with the engine's process; a spawned one, when the engine's
    process itself ends), or ``engine_pid`` no longer exists."""
    parent_pid = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid or not _exists(engine_pid):
            os._exit(3)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's: a pid reused since
        return False
    return True


def serve_rank(handle: RankHandle, options) -> None:
    """Load this rank's shard and run rank 0's steps until a stop message."""
    shard = load_shard(options, handle)
    pool = KVPool.allocate(shard.config, shard.net.config, shard.backend, handle)
    runner = ModelRunner(shard.net, pool.storage, shard.backend, torch.device(options.device), pool.host)
    decoder = StepDecoder()
    while True:
        message = handle.collectives.broadcast_object(wait_forever=True)
        if message.stop:
            return
        runner.run_model(decoder.decode(message))
        if message.report:
            handle.collectives.all_gather(torch.tensor([len(decoder.tables)]))


def worker_main(options, rank: int, world_size: int, host: str, port: int, engine_pid: int, errors,
                environ: dict[str, str]) -> None:
    """The worker process's entry point (``TensorParallelGroup.start``). ``environ``: the engine
    process's environment when it started the group (a fork server's child would otherwise have the
    server's, from when this process's first group started)."""
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(engine_pid,), daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        serve_rank(RankHandle(Collectives(host, port, rank, world_size, connect_timeout_s=START_TIMEOUT_S)), options)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the process ends
        traceback.print_exc(file=sys.stderr)
        try:
            errors.put((rank, f"{type(exc).__name__}: {exc}"))
            errors.close()
            errors.join_thread()
        finally:
            os._exit(1)
