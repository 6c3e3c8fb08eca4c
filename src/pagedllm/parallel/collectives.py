"""The ranks' process group: torch.distributed's gloo backend over a ``TCPStore``, never a
home-made transport.

``Collectives`` holds one ``ProcessGroupGloo`` object (not the process-global default group, so a
process may hold several engines one after another, and tests may run one beside another). Every
collective is blocking and bounded by the group's timeout (``TP_TIMEOUT_S``), except the wait of
an idle worker for rank 0's next step (``broadcast_object(..., wait_forever=True)``): rank 0 may sit
idle for hours, and a dead rank 0 closes its sockets, which ends that wait at once.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket

import torch
import torch.distributed as dist

TP_TIMEOUT_S = 30.0  # a collective that waits longer for a rank fails (a dead or stuck worker)
_FOREVER = datetime.timedelta(days=365)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the rendezvous of the ranks started on this machine)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Collectives:
    """Rank ``rank`` of ``world_size`` ranks that met at ``host:port`` (rank 0 hosts the store)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = TP_TIMEOUT_S,
                 connect_timeout_s: float = TP_TIMEOUT_S) -> None:
        """``timeout_s`` bounds each collective; ``connect_timeout_s`` the wait for every rank to meet."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                   timeout=datetime.timedelta(seconds=connect_timeout_s), wait_for_workers=True)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, datetime.timedelta(seconds=timeout_s))

    @classmethod
    def from_env(cls, connect_timeout_s: float = TP_TIMEOUT_S) -> Collectives:
        """torchrun's variables: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE."""
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
        if missing:
            raise RuntimeError(f"a torchrun-style launch needs {', '.join(missing)} in the environment")
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                   int(os.environ["WORLD_SIZE"]), connect_timeout_s=connect_timeout_s)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (every rank gets the sum); returns it."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on each), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([out], [tensor]).wait()
        return out

    def min_int(self, value: int, timeout_s: float | None = None) -> int:
        """The smallest of the ranks' ``value`` (``timeout_s``: this wait's bound, else the group's)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        if timeout_s is not None:
            opts.timeout = datetime.timedelta(seconds=timeout_s)
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj=None, wait_forever: bool = False):
        """Rank 0's ``obj`` (pickled), returned on every rank (others pass None). ``wait_forever``:
        no timeout on the wait (an idle worker waiting for the next step)."""
        size = torch.tensor([0], dtype=torch.int64)
        if self.rank == 0:
            data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            payload = torch.frombuffer(data, dtype=torch.uint8)
            size[0] = payload.numel()
        self._broadcast(size, _FOREVER if wait_forever else None)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload, None)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout is not None:
            opts.timeout = timeout
        self.group.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1))
