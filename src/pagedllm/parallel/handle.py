"""What the builder and the engine see of tensor parallelism on any rank (``RankHandle``): its rank
and the world size, its share of the weights (``shard.shard_weights``), the in-place all-reduce
the model calls after its row-parallel projections, and the block count the ranks agree on (the
smallest pool)."""

from __future__ import annotations

import torch

from pagedllm.parallel.collectives import Collectives
from pagedllm.parallel.shard import shard_weights

START_TIMEOUT_S = 600.0  # workers load their shards while rank 0 loads its own: a slow disk or 2 cores


class RankHandle:
    """One rank's view of the group."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size

    def shard(self, weights):
        return shard_weights(weights, self.rank, self.world_size)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_(tensor)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest pool over the ranks (every rank's pool is then that many blocks). The first
        collective after loading: it waits for the slowest rank to load."""
        return self.collectives.min_int(num_blocks, timeout_s=START_TIMEOUT_S)
