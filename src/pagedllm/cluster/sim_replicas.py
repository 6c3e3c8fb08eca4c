"""``pagedllm simulate --replicas N --routing P``: N engine replicas behind one router, on one
virtual clock (issue 26's routing at GPU scale).

Each replica is the simulator's own (the real ``Scheduler`` and ``KVCacheManager``, the step-time
model of one device); the router is ``cluster/routing.py``'s policy, its view of each replica kept
by that replica's KV-cache events (as a real router's would be) and its queue lengths and KV usage
at the moment a request arrives. Events run in time order: an arrival is routed when no replica's
step ends before it; otherwise the replica whose clock is earliest takes its next step. A replica
with nothing to do waits for its next request. Every replica runs ``--kv-memory``'s pool.

Reports, per policy: output tokens/s over the makespan, TTFT p50/p99, the prefix-cache hit rate
(tokens served from cache over prompt tokens), requests and peak KV blocks per replica, and the
prefix-aware policy's reasons. No torch. ``pagedllm simulate`` takes ``--replicas``, ``--routing``
and the prefix-aware policy's ``--routing-load-threshold`` / ``--routing-min-match-rate`` (checked
before anything runs) through ``add_cli_args``/``main`` here (the simulator itself never imports
the router).
"""

from __future__ import annotations

import math
from collections import deque

from pagedllm.cluster.routing import ReplicaState, make_policy, request_block_hashes
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler
from pagedllm.errors import RequestTooLong
from pagedllm.kvcache.factory import make_kv_manager
from pagedllm.kvcache.kv_events import KVEventLog
from pagedllm.sim.simulator import STAND_IN_TOKEN, RequestRecord, StepTimeModel, _quantile
from pagedllm.workloads.traces import TraceRequest, prompt_token_ids


class _Replica:
    def __init__(self, index: int, cache: CacheConfig, scheduler: SchedulerConfig, num_blocks: int) -> None:
        self.kv = make_kv_manager(cache, num_blocks, scheduler.max_model_len)
        self.kv.events = KVEventLog("GPU")
        self.sched = Scheduler(scheduler, self.kv)
        self.view = ReplicaState(str(index))
        self.clock = 0.0
        self.requests = 0
        self.peak_blocks = 0

    def report_load(self) -> None:
        s = self.sched
        self.view.num_waiting, self.view.num_running = len(s.waiting), len(s.running)
        self.view.kv_usage = 1 - self.kv.num_free_blocks / self.kv.num_blocks


def simulate_replicas(trace: list[TraceRequest], timing: StepTimeModel, cache: CacheConfig,
                      scheduler: SchedulerConfig, num_blocks: int, replicas: int, routing: str,
                      seed: int = 0, progress=None, **policy_options) -> dict:
    """Replay ``trace`` through ``replicas`` replicas routed by ``routing`` (``policy_options``: the
    prefix-aware policy's ``load_threshold`` and ``min_match_rate``); the summary as a dict."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    policy = make_policy(routing, seed, **policy_options)
    reps = [_Replica(i, cache, scheduler, num_blocks) for i in range(replicas)]
    vocab = timing.model.vocab_size
    records = [RequestRecord(f"r{i}", r.arrival, r.prompt_len or 0, r.output_len) for i, r in enumerate(trace)]
    by_id = {rec.request_id: rec for rec in records}
    pending = deque(zip(records, trace, strict=True))
    while pending or any(r.sched.has_unfinished() for r in reps):
        busy = [r for r in reps if r.sched.has_unfinished()]
        next_step = min((r.clock for r in busy), default=math.inf)
        if pending and pending[0][0].arrival <= next_step:
            rec, r = pending.popleft()
            tokens = prompt_token_ids(r, vocab, int(rec.request_id[1:]))
            hashes = request_block_hashes(reps[0].kv.hasher, tokens, cache.block_size)
            for rep in reps:
                rep.report_load()
            target = reps[policy.choose(hashes, [rep.view for rep in reps])]
            try:
                target.sched.check_admissible(r.prompt_len, r.output_len)
            except RequestTooLong:
                rec.status = "rejected"
                if progress is not None:
                    progress(1)
                continue
            target.view.routed(hashes)
            target.requests += 1
            if not target.sched.has_unfinished():
                target.clock = max(target.clock, rec.arrival)
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            target.sched.add(Request(rec.request_id, tokens, params, r.output_len, arrival_time=rec.arrival))
            continue
        rep = min(busy, key=lambda x: x.clock)
        out = rep.sched.schedule()
        if out.is_empty:  # nothing can run there (the engine fails such requests the same way)
            if rep.sched.stalled:
                rep.sched.empty_steps = 0
                for req in list(rep.sched.requests.values()):
                    by_id[req.request_id].status = "rejected"
                    rep.sched.finish(req.request_id, RequestStatus.FINISHED_ERROR)
                    if progress is not None:
                        progress(1)
            elif pending:
                rep.clock = max(rep.clock, pending[0][0].arrival)
            continue
        rep.clock += timing.step_seconds(out)
        sampled = {c.request_id: [STAND_IN_TOKEN] for c in out.chunks if c.sample}
        for req in rep.sched.update(out, sampled):
            rec = by_id[req.request_id]
            if rec.first_token is None:
                rec.first_token = rep.clock
            if req.status.finished:
                rec.finish, rec.status = rep.clock, req.status.value
                if progress is not None:
                    progress(1)
        rep.peak_blocks = max(rep.peak_blocks, rep.kv.num_blocks - rep.kv.num_free_blocks)
        rep.view.apply(rep.kv.events.take())
    done = [rec for rec in records if rec.status == "length"]
    makespan = max((rec.finish for rec in done), default=0.0)
    ttft = sorted(rec.ttft for rec in done)
    stats = [rep.kv.stats() for rep in reps]
    queries = sum(s["prefix_cache_queries"] for s in stats)
    hits = sum(s["prefix_cache_hits"] for s in stats)
    return {"routing": routing, "replicas": replicas, "finished": len(done),
            "rejected": sum(rec.status == "rejected" for rec in records),
            "output_tokens_per_s": round(sum(rec.output_len for rec in done) / makespan, 1) if makespan else 0.0,
            "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "requests_per_replica": [rep.requests for rep in reps],
            "peak_kv_blocks_per_replica": [rep.peak_blocks for rep in reps],
            "decisions": dict(getattr(policy, "decisions", {}))}


def add_cli_args(p) -> None:
    """``pagedllm simulate``'s flags (``sim/simulate_cmd.py``), and ``--replicas`` / ``--routing``."""
    from pagedllm.cluster.routing import DEFAULT_LOAD_THRESHOLD, DEFAULT_MIN_MATCH_RATE, ROUTING_POLICIES
    from pagedllm.sim import simulate_cmd

    simulate_cmd.add_cli_args(p)
    g = p.add_argument_group("replicas (--replicas N: N engines behind one router, each with the pool above)")
    g.add_argument("--replicas", type=int, default=1)
    g.add_argument("--routing", default="prefix-aware,power-of-two,round-robin",
                   help=f"policies to compare, comma-separated, among {', '.join(ROUTING_POLICIES)}")
    g.add_argument("--routing-load-threshold", type=int, default=DEFAULT_LOAD_THRESHOLD,
                   help="prefix-aware: as `pagedllm serve --replicas`'s flag")
    g.add_argument("--routing-min-match-rate", type=float, default=DEFAULT_MIN_MATCH_RATE,
                   help="prefix-aware: as `pagedllm serve --replicas`'s flag")


def main(args):
    """``pagedllm simulate``: one engine (``sim/simulate_cmd.py``), or ``--replicas`` of them per policy."""
    import json
    from pathlib import Path

    from tqdm import tqdm

    from pagedllm.config import check_block_size
    from pagedllm.sim import simulate_cmd
    from pagedllm.sim.inputs import setup

    if args.replicas == 1:
        return simulate_cmd.main(args)
    check_block_size(args.block_size)
    if args.routing_load_threshold < 0:
        raise ValueError(f"--routing-load-threshold must be 0 or more, got {args.routing_load_threshold}")
    if not 0.0 <= args.routing_min_match_rate <= 1.0:
        raise ValueError(f"--routing-min-match-rate must be between 0 and 1, got {args.routing_min_match_rate}")
    timing, trace, pool, sched = setup(args)
    num_blocks = int(pool // (args.block_size * timing.model.kv_bytes_per_token(timing.kv_dtype_bytes)))
    cache = CacheConfig(block_size=args.block_size, num_kv_blocks=num_blocks, enable_prefix_caching=args.prefix_caching)
    report = {"model": timing.model.name, "device": timing.device.name, "requests": len(trace),
              "num_blocks_per_replica": num_blocks, "block_size": args.block_size, "results": {}}
    for routing in [r.strip() for r in args.routing.split(",") if r.strip()]:
        with tqdm(total=len(trace), desc=f"simulate {routing}", disable=args.no_progress, leave=False) as bar:
            report["results"][routing] = simulate_replicas(
                trace, timing, cache, sched, num_blocks, args.replicas, routing, args.seed, bar.update,
                load_threshold=args.routing_load_threshold, min_match_rate=args.routing_min_match_rate)
    print(f"{timing.model.name} on {args.replicas} x {timing.device.name}: {len(trace)} requests, "
          f"{num_blocks} blocks of {args.block_size} per replica")
    print(f"{'routing':<14}{'out tok/s':>11}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'hit rate':>10}  requests per replica")
    for name, r in report["results"].items():
        print(f"{name:<14}{r['output_tokens_per_s']:>11.1f}{r['ttft_p50_s'] or 0:>12.3f}{r['ttft_p99_s'] or 0:>12.3f}"
              f"{100 * r['prefix_cache_hit_rate']:>9.1f}%  {r['requests_per_replica']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report
