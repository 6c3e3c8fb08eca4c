"""Property tests over random mixes of add / step / abort / fork (n > 1) / swap, in the control plane.

After every operation: free + used == total; every ref count equals the number of holders; host
blocks are accounted for. At the end (and after aborts) nothing is leaked, and every request that
was not aborted finished with as many tokens as an unconstrained run gives it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.kvcache.eviction import POLICIES
from tests.unit.test_scheduler import make

BS = 8
op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 16), st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


def new_group(i, prompt_len, max_tokens, n, family):
    params = SamplingParams(n=n, max_tokens=max_tokens)
    prompt = [1000 * family + t for t in range(prompt_len)]  # families share prefixes
    seqs = [Request(f"{i}#{k}", prompt, params, max_tokens=max_tokens, eos_token_ids=frozenset({2}))
            for k in range(n)]
    return seqs[0], seqs[1:]


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=40), num_blocks=st.integers(7, 30), swap_blocks=st.integers(0, 24),
       policy=st.sampled_from(POLICIES), caching=st.booleans(), budget=st.integers(8, 64))
def test_random_operations_keep_accounting_and_lose_nothing(ops, num_blocks, swap_blocks, policy, caching, budget):
    sched, model = make(num_blocks, BS, 6, budget, max_model_len=128, policy=policy, caching=caching,
                        swap_blocks=swap_blocks)
    kv = sched.kv
    groups: dict[int, list[Request]] = {}
    aborted: set[str] = set()
    finished: dict[str, int] = {}

    def step():
        out = sched.schedule()
        for r in sched.update(out, model.run(out)):
            if r.status.finished:
                finished[r.request_id] = r.num_output_tokens
        kv.check_invariants()
        return out

    for o in ops:
        if o[0] == "add":
            _, plen, mtok, n, fam = o
            if -(-(plen + mtok) // BS) > num_blocks:
                continue  # the engine rejects what can never fit
            first, forks = new_group(len(groups), plen, mtok, n, fam)
            sched.add(first, forks)
            groups[len(groups)] = [first, *forks]
        elif o[0] == "step":
            for _ in range(o[1]):
                step()
        elif groups:
            for r in groups[o[1] % len(groups)]:
                if sched.finish(r.request_id, RequestStatus.FINISHED_ABORTED) is not None:
                    aborted.add(r.request_id)
            kv.check_invariants()
    steps = 0
    while sched.has_unfinished():
        out = step()
        steps += 1
        assert steps < 5000 and (not out.is_empty or out.swap_in or out.preempted), "stalled"
    for _ in range(2):  # host blocks whose copy-in was in flight are released a step later
        sched.schedule()
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.host is None or kv.host.num_free == kv.host.num_blocks
    assert not kv.tables and not sched.requests
    for members in groups.values():
        for r in members:
            if r.request_id not in aborted:
                assert finished[r.request_id] == r.max_tokens
