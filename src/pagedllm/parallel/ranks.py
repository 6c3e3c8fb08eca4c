"""Rank 0 of a tensor-parallel engine: what the builder and the engine see of the group.

``TensorParallelGroup`` is rank 0's ``RankHandle`` (``handle.py``) plus the worker processes: it
spawns them, sends each step's message (``make_runner``: a ``ModelRunner`` that broadcasts before
it runs), watches that they live, and stops them.

Invariants: every rank runs the same collectives in the same order (the message first, then two
all-reduces per layer); a failed step or a dead worker is fatal (``failure`` says which rank),
and ``stop`` leaves no process behind (a stop message, then terminate, then kill).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time

import torch

from pagedllm.engine.model_runner import ModelRunner, StepResult
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.parallel.collectives import Collectives, free_port
from pagedllm.parallel.handle import START_TIMEOUT_S, RankHandle
from pagedllm.parallel.step_message import StepEncoder, StepMessage
from pagedllm.parallel.worker import worker_main

log = logging.getLogger(__name__)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each step's message goes to the workers, then rank 0 runs its own shard
    (the all-reduces meet the workers' inside the model) and samples."""

    def __init__(self, group: TensorParallelGroup, *args) -> None:
        super().__init__(*args)
        self.group = group
        self.encoder = StepEncoder()

    def execute(self, out, requests, grammar=None) -> StepResult:
        self.group.send(self.encoder.encode(out, requests.keys()))
        return super().execute(out, requests, grammar)

    def block_tables_held(self, requests) -> list[int]:
        """How many block tables each rank holds once the requests not in ``requests`` (the
        scheduler's live ones) are released: rank 0's copy of what it sent, then each worker's."""
        message = self.encoder.encode(SchedulerOutput(), requests.keys())
        message.report = True
        self.group.send(message)
        return [int(t.item()) for t in self.group.collectives.all_gather(torch.tensor([len(self.encoder.tables)]))]


class TensorParallelGroup(RankHandle):
    """Rank 0 and the worker processes of ranks 1..N-1 (started by ``start``)."""

    def __init__(self, collectives: Collectives, processes: list, errors) -> None:
        super().__init__(collectives)
        self.processes = processes  # rank i + 1's process at i
        self._errors = errors
        self.failure: str | None = None  # why the group cannot go on (a worker died), once known
        self._stopped = False
        self._watch = threading.Thread(target=self._watch_workers, name="pagedllm-tp-watch", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, options, world_size: int, host: str = "127.0.0.1") -> TensorParallelGroup:
        """Spawn ranks 1..N-1 (each loads its own shard; ``parallel/worker.py``) and meet them as rank 0."""
        port = free_port(host)
        ctx = worker_context()
        errors = ctx.Queue()
        environ = dict(os.environ)
        processes = [ctx.Process(target=worker_main,
                                 args=(options, rank, world_size, host, port, os.getpid(), errors, environ),
                                 name=f"pagedllm-tp-rank{rank}", daemon=True) for rank in range(1, world_size)]
        for p in processes:
            p.start()
        try:
            collectives = Collectives(host, port, 0, world_size, connect_timeout_s=START_TIMEOUT_S)
        except BaseException:
            _end(processes)
            raise
        return cls(collectives, processes, errors)

    def make_runner(self, *args) -> TensorParallelRunner:
        return TensorParallelRunner(self, *args)

    def send(self, message: StepMessage) -> None:
        """Broadcast one step's message (after checking that every worker lives)."""
        self.check()
        self.collectives.broadcast_object(message)

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the rank if a worker has died."""
        if self.failure is None:
            self._look()
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def explain(self, exc: BaseException) -> str:
        """Why a step failed: a worker that has died (given a moment to be seen dead: its sockets
        close before its exit is reaped), named by rank; else the exception itself."""
        deadline = time.monotonic() + 2.0
        while self.failure is None and time.monotonic() < deadline:
            self._look()
            if self.failure is None:
                time.sleep(0.05)
        return self.failure or f"the model step failed: {type(exc).__name__}: {exc}"

    def _look(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive() and self.failure is None and not self._stopped:
                why = ""
                with contextlib.suppress(Exception):
                    while not self._errors.empty():
                        r, text = self._errors.get_nowait()
                        why = f": {text}" if r == rank else why
                self.failure = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}{why}"
                log.error("%s", self.failure)

    def _watch_workers(self) -> None:
        while not self._stopped and self.failure is None:
            self._look()
            time.sleep(0.5)

    def stop(self, graceful: bool = True) -> None:
        """End the workers: a stop message (``graceful``, when they are all alive and in step), then
        terminate and kill whatever still runs. Idempotent."""
        if self._stopped:
            return
        if graceful and self.failure is None and all(p.is_alive() for p in self.processes):
            with contextlib.suppress(Exception):
                self.collectives.broadcast_object(StepMessage(stop=True))
        self._stopped = True
        _end(self.processes)


def worker_context():
    """Where the workers come from: a fork server (``multiprocessing``'s ``forkserver``) that
    imported the worker's modules once, so each group after this process's first starts its workers
    by a fork, not a fresh interpreter importing torch (about 2 s each on a 2-core CPU). The server
    is a clean process started by exec, never a fork of this one: no thread, lock or device state of
    the engine's process is inherited. Where there is no fork server (not on Linux or macOS), spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pagedllm.parallel.worker"])
    return ctx


def _end(processes: list, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)

