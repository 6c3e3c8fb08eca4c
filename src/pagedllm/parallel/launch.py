"""``build_engine`` for any ``tensor_parallel_size``: one rank builds as ``engine.builder`` does;
N ranks check the model divides (before any process starts), spawn the workers, build rank 0's
engine around its shard, and tie the workers' lifetime to the engine's (``Engine.shutdown``, or
the engine collected, or the interpreter's exit: whichever comes first stops them).

Several machines (torchrun-style): every rank but 0 runs ``pagedllm tp-worker`` (``run_worker``)
with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set; rank 0 builds its engine with
``tensor_parallel_size=WORLD_SIZE`` and the same variables (see docs/tensor_parallel.md).
"""

from __future__ import annotations

import os
import weakref

from pagedllm.config import EngineOptions
from pagedllm.engine import builder
from pagedllm.engine.engine import Engine
from pagedllm.errors import ConfigError
from pagedllm.models.loader import load_weights, resolve_model_path
from pagedllm.parallel.collectives import Collectives
from pagedllm.parallel.handle import START_TIMEOUT_S, RankHandle
from pagedllm.parallel.ranks import TensorParallelGroup
from pagedllm.parallel.shard import check_tensor_parallel


def build_engine(options: EngineOptions | None = None, **overrides) -> Engine:
    """Load a model and build an engine, over ``tensor_parallel_size`` ranks (``builder.build_engine``'s
    options); a bad option raises ``ConfigError`` before any worker starts."""
    options = builder.resolve_options(options, overrides)
    world = options.tensor_parallel_size
    if world == 1:
        return builder.build_engine(options)
    weights = load_weights(resolve_model_path(options.model))
    check_tensor_parallel(weights.config, world, options.device)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:  # launched torchrun-style: the workers exist
        if os.environ["RANK"] != "0" or os.environ.get("WORLD_SIZE") != str(world):
            raise ConfigError(f"a torchrun-style rank 0 needs RANK=0 and WORLD_SIZE={world} (tensor_parallel_size), "
                              f"got RANK={os.environ['RANK']} WORLD_SIZE={os.environ.get('WORLD_SIZE')}; the "
                              f"other ranks run `pagedllm tp-worker`")
        group = TensorParallelGroup(Collectives.from_env(connect_timeout_s=START_TIMEOUT_S), [], None)
    else:
        group = TensorParallelGroup.start(options, world)
    try:
        engine = builder.build_engine(options, tensor_parallel=group, weights=weights)
    except BaseException:
        group.stop(graceful=False)
        raise
    weakref.finalize(engine, group.stop)  # also runs at interpreter exit while the engine lives
    return engine


def run_worker(options: EngineOptions) -> None:
    """A torchrun-style worker (RANK > 0): meet rank 0 at MASTER_ADDR:MASTER_PORT and serve its steps
    until it stops. ``options`` must equal rank 0's."""
    from pagedllm.parallel.worker import serve_rank

    serve_rank(RankHandle(Collectives.from_env(connect_timeout_s=START_TIMEOUT_S)), options)


def add_cli_args(p) -> None:
    """``pagedllm tp-worker``: every engine option, as rank 0 was given them."""
    from pagedllm.cli_args import add_option_args

    add_option_args(p)


def main(args) -> int:
    """``pagedllm tp-worker``: one rank (RANK > 0) of a torchrun-style launch."""
    from pagedllm.cli_args import engine_options

    if os.environ.get("RANK", "0") == "0":
        raise SystemExit("pagedllm tp-worker runs ranks 1..WORLD_SIZE-1 (set RANK, WORLD_SIZE, MASTER_ADDR and "
                         "MASTER_PORT); rank 0 is the engine itself (LLM, pagedllm serve, ... with the same variables)")
    options = builder.resolve_options(None, engine_options(args))
    if str(options.tensor_parallel_size) != os.environ.get("WORLD_SIZE"):
        raise SystemExit(f"--tensor-parallel-size {options.tensor_parallel_size} must equal WORLD_SIZE "
                         f"({os.environ.get('WORLD_SIZE')})")
    run_worker(options)
    return 0
