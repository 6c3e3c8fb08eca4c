"""Parallel sampling (n > 1) in the control plane: forks share the prompt's blocks by ref count,
and a shared block is copied exactly when a sibling writes into it."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedllm.engine.request import Request
from pagedllm.engine.sampling_params import SamplingParams
from tests.unit.test_scheduler import make, run_to_end

B = 8


def group(rid: str, prompt_len: int, n: int, max_tokens: int = 6):
    params = SamplingParams(n=n, max_tokens=max_tokens)
    seqs = [Request(f"{rid}#{i}", list(range(40, 40 + prompt_len)), params, max_tokens=max_tokens,
                    eos_token_ids=frozenset({2})) for i in range(n)]
    return seqs[0], seqs[1:]


def step(sched, model):
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.kv.check_invariants()
    return out


@pytest.mark.parametrize("prompt_len,expected_copies", [(13, 3), (16, 0), (1, 3), (8, 0)])
def test_siblings_share_prompt_blocks_and_copy_the_partial_one_when_written(prompt_len, expected_copies):
    sched, model = make(num_blocks=32, block_size=B, budget=64)
    first, forks = group("g", prompt_len, 4)
    sched.add(first, forks)
    step(sched, model)  # prefill + fork: every sibling holds the prompt blocks
    kv = sched.kv
    assert len(sched.running) == 4
    prompt_blocks = kv.block_ids("g#0")
    assert len(prompt_blocks) == -(-prompt_len // B)
    refs = Counter(b for rid in kv.tables for b in kv.block_ids(rid))
    assert all(refs[b] == 4 for b in prompt_blocks)
    out = step(sched, model)  # each sibling writes its first token
    assert len(out.copies) == expected_copies and kv.num_cow_copies == expected_copies
    tables = [kv.block_ids(f"g#{i}") for i in range(4)]
    full = prompt_len // B
    assert all(t[:full] == prompt_blocks[:full] for t in tables)  # full prompt blocks stay shared
    outputs = run_to_end(sched, model)
    assert len(outputs) == 4 and len(set(map(tuple, outputs.values()))) == 4
    assert kv.num_free_blocks == kv.num_blocks


def test_forks_give_the_same_tokens_as_independent_requests():
    sched, model = make(num_blocks=40, block_size=B, budget=64)
    first, forks = group("g", 21, 3, max_tokens=10)
    sched.add(first, forks)
    shared = run_to_end(sched, model)
    # the same siblings computed without sharing: each recomputes the prompt with its first token
    ref, ref_model = make(num_blocks=40, block_size=B, budget=64, caching=False)
    for rid, toks in shared.items():
        r = Request(rid, list(range(40, 61)) + toks[:1], SamplingParams(max_tokens=9), max_tokens=9,
                    eos_token_ids=frozenset({2}))
        ref.add(r)
    alone = run_to_end(ref, ref_model)
    assert {k: v[1:] for k, v in shared.items()} == alone


def test_aborting_before_the_fork_drops_pending_siblings():
    from pagedllm.engine.request import RequestStatus

    sched, model = make(num_blocks=16, block_size=B, budget=4)
    first, forks = group("g", 20, 3)
    sched.add(first, forks)
    step(sched, model)  # a 4-token chunk of the prompt: no fork yet
    assert len(sched.running) == 1 and len(first.pending_forks) == 2
    for r in (first, *forks):
        sched.finish(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.requests and sched.kv.num_free_blocks == 16
    sched.kv.check_invariants()


def test_preempted_sibling_recomputes_and_finishes():
    sched, model = make(num_blocks=7, block_size=B, budget=64)
    first, forks = group("g", 20, 3, max_tokens=12)  # 3 prompt blocks shared, then each grows to 4
    sched.add(first, forks)
    outputs = run_to_end(sched, model)
    assert len(outputs) == 3 and all(len(v) == 12 for v in outputs.values())
    assert sched.kv.num_preemptions > 0
