"""What the simulator's commands take from their arguments: the trace, the KV pool, the step-time model.

Shared by ``pagedllm simulate`` (and its ``--sweep-block-size``), ``pagedllm plan`` and ``pagedllm bench
compare``, so no command module is a library for another. Building these does no simulation.
"""

from __future__ import annotations

from pagedllm.config import DTYPE_BYTES, SchedulerConfig, kv_element_bytes, parse_memory_budget
from pagedllm.sim.shapes import get_device, get_model
from pagedllm.sim.simulator import StepTimeModel
from pagedllm.workloads.traces import make_trace, read_trace


def kv_pool_bytes(device_memory: int, weight_bytes: int, kv_memory: str | None, utilization: float) -> int:
    """Bytes for KV blocks: ``kv_memory`` ("8GiB", "25%" of what the weights leave), else
    ``utilization`` x memory - weights. Raises when nothing is left."""
    left = device_memory - weight_bytes
    budget = None if kv_memory is None else parse_memory_budget(kv_memory)  # the engine's own parser
    if budget is None:
        pool = int(utilization * device_memory) - weight_bytes
    elif isinstance(budget, str):  # "25%"
        pool = int(float(budget[:-1]) / 100 * left)
    else:
        pool = int(budget)
        if pool > left:
            raise ValueError(f"--kv-memory {kv_memory} does not fit: the weights leave {left / 2**30:.1f} GiB")
    if pool <= 0:
        raise ValueError(f"no memory left for the KV cache: the weights take {weight_bytes / 2**30:.1f} GiB "
                         f"of {device_memory / 2**30:.1f} GiB")
    return pool


def load_trace(args):
    """``--trace FILE``, else the generated ``--workload`` of ``--num-requests`` at ``--rate``."""
    if args.trace:
        return read_trace(args.trace)
    return make_trace(args.workload, args.num_requests, float(args.rate), args.seed)


def setup(args) -> tuple[StepTimeModel, list, int, SchedulerConfig]:
    """(step-time model, trace, KV pool bytes, scheduler config) from the command's arguments."""
    model, device = get_model(args.model), get_device(args.device)
    timing = StepTimeModel(model, device, DTYPE_BYTES[args.dtype],
                           kv_element_bytes(args.kv_cache_dtype, args.dtype, model.head_dim))
    pool = kv_pool_bytes(device.memory_bytes, model.weight_bytes(timing.dtype_bytes), args.kv_memory,
                         args.memory_utilization)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs or 256, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens or 8192)
    return timing, load_trace(args), pool, sched
