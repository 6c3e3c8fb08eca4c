"""Replay a trace through the real scheduler and KV manager, with a step-time model instead of a model.

The same ``Scheduler`` and ``KVCacheManager`` (or ``ContiguousKVCacheManager``) the engine runs
decide every step; ``StepTimeModel`` says how long the step would take on a ``Device`` for a
``ModelShape`` (a roofline: the step's FLOPs against the device's compute, the bytes it reads --
weights once, the KV of every sequence in the step -- against its bandwidth, plus a fixed cost per
step and per sequence). Requests arrive at their trace times on a virtual clock; a sampled token
is a stand-in id (the KV manager sees the same block traffic as with real tokens, except that
generated tokens never match another request's, which traces never rely on).

Invariants: a request either finishes (``length``) or is rejected, as the engine would reject it
(prompt + output longer than ``max_model_len``, or more blocks than the pool has); every block is
free at the end.
No torch here: tens of thousands of requests replay in seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.errors import RequestTooLong
from pagedllm.kvcache.factory import make_kv_manager
from pagedllm.sim.shapes import Device, Link, ModelShape
from pagedllm.workloads.traces import TraceRequest, prompt_token_ids

STAND_IN_TOKEN = 7  # what every simulated sample returns
RETIRED_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


@dataclass(frozen=True)
class StepTimeModel:
    """``model`` is what one device runs: the whole model, or under tensor parallelism one rank's
    share (``ModelShape.shard``), whose step then adds two all-reduces per layer over ``link``."""

    model: ModelShape
    device: Device
    dtype_bytes: float = 2.0      # weights and activations
    kv_dtype_bytes: float = 2.0
    tensor_parallel_size: int = 1
    link: Link | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size > 1 and self.link is None:
            raise ValueError("tensor parallelism needs a link between the devices (--link)")

    def allreduce_seconds(self, num_tokens: int) -> float:
        """The step's all-reduces: after each layer's attention output and MLP, a ring all-reduce of
        ``num_tokens x hidden`` activations, each GPU sending and receiving ``2 (N - 1) / N`` of
        them, plus the link's latency each time."""
        n = self.tensor_parallel_size
        if n == 1 or num_tokens == 0:
            return 0.0
        size = num_tokens * self.model.hidden_size * self.dtype_bytes
        each = self.link.latency_s + 2 * (n - 1) / n * size / self.link.bandwidth
        return 2 * self.model.num_layers * each

    def features(self, out: SchedulerOutput) -> tuple[float, float, int]:
        """(FLOPs, bytes read, sequences) of a step. Each new token at position p sees keys 0..p;
        the weights are read once per step, each sequence's K/V once (copy-on-write block copies,
        a few blocks per fork, are left out)."""
        sampled = sum(1 + len(c.fork_ids) for c in out.chunks if c.sample)
        pairs = sum(c.num_tokens * c.start_pos + c.num_tokens * (c.num_tokens + 1) // 2 for c in out.chunks)
        flops = self.model.linear_flops(out.num_batched_tokens, sampled) + self.model.attention_flops(pairs)
        kv_read = sum(c.seq_len for c in out.chunks) * self.model.kv_bytes_per_token(self.kv_dtype_bytes)
        return flops, self.model.weight_bytes(self.dtype_bytes) + kv_read, len(out.chunks)

    def step_seconds(self, out: SchedulerOutput) -> float:
        flops, bytes_, seqs = self.features(out)
        d = self.device
        compute = flops / (d.peak_flops * d.compute_efficiency)
        memory = bytes_ / (d.bandwidth * d.bandwidth_efficiency)
        busy = max(compute, memory) if d.overlap else compute + memory
        return busy + self.allreduce_seconds(out.num_batched_tokens) + d.step_overhead_s + d.seq_overhead_s * seqs


@dataclass
class RequestRecord:
    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finish: float | None = None
    status: str = "waiting"
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)


@dataclass
class StepSample:
    time: float
    seconds: float
    num_seqs: int
    num_tokens: int
    used_blocks: int
    fragmentation: float
    block_size: int = 0  # the pool's block size at this step (0: the run's ``block_size``)


@dataclass
class SimulationResult:
    requests: list[RequestRecord]
    steps: list[StepSample]
    finish_order: list[str]
    kv: dict = field(default_factory=dict)
    block_size: int = 16
    bytes_per_block: float = 0.0
    max_seq_len: int = 0  # the longest prompt + output the pool admits (``longest_admissible``)
    control_s: float = 0.0  # wall time spent in the scheduler's schedule() and update() (the control plane)
    replans: list[tuple[float, int]] = field(default_factory=list)  # (time, new block size) of each re-plan

    def summary(self) -> dict:
        done = [r for r in self.requests if r.status == "length"]
        makespan = max((r.finish for r in done), default=0.0)
        out_tokens = sum(r.output_len for r in done)
        busy = [s for s in self.steps if s.used_blocks]
        ttft = sorted(r.ttft for r in done)
        tpot = sorted(t for r in done if (t := r.tpot) is not None)
        peak_blocks = max((s.used_blocks for s in self.steps), default=0)
        per_token = self.bytes_per_block / self.block_size
        peak_bytes = max((s.used_blocks * (s.block_size or self.block_size) for s in self.steps), default=0) * per_token
        return {
            "requests": len(self.requests), "finished": len(done), "max_seq_len": self.max_seq_len,
            "rejected": sum(r.status == "rejected" for r in self.requests),
            "makespan_s": round(makespan, 3),
            "output_tokens_per_s": round(out_tokens / makespan, 2) if makespan else 0.0,
            "requests_per_s": round(len(done) / makespan, 3) if makespan else 0.0,
            "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
            "tpot_p50_s": _quantile(tpot, 0.5), "tpot_p99_s": _quantile(tpot, 0.99),
            "mean_fragmentation": round(statistics.mean(s.fragmentation for s in busy), 4) if busy else 0.0,
            "max_fragmentation": round(max((s.fragmentation for s in busy), default=0.0), 4),
            "peak_kv_blocks": peak_blocks,
            "peak_kv_bytes": int(peak_bytes),
            "mean_batch": round(statistics.mean(s.num_seqs for s in self.steps), 2) if self.steps else 0.0,
            "max_batch": max((s.num_seqs for s in self.steps), default=0),
            "preemptions": self.kv.get("num_preemptions", 0),
            "prefix_cache_hit_rate": round(self.kv["prefix_cache_hits"] / self.kv["prefix_cache_queries"], 4)
            if self.kv.get("prefix_cache_queries") else 0.0,
            "steps": len(self.steps),
        }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return round(sorted_values[i], 4)


def longest_admissible(kv, max_model_len: int) -> int:
    """The longest prompt + output the engine admits on ``kv``'s pool (its rule: at most
    ``max_model_len``, and no more blocks than the pool holds); 0 when nothing fits."""
    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.max_blocks_for_request(mid) <= kv.num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def simulate(trace: list[TraceRequest], timing: StepTimeModel, cache: CacheConfig, scheduler: SchedulerConfig,
             num_blocks: int, vocab_size: int | None = None, on_step=None, progress=None,
             replan=None, kv_factory=make_kv_manager) -> SimulationResult:
    """Replay ``trace`` (sorted by arrival) on a pool of ``num_blocks`` blocks; ``on_step(manager)``
    is called after every step, ``progress(n)`` with each n requests finished or rejected.
    ``replan(finished_records)``, when given, is asked whenever the pool is empty (every request so
    far finished, more to come) and may return a new ``CacheConfig`` (its ``num_kv_blocks`` set):
    the pool is then rebuilt with that block size, as a deployment re-planned between bursts.
    ``kv_factory(cache, num_blocks, max_model_len)`` builds the KV manager (placement experiments
    pass their own; default: the engine's ``make_kv_manager``)."""
    if scheduler.preemption_mode == "swap":
        raise ValueError("the simulator replays preemption_mode='recompute' only (no host tier model yet)")
    vocab = vocab_size or timing.model.vocab_size
    kv = kv_factory(cache, num_blocks, scheduler.max_model_len)
    sched = Scheduler(scheduler, kv)
    records = [RequestRecord(f"r{i}", r.arrival, r.prompt_len or 0, r.output_len) for i, r in enumerate(trace)]
    by_id = {rec.request_id: rec for rec in records}
    pending = deque(zip(records, trace, strict=True))
    steps: list[StepSample] = []
    finish_order: list[str] = []
    clock, control = 0.0, 0.0
    retired = dict.fromkeys(RETIRED_COUNTERS, 0)  # counters of pools replaced by a re-plan
    replans: list[tuple[float, int]] = []
    while pending or sched.has_unfinished():
        while pending and pending[0][0].arrival <= clock:
            rec, r = pending.popleft()
            if r.prompt_len is None:
                raise ValueError(f"request {rec.request_id} has a text prompt: the simulator needs prompt_len")
            try:
                sched.check_admissible(r.prompt_len, r.output_len)  # the engine's admission rule
            except RequestTooLong:
                rec.status = "rejected"
                if progress is not None:
                    progress(1)
                continue
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            sched.add(Request(rec.request_id, prompt_token_ids(r, vocab, int(rec.request_id[1:])), params, r.output_len,
                              arrival_time=rec.arrival))
        if not sched.has_unfinished():
            if pending:  # idle until the next arrival (the last ones may all have been rejected)
                new = replan([rec for rec in records if rec.status == "length"]) if replan is not None else None
                if new is not None and new.block_size != cache.block_size:
                    st = kv.stats()
                    for k in RETIRED_COUNTERS:
                        retired[k] += st[k]
                    cache, num_blocks = new, new.num_kv_blocks
                    kv = kv_factory(cache, num_blocks, scheduler.max_model_len)
                    sched = Scheduler(scheduler, kv)
                    replans.append((clock, cache.block_size))
                clock = max(clock, pending[0][0].arrival)
            continue
        t0 = time.perf_counter()
        out = sched.schedule()
        control += time.perf_counter() - t0
        if out.is_empty:
            if sched.stalled:  # nothing can ever run (the engine fails these requests the same way)
                sched.empty_steps = 0
                for req in list(sched.requests.values()):
                    by_id[req.request_id].status = "rejected"
                    sched.finish(req.request_id, RequestStatus.FINISHED_ERROR)
                    if progress is not None:
                        progress(1)
            elif pending:
                clock = max(clock, pending[0][0].arrival)
            continue
        seconds = timing.step_seconds(out)
        clock += seconds
        sampled = {c.request_id: [STAND_IN_TOKEN] for c in out.chunks if c.sample}
        t0 = time.perf_counter()
        updated = sched.update(out, sampled)
        control += time.perf_counter() - t0
        for req in updated:
            rec = by_id[req.request_id]
            if rec.first_token is None:
                rec.first_token = clock
                rec.num_cached_tokens = req.num_cached_tokens
            rec.num_preemptions = req.num_preemptions
            if req.status.finished:
                rec.finish, rec.status = clock, req.status.value
                finish_order.append(req.request_id)
                if progress is not None:
                    progress(1)
        st = kv.stats()
        steps.append(StepSample(clock, seconds, len(out.chunks), out.num_batched_tokens, st["num_used_blocks"],
                                st["fragmentation"], cache.block_size))
        if on_step is not None:
            on_step(kv)
    stats = kv.stats()
    for k in RETIRED_COUNTERS:
        stats[k] += retired[k]
    return SimulationResult(records, steps, finish_order, stats, cache.block_size,
                            cache.block_size * timing.model.kv_bytes_per_token(timing.kv_dtype_bytes),
                            longest_admissible(kv, scheduler.max_model_len), control, replans)
