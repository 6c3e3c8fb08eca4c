"""Replay a trace through the real engine on the wall clock: the measured twin of ``simulator.simulate``.

Owns admission at each request's arrival time (scaled by ``time_scale``; 0: all at once, in trace
order), stepping the engine until every request has finished or been rejected, and the records of
what happened, kept in the simulator's own types (``RequestRecord``, ``StepSample``,
``SimulationResult``) so that one ``summary()`` describes a measured run and a simulated one alike.

Times are seconds from the start of the replay. A request's TTFT counts from its scheduled
arrival, so time spent waiting for the step in flight to end before it could be added is the
user's wait too. Length-only trace requests get ``prompt_token_ids`` (prefix and conversation
sharing kept); text prompts go through the engine's tokenizer. Every request is greedy with
``ignore_eos`` and ``max_tokens`` = its output length, as in the simulator. A request the engine
refuses (too long for ``max_model_len`` or the pool) is recorded as rejected with its message.
"""

from __future__ import annotations

import time
from collections import deque

from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.errors import PagedLLMError
from pagedllm.sim.simulator import RequestRecord, SimulationResult, StepSample, longest_admissible
from pagedllm.workloads.traces import TraceRequest, prompt_token_ids

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def replay(engine, trace: list[TraceRequest], time_scale: float = 1.0, progress=None, on_step=None,
           bytes_per_block: float = 0.0) -> SimulationResult:
    """Run ``trace`` (sorted by arrival) through ``engine``; ``progress(n)`` is called as n requests
    finish or are rejected, ``on_step(scheduler_output, seconds)`` after every step that ran. The
    KV counters in ``result.kv`` count this replay only (the engine may have served a warm-up)."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    vocab = engine.config.model.vocab_size
    kv = engine.kv_manager
    before = {k: kv.stats()[k] for k in COUNTERS}
    records = [RequestRecord(f"r{i}", r.arrival * time_scale, r.prompt_len or 0, r.output_len)
               for i, r in enumerate(trace)]
    by_id = {rec.request_id: rec for rec in records}
    pending = deque(zip(records, trace, strict=True))
    steps: list[StepSample] = []
    finish_order: list[str] = []
    errors: dict[str, str] = {}
    captured = []
    engine.scheduler.observers.append(captured.append)  # each step's SchedulerOutput, as it is made
    start = time.monotonic()
    try:
        while pending or engine.has_unfinished():
            now = time.monotonic() - start
            while pending and pending[0][0].arrival <= now:
                rec, r = pending.popleft()
                prompt = r.prompt if r.prompt is not None else prompt_token_ids(r, vocab, int(rec.request_id[1:]))
                params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                try:
                    engine.add_request(rec.request_id, prompt, params)
                except (PagedLLMError, ValueError) as e:
                    rec.status, errors[rec.request_id] = "rejected", str(e)
                    if progress is not None:
                        progress(1)
            if not engine.has_unfinished():
                if pending:
                    time.sleep(max(0.0, pending[0][0].arrival - (time.monotonic() - start)))
                continue
            captured.clear()
            ran = engine.num_steps
            t0 = time.monotonic()
            outputs = engine.step()
            t1 = time.monotonic()
            ran = engine.num_steps > ran  # the model ran (or KV blocks moved): a step the simulator also takes
            out = captured[-1] if captured else None
            if ran and out is not None and on_step is not None:
                on_step(out, t1 - t0)
            for o in outputs:
                if not o.finished:
                    continue
                rec = by_id[o.request_id]
                m = o.metrics
                rec.first_token = None if m is None or m.first_token_time is None else m.first_token_time - start
                rec.finish, rec.num_cached_tokens = t1 - start, o.num_cached_tokens
                rec.num_preemptions = m.num_preemptions if m is not None else 0
                rec.prompt_len = len(o.prompt_token_ids)
                rec.status = o.outputs[0].finish_reason or "error"
                if o.error:
                    errors[o.request_id] = o.error
                finish_order.append(o.request_id)
                if progress is not None:
                    progress(1)
            if not ran:
                continue
            st = kv.stats()
            chunks, tokens = (len(out.chunks), out.num_batched_tokens) if out is not None else (0, 0)
            steps.append(StepSample(t1 - start, t1 - t0, chunks, tokens, st["num_used_blocks"], st["fragmentation"]))
    finally:
        engine.scheduler.observers.remove(captured.append)
    stats = kv.stats()
    stats.update({k: stats[k] - before[k] for k in COUNTERS})
    stats["errors"] = errors
    return SimulationResult(records, steps, finish_order, stats, engine.config.cache.block_size, bytes_per_block,
                            longest_admissible(kv, engine.config.scheduler.max_model_len))
