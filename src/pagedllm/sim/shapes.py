"""Model shapes and devices for the simulator and the planner: what a step costs, from arithmetic.

``ModelShape`` gives the KV bytes per token (from layers, KV heads, head dim and the KV dtype),
the weights' bytes and the FLOPs of a step's tokens; ``Device`` gives memory, peak compute and
bandwidth, with the fraction of each a real engine reaches (``compute_efficiency``,
``bandwidth_efficiency``) and a fixed cost per step and per sequence (Python, launches). The
GPU presets' peaks are the vendors' dense bf16 figures and their efficiencies stated assumptions;
``this-cpu`` holds the rates calibrated against the real engine on this machine (``pagedllm
simulate --calibrate``; docs/simulator.md). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                      "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's projections (norms are negligible)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed * (1 if self.tied_embeddings else 2)

    def weight_bytes(self, dtype_bytes: float) -> int:
        return int(self.num_params * dtype_bytes)

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """K and V of one token, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes

    def linear_flops(self, num_tokens: int, num_sampled: int) -> float:
        """The projections over every token, and the LM head over the rows that sample."""
        head = self.vocab_size * self.hidden_size * num_sampled
        return 2.0 * (self.num_layers * self.layer_params * num_tokens + head)

    def attention_flops(self, query_key_pairs: int) -> float:
        """QK^T and PV: 4 x heads x head dim per (query, visible key) pair, every layer."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * query_key_pairs

    def shard(self, tensor_parallel_size: int) -> ModelShape:
        """One rank's share under tensor parallelism (``parallel/shard.py``'s split): H/N query heads,
        KH/N KV heads, I/N MLP channels; embeddings and LM head replicated. ``ValueError`` naming the
        numbers when N does not divide them."""
        n = tensor_parallel_size
        if n < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
        if n == 1:
            return self
        for what, size in (("query heads", self.num_heads), ("KV heads", self.num_kv_heads),
                           ("MLP intermediate size", self.intermediate_size)):
            if size % n:
                raise ValueError(f"tensor_parallel_size={n} must divide {self.name}'s {what} ({size})")
        return replace(self, name=f"{self.name} (1/{n})", num_heads=self.num_heads // n,
                       num_kv_heads=self.num_kv_heads // n, intermediate_size=self.intermediate_size // n)


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_flops: float          # dense bf16 (or the dtype the engine computes in)
    bandwidth: float           # bytes/s from device memory
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.0     # per step: scheduling, launches, Python
    seq_overhead_s: float = 0.0      # per sequence in the step: metadata, sampling, detokenizing
    overlap: bool = True             # compute and memory traffic overlap (a roofline: the max of the two);
                                     # False: they add up (what the fit on this CPU found closer)
    price_per_hour: float = 0.0      # dollars per machine-hour for cost figures (0: not stated)
    link: str = "pcie4"              # the interconnect between several of them (LINKS), for tensor parallelism

    def __post_init__(self) -> None:
        if min(self.memory_bytes, self.peak_flops, self.bandwidth) <= 0:
            raise ValueError("memory_bytes, peak_flops and bandwidth must be positive")
        for field in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {getattr(self, field)}")


MODELS = {
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
    "llama-2-7b": ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelShape("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-2-70b": ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, 28672, 32000),
}

DEVICES = {
    # A100 price: the one at which the mission's cost claims match its own throughput claims (mission.py)
    "a100-80gb": Device("A100-80GB", 80 * 10**9, 312e12, 2.039e12, step_overhead_s=0.004, seq_overhead_s=2e-5,
                        price_per_hour=0.93, link="nvlink-a100"),
    "h100": Device("H100-80GB SXM", 80 * 10**9, 989e12, 3.35e12, step_overhead_s=0.003, seq_overhead_s=1.5e-5,
                   link="nvlink-h100"),
    "h200": Device("H200", 141 * 10**9, 989e12, 4.8e12, step_overhead_s=0.003, seq_overhead_s=1.5e-5,
                   link="nvlink-h100"),
    # this machine (2 vCPUs, the Xeon of docs/benchmarks.md): the rates `pagedllm simulate --calibrate`
    # fitted to the real engine (SmolLM2, bf16), compute and memory adding up (docs/simulator.md)
    "this-cpu": Device("this CPU (2 vCPUs, calibrated)", 24 * GiB, 153.5e9, 10.83e9, compute_efficiency=1.0,
                       bandwidth_efficiency=1.0, seq_overhead_s=7.8e-4, overlap=False,
                       price_per_hour=0.10),  # a 2-vCPU cloud VM, order of magnitude
}


@dataclass(frozen=True)
class Link:
    """The interconnect between the ranks of one model: what an all-reduce costs
    (``StepTimeModel.allreduce_seconds``)."""

    name: str
    bandwidth: float   # bytes/s one way per GPU: what each step of a ring all-reduce moves
    latency_s: float   # per all-reduce: launch and synchronisation

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise ValueError("a link needs a positive bandwidth and a latency of 0 or more")


# Peak figures are the vendors' (one direction, per GPU); the effective shares and latencies are
# stated assumptions (docs/simulator.md), not measurements: no GPU was at hand to measure NCCL.
LINKS = {
    "nvlink-a100": Link("NVLink 3 (A100 SXM: 600 GB/s both ways, 80% of 300 GB/s one way)", 240e9, 10e-6),
    "nvlink-h100": Link("NVLink 4 (H100 SXM: 900 GB/s both ways, 80% of 450 GB/s one way)", 360e9, 8e-6),
    "pcie4": Link("PCIe 4.0 x16 (80% of 32 GB/s one way)", 25.6e9, 25e-6),
    "pcie5": Link("PCIe 5.0 x16 (80% of 64 GB/s one way)", 51.2e9, 20e-6),
}


def get_link(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {name!r}")
    return LINKS[name]


def get_model(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]


def get_device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    return DEVICES[name]
