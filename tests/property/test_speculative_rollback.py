"""Speculative decoding in the control plane: random guesses, random accept / reject patterns,
random mixes of requests, parallel sampling, preemption (recompute and swap) and prefix caching.

The fake model reads every context back through the block table's slots, so a wrong rollback (a
rejected guess's slot read as a verified token, a block of rejected positions in the prefix cache
and hit by a later request) changes outputs. After every step the pool's accounting holds; at the
end every request has exactly the tokens of a run without speculation, and every block is free.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.request import Request
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import SchedulerOutput
from tests.unit.test_scheduler import FakePagedModel, make

BS = 8


def next_token(context: list[int]) -> int:
    """The fake model's token after ``context`` (FakePagedModel's rule)."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t) % 997
    return 3 + h


class VerifyingModel(FakePagedModel):
    """FakePagedModel that also verifies a chunk's guesses: the token at each guess's position is
    read from the slots, as the real model's rows are; the accepted prefix and the next token."""

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        guessed = [c for c in out.chunks if c.draft_token_ids]
        plain = SchedulerOutput([c for c in out.chunks if not c.draft_token_ids], out.preempted, out.copies,
                                out.swap_out, [], out.swapped_in)
        sampled = {rid: [t] for rid, t in super().run(plain).items()}
        bs = self.block_size
        for c in guessed:
            for i, tok in enumerate(c.token_ids):
                p = c.start_pos + i
                self.slots[c.block_ids[p // bs] * bs + p % bs] = tok
            k = len(c.draft_token_ids)
            tokens = []
            for j in range(k + 1):
                end = c.seq_len - k + j
                tokens.append(next_token([self.slots[c.block_ids[p // bs] * bs + p % bs] for p in range(end)]))
                if j == k or tokens[-1] != c.draft_token_ids[j]:
                    break
            sampled[c.request_id] = tokens
        for src, dst in out.swap_in:  # after this step's reads (the parent class skipped them above)
            for off in range(bs):
                self.slots[dst * bs + off] = self.host.get(src * bs + off, -1)
        return sampled


class RandomDrafter:
    """Guesses the true continuation for a random number of tokens, then a wrong one (or not)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.drafted = self.accepted = 0
        self.finished: list[str] = []

    def may_guess(self, num_rows):
        return True

    def plan_step(self, decoding, num_rows):
        plan = {}
        for req, most in decoding:
            if self.rng.random() < 0.3:
                continue
            context, guesses = list(req.token_ids), []
            right = self.rng.randint(0, most)
            for _ in range(self.rng.randint(1, most)):
                t = next_token(context)
                if len(guesses) >= right:
                    t = 3 + (t + 1 + self.rng.randrange(900)) % 997  # wrong (the model never gives 0..2)
                    if t == next_token(context):
                        t = 3 + (t - 3 + 1) % 997
                guesses.append(t)
                context.append(t)
            plan[req.request_id] = guesses
        return plan

    def record(self, request_id, num_drafted, num_accepted):
        assert 0 <= num_accepted <= num_drafted
        self.drafted += num_drafted
        self.accepted += num_accepted

    def finish(self, request_id, output_token_ids):
        self.finished.append(request_id)


def run(requests, speculate: bool, seed: int, **kw):
    sched, _ = make(**kw)
    model = VerifyingModel(BS)
    if speculate:
        sched.drafter = RandomDrafter(seed)
    kv = sched.kv
    for first, forks in requests:
        sched.add(first, forks)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, model.run(out))
        kv.check_invariants()
        for rid, table in kv.tables.items():  # rolled back: no slot past the request's computed tokens
            r = sched.requests[rid]
            assert r.status.finished or table.num_slots <= max(r.num_computed_tokens, r.num_tokens - 1) or \
                rid in out.swapped_in
        steps += 1
        assert steps < 5000, "stalled"
    for _ in range(2):
        sched.schedule()
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables and not sched.requests
    assert kv.host is None or kv.host.num_free == kv.host.num_blocks
    return sched, steps


def new_requests(specs):
    out = []
    for i, (plen, mtok, n, family) in enumerate(specs):
        params = SamplingParams(n=n, max_tokens=mtok)
        prompt = [1000 * family + t % 5 for t in range(plen)]  # families share prefixes; repetitive text
        seqs = [Request(f"{i}#{k}", prompt, params, max_tokens=mtok, eos_token_ids=frozenset({2}))
                for k in range(n)]
        out.append((seqs[0], seqs[1:]))
    return out


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 24), st.integers(1, 2), st.integers(0, 2)),
                      min_size=1, max_size=8),
       num_blocks=st.integers(12, 40), swap_blocks=st.sampled_from([0, 16]), caching=st.booleans(),
       budget=st.integers(8, 48), seed=st.integers(0, 10_000))
def test_rollback_on_random_accept_reject_patterns_gives_the_tokens_of_plain_decoding(
        specs, num_blocks, swap_blocks, caching, budget, seed):
    specs = [s for s in specs if -(-(s[0] + s[1]) // BS) <= num_blocks]
    if not specs:
        return
    kw = dict(num_blocks=num_blocks, block_size=BS, max_num_seqs=6, budget=budget, max_model_len=128,
              caching=caching, swap_blocks=swap_blocks)
    plain_reqs, spec_reqs = new_requests(specs), new_requests(specs)
    run(plain_reqs, False, seed, **kw)
    sched, _ = run(spec_reqs, True, seed, **kw)
    for (p0, pf), (s0, sf) in zip(plain_reqs, spec_reqs, strict=True):
        for a, b in zip([p0, *pf], [s0, *sf], strict=True):
            assert b.output_token_ids == a.output_token_ids, b.request_id
            assert b.status == a.status
    drafter = sched.drafter
    assert drafter.accepted <= drafter.drafted
    assert sorted(drafter.finished) == sorted(r.request_id for g in spec_reqs for r in [g[0], *g[1]])


def test_a_rejected_guess_returns_its_blocks_and_never_enters_the_prefix_cache():
    sched, _ = make(num_blocks=16, block_size=BS, budget=64)
    model = VerifyingModel(BS)
    drafter = sched.drafter = RandomDrafter(0)
    prompt = list(range(10, 17))  # 7 tokens: the first output token fills block 0
    r = Request("a", prompt, SamplingParams(max_tokens=30), max_tokens=30, eos_token_ids=frozenset({2}))
    sched.add(r)
    out = sched.schedule()
    sched.update(out, model.run(out))  # prefill: 8 tokens known, 7 computed
    wrong = 3 + (next_token(r.token_ids) + 5) % 997
    drafter.plan_step = lambda decoding, rows: {"a": [wrong] + [50] * 11}  # 12 guesses: into blocks 1 and 2
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == [wrong] + [50] * 11 and len(chunk.block_ids) == 3  # lookahead slots
    held = sched.kv.num_free_blocks
    sched.update(out, model.run(out))
    assert r.num_computed_tokens == 8 and r.num_tokens == 9  # only the model's own token was kept
    assert sched.kv.num_free_blocks == held + 2  # blocks 1 and 2 (rejected positions only) are back
    table = sched.kv.tables["a"]
    assert len(table.blocks) == 1 and table.num_slots == 8
    assert sched.kv.prefix_cache.get(table.blocks[0].block_hash) is table.blocks[0]  # verified, full: cached
    assert len(sched.kv.prefix_cache) == 1  # blocks 1 and 2 were full of rejected guesses: never cached
    sched.kv.check_invariants()


def test_no_guesses_in_a_step_that_prefills_or_could_admit_a_prompt():
    """Guesses take step budget: beside a prefill they would shorten its chunk (the dense GEMMs round
    a chunk's rows by its length: outputs would differ from plain decoding's). The drafter is asked
    only in steps where every request decodes and none waits."""
    sched, _ = make(num_blocks=32, block_size=BS, budget=16)
    model = VerifyingModel(BS)
    asked = []
    drafter = sched.drafter = RandomDrafter(0)
    drafter.plan_step = lambda decoding, rows: asked.append(len(decoding)) or {
        r.request_id: [50] * min(3, most) for r, most in decoding}
    params = SamplingParams(max_tokens=30)
    a = Request("a", list(range(10, 17)), params, max_tokens=30, eos_token_ids=frozenset({2}))
    sched.add(a)
    out = sched.schedule()
    sched.update(out, model.run(out))  # a's prompt
    b = Request("b", list(range(100, 140)), params, max_tokens=30, eos_token_ids=frozenset({2}))
    sched.add(b)
    chunks = []
    while b.num_computed_tokens < b.num_prompt_tokens:  # b waits, then prefills in chunks beside a's decode
        out = sched.schedule()
        assert not any(c.draft_token_ids for c in out.chunks)
        chunks += [len(c.token_ids) for c in out.chunks if c.request_id == "b"]
        sched.update(out, model.run(out))
    assert chunks == [15, 15, 10] and asked == []  # each step's budget less a's one token: no guess took any
    out = sched.schedule()  # both decode now: the drafter is asked
    assert asked == [2] and all(len(c.draft_token_ids) == 3 for c in out.chunks)
    sched.update(out, model.run(out))
