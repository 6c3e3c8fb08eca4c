"""What the simulator's commands take from their arguments: the trace, the KV pool, the step-time model.

Shared by ``pagedllm simulate`` (and its ``--sweep-block-size``), ``pagedllm plan`` and ``pagedllm bench
compare``, so no command module is a library for another. Building these does no simulation.
"""

from __future__ import annotations

from pagedllm.config import DTYPE_BYTES, SchedulerConfig, kv_element_bytes, parse_memory_budget
from pagedllm.sim.shapes import get_device, get_link, get_model
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


def step_time_model(model_name: str, device_name: str, dtype: str, kv_cache_dtype: str = "auto",
                    tensor_parallel_size: int = 1, link: str | None = None) -> StepTimeModel:
    """The step-time model of one device: the whole model, or one rank's share over ``link``."""
    model = get_model(model_name).shard(tensor_parallel_size)
    return StepTimeModel(model, get_device(device_name), DTYPE_BYTES[dtype],
                         kv_element_bytes(kv_cache_dtype, dtype, model.head_dim), tensor_parallel_size,
                         None if tensor_parallel_size == 1 else get_link(link or get_device(device_name).link))


def setup(args) -> tuple[StepTimeModel, list, int, SchedulerConfig]:
    """(step-time model, trace, KV pool bytes, scheduler config) from the command's arguments; under
    tensor parallelism (``--tensor-parallel-size``) the pool is one rank's, beside its share of the
    weights, and its blocks hold that rank's KV heads."""
    timing = step_time_model(args.model, args.device, args.dtype, args.kv_cache_dtype,
                             getattr(args, "tensor_parallel_size", 1), getattr(args, "link", None))
    model, device = timing.model, timing.device
    pool = kv_pool_bytes(device.memory_bytes, model.weight_bytes(timing.dtype_bytes), args.kv_memory,
                         args.memory_utilization)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs or 256, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens or 8192)
    return timing, load_trace(args), pool, sched


def add_tensor_parallel_args(p) -> None:
    """``--tensor-parallel-size`` and ``--link`` (``simulate``; ``plan`` takes a list of sizes)."""
    from pagedllm.sim.shapes import LINKS

    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model is split over by heads (each holds its share of weights and KV)")
    p.add_argument("--link", default=None, choices=sorted(LINKS),
                   help="the interconnect for the all-reduces (default: NVLink for the SXM presets, else pcie4)")
