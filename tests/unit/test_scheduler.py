"""Scheduler (torch-free): token budget, chunked prefill, max_num_seqs, preemption, nothing lost.

A fake model stands in for the network: it stores each new token id in its KV "slot" and reads
the whole context back through the block table, so a wrong slot or block table changes outputs.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.errors import RequestTooLong
from pagedllm.kvcache import KVCacheManager
from pagedllm.kvcache.eviction import POLICIES


class FakePagedModel:
    """Next token = a hash of the context read back through the block table's slots."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.host: dict[int, int] = {}  # host-tier slots

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for src, dst, frm, to in ([*p, self.slots, self.host] for p in out.swap_out):
            for off in range(bs):
                to[dst * bs + off] = frm.get(src * bs + off, -1)
        for src, dst in out.copies:  # copy-on-write: whole blocks, before any write
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
        sampled = {}
        for c in out.chunks:
            for i, tok in enumerate(c.token_ids):
                p = c.start_pos + i
                self.slots[c.block_ids[p // bs] * bs + p % bs] = tok
            if c.sample:
                ctx = [self.slots[c.block_ids[p // bs] * bs + p % bs] for p in range(c.seq_len)]
                h = 0
                for t in ctx:
                    h = (h * 1_000_003 + t) % 997
                sampled[c.request_id] = 3 + h  # never 0..2 (2 is EOS here)
                for i, fid in enumerate(c.fork_ids):  # siblings: a different draw from the same context
                    sampled[fid] = 3 + (h + 101 * (i + 1)) % 997
        for src, dst in out.swap_in:  # prefetched for the next step: after this step's reads
            for off in range(bs):
                self.slots[dst * bs + off] = self.host.get(src * bs + off, -1)
        return sampled


def make(num_blocks=64, block_size=8, max_num_seqs=8, budget=32, max_model_len=512, policy="lru", caching=True,
         swap_blocks=0):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, eviction_policy=policy,
                        num_host_blocks=swap_blocks)
    mode = "swap" if swap_blocks else "recompute"
    return (Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, preemption_mode=mode), kv),
            FakePagedModel(block_size))


def req(rid, prompt_len, max_tokens, first=10):
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, eos_token_ids=frozenset({2}))


def run_to_end(sched, model, max_steps=10_000):
    finished: dict[str, list[int]] = {}
    steps = 0
    live = dict(sched.requests)
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        for r in sched.update(out, model.run(out)):
            if r.status.finished:
                finished[r.request_id] = list(r.output_token_ids)
        sched.kv.check_invariants()
        steps += 1
        assert steps < max_steps
    assert set(finished) == set(live)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return finished


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched, model = make(budget=8)
    sched.add(req("a", 20, 2))
    sizes, samples = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        sizes.append([c.num_tokens for c in out.chunks])
        samples.append([c.sample for c in out.chunks])
        sched.update(out, model.run(out))
    assert sizes == [[8], [8], [4], [1]]
    assert samples == [[False], [False], [True], [True]]


def test_decode_and_prefill_share_a_step_running_first():
    sched, model = make(budget=16)
    sched.add(req("a", 4, 5))
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.add(req("b", 30, 2))
    out = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 15)]


def test_max_num_seqs_limits_the_running_set():
    sched, model = make(max_num_seqs=2)
    for i in range(5):
        sched.add(req(str(i), 3, 3))
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["0", "1"]
    assert len(sched.waiting) == 3
    run_to_end(sched, model)


def test_newest_request_is_preempted_and_recomputed_later():
    # 6 blocks of 8 slots; three requests of 16 + 16 tokens need 4 blocks each at the end
    sched, model = make(num_blocks=6, block_size=8, budget=64)
    for rid in "abc":
        sched.add(req(rid, 16, 16))
    out = sched.schedule()
    # step 1: the three 16-token prompts fit the budget (48 <= 64) and the pool (2 blocks each)
    assert [(c.request_id, c.start_pos, c.num_tokens, c.block_ids, c.sample) for c in out.chunks] == [
        ("a", 0, 16, [0, 1], True), ("b", 0, 16, [2, 3], True), ("c", 0, 16, [4, 5], True)]
    assert out.preempted == []
    sched.update(out, model.run(out))
    # step 2: each decode needs a third block and none is free: the newest (c) makes room for a and b
    out = sched.schedule()
    assert out.preempted == ["c"]
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks] == [("a", 16, 1), ("b", 16, 1)]
    sched.update(out, model.run(out))
    outputs = run_to_end(sched, model)
    assert sched.kv.num_preemptions > 0
    # the same requests with plenty of memory give the same tokens
    sched2, model2 = make(num_blocks=64, block_size=8, budget=64)
    for rid in "abc":
        sched2.add(req(rid, 16, 16))
    assert run_to_end(sched2, model2) == outputs
    assert sched2.kv.num_preemptions == 0


def test_preempted_request_goes_to_the_front_of_the_queue_with_no_blocks():
    sched, model = make(num_blocks=4, block_size=8, budget=64, max_num_seqs=4)
    sched.add(req("old", 8, 20))
    sched.add(req("new", 8, 20))
    preempted = []
    while not preempted:
        out = sched.schedule()
        preempted = out.preempted
        sched.update(out, model.run(out))
    assert preempted == ["new"]
    victim = sched.requests["new"]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.waiting[0] is victim and "new" not in sched.kv.tables
    run_to_end(sched, model)


def test_finish_frees_blocks_wherever_the_request_is():
    sched, model = make()
    sched.add(req("a", 10, 5))
    sched.add(req("b", 10, 5))
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    sched.finish("a", RequestStatus.FINISHED_ABORTED)  # idempotent
    sched.add(req("c", 10, 5))
    sched.finish("c", RequestStatus.FINISHED_ABORTED)  # still waiting
    assert set(sched.kv.tables) == {"b"}
    sched.kv.check_invariants()
    run_to_end(sched, model)


workloads = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(workload=workloads, num_blocks=st.integers(8, 40), budget=st.integers(8, 80),
       max_num_seqs=st.integers(1, 8), policy=st.sampled_from(POLICIES), caching=st.booleans(),
       shared_prefix=st.integers(0, 20))
def test_random_workloads_finish_with_the_same_tokens_as_an_unconstrained_run(
        workload, num_blocks, budget, max_num_seqs, policy, caching, shared_prefix):
    block_size = 8
    # only requests that fit the whole pool are admitted by the engine; mirror that
    workload = [(p, m) for p, m in workload if -(-(p + m) // block_size) <= num_blocks] or [(1, 1)]
    sched, model = make(num_blocks, block_size, max_num_seqs, budget, policy=policy, caching=caching)
    ref, ref_model = make(1024, block_size, 64, 4096, caching=False)
    for i, (p, m) in enumerate(workload):
        # the first `shared_prefix` tokens are common to all prompts, so prefix hits happen
        for s in (sched, ref):
            r = req(str(i), p, m, first=10 + i)
            r.token_ids[:shared_prefix] = list(range(5000, 5000 + min(p, shared_prefix)))[:p]
            r.prompt_token_ids = list(r.token_ids)
            s.add(r)
    got = run_to_end(sched, model)
    assert got == run_to_end(ref, ref_model)
    for i, (_, m) in enumerate(workload):
        assert len(got[str(i)]) == m


def test_swap_preemption_moves_blocks_to_the_host_and_back_with_the_same_outputs():
    sched, model = make(num_blocks=6, block_size=8, budget=64, swap_blocks=16)
    ref, ref_model = make(num_blocks=64, block_size=8, budget=64)
    for s in (sched, ref):
        for rid in "abc":
            s.add(req(rid, 16, 16, first=10 + ord(rid)))
    saw_swapped = False
    outputs = {}
    num_swapped_in = 0
    awaiting_compute: set[str] = set()  # swapped back in, not computed since
    while sched.has_unfinished():
        swapped_before = list(sched.swapped)
        out = sched.schedule()
        saw_swapped |= bool(sched.swapped)
        came_back = {r.request_id for r in swapped_before if r.status is RequestStatus.RUNNING}
        assert bool(came_back) == bool(out.swap_in)
        computed = {c.request_id for c in out.chunks}
        # a request whose blocks are being copied in during this step is not computed in it ...
        assert not came_back & computed, (came_back, computed)
        awaiting_compute = (awaiting_compute - computed) | came_back
        num_swapped_in += len(came_back)
        for r in sched.update(out, model.run(out)):
            if r.status.finished:
                outputs[r.request_id] = r.output_token_ids
        sched.kv.check_invariants()
    # ... and every one of them was computed in a later step
    assert num_swapped_in > 0 and not awaiting_compute
    stats = sched.kv.stats()
    assert saw_swapped and stats["num_swapped_out_blocks"] > 0
    assert stats["num_swapped_out_blocks"] == stats["num_swapped_in_blocks"]
    assert outputs == run_to_end(ref, ref_model)
    sched.schedule()
    assert sched.kv.host.num_free == 16


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    sched, model = make(num_blocks=6, block_size=8, budget=64, swap_blocks=1)
    for rid in "abc":
        sched.add(req(rid, 16, 16, first=10 + ord(rid)))
    outputs = run_to_end(sched, model)
    assert len(outputs) == 3 and sched.kv.num_preemptions > 0
    assert sched.kv.stats()["num_swapped_out_blocks"] == 0


def test_a_prompt_is_admitted_only_when_the_pool_holds_all_of_it():
    """Admitting a long prompt on the strength of its first chunk let its later chunks run the pool
    dry and preempt a request part-way through its prefill (with recompute, that work is lost):
    two 48-token prompts in a 10-block pool took turns destroying each other's prefills."""
    sched, model = make(num_blocks=10, block_size=8, budget=32, caching=False)
    sched.add(req("a", 48, 2))
    sched.add(req("b", 48, 2, first=100))
    admitted = []
    while sched.has_unfinished():
        out = sched.schedule()
        admitted.append(sorted(c.request_id for c in out.chunks))
        sched.update(out, model.run(out))
    assert sched.kv.num_preemptions == 0
    assert admitted[:3] == [["a"], ["a"], ["a"]]  # b waits: 6 blocks of prompt, 4 free while a prefills
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_observers_see_every_step_and_the_stall_and_admission_rules_are_the_schedulers():
    sched, model = make(num_blocks=4, block_size=8, max_model_len=64)
    seen: list[SchedulerOutput] = []
    sched.observers.append(seen.append)
    sched.add(req("a", 10, 3))
    outs = [sched.schedule() for _ in range(2)]
    assert seen == outs and all(o is s for o, s in zip(outs, seen, strict=True))
    sched.observers.remove(seen.append)
    sched.schedule()
    assert len(seen) == 2
    # the admission rule the engine and the simulator share
    assert sched.check_admissible(10, 20) == 20
    with pytest.raises(RequestTooLong, match="must be shorter than max_model_len"):
        sched.check_admissible(64, 1)
    with pytest.raises(RequestTooLong, match="more than the whole pool"):
        sched.check_admissible(10, 30)  # 40 tokens need 5 blocks of 8; the pool has 4
    # two empty steps in a row with a request unfinished: stalled
    stuck, _ = make(num_blocks=1, block_size=8, max_model_len=64)
    stuck.add(req("b", 20, 1))  # its prompt needs 3 blocks: it can never be admitted
    assert stuck.schedule().is_empty and not stuck.stalled
    assert stuck.schedule().is_empty and stuck.stalled


def test_one_slot_rule_for_tables_and_the_runner():
    from pagedllm.kvcache.block_table import slot_mapping

    assert slot_mapping([7, 2], 4, 2, 7) == [30, 31, 8, 9, 10]
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("r", 7)
    assert kv.tables["r"].slots(2, 7) == slot_mapping(kv.block_ids("r"), 4, 2, 7)
