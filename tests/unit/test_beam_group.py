"""BeamGroup's selection rule on the real (torch-free) scheduler with crafted log-probabilities:
every EOS candidate completes, and ``beam_width`` non-EOS candidates stay live (vLLM's rule)."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.engine.beam_search import BeamGroup, BeamSearchParams
from pagedllm.engine.request import RequestStatus
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kvcache import KVCacheManager

EOS = 2


def computed_group(width: int, max_tokens: int = 5) -> tuple[BeamGroup, Scheduler]:
    sched = Scheduler(SchedulerConfig(8, 64, 128), KVCacheManager(32, 8))
    group = BeamGroup("g", None, [10, 11, 12], BeamSearchParams(beam_width=width, max_tokens=max_tokens),
                      frozenset({EOS}), 0.0)
    group.start(sched)
    out = sched.schedule()  # the prompt is computed; the beam waits for the group's choice
    sched.update(out, {c.request_id: 0 for c in out.chunks})
    return group, sched


def deliver(group: BeamGroup, tops: dict[str, list[tuple[int, float]]]) -> None:
    for rid, top in tops.items():
        group.deliver(rid, TokenLogprobs(top[0][0], top[0][1], 1, top))


def test_eos_candidates_complete_without_taking_a_live_slot():
    group, sched = computed_group(width=2)
    (root,) = group.live
    deliver(group, {root: [(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)]})
    assert group.step(sched) == []
    assert [(s.tokens, s.cum_logprob, s.finish_reason) for s in group.done] == [([10, 11, 12, EOS], -0.1, "stop")]
    assert sorted((b.request.output_token_ids, b.cum_logprob) for b in group.live.values()) == [([5], -0.2),
                                                                                                  ([6], -0.3)]
    assert all(b.request.status is RequestStatus.RUNNING for b in group.live.values())
    sched.kv.check_invariants()


def test_every_eos_candidate_of_every_beam_completes_and_the_best_width_continue():
    group, sched = computed_group(width=2)
    (root,) = group.live
    deliver(group, {root: [(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)]})
    group.step(sched)
    a, b = sorted(group.live, key=lambda r: group.live[r].cum_logprob, reverse=True)
    deliver(group, {a: [(EOS, -0.05), (9, -1.0), (EOS + 1, -1.1), (4, -5.0)],
                    b: [(EOS, -0.5), (9, -0.6), (3, -0.7), (4, -6.0)]})
    left = group.step(sched)
    assert sorted(s.tokens[-2:] for s in group.done) == [[5, EOS], [6, EOS]]
    # non-EOS: b+9 (-0.8) and b+3 (-0.9) beat a+9 (-1.1): b continues twice (a fork), a is dropped
    assert sorted(b.request.output_token_ids for b in group.live.values()) == [[6, 3], [6, 9]]
    assert left == [a] and a not in sched.requests
    sched.kv.check_invariants()


def test_beams_not_kept_leave_the_scheduler_and_max_tokens_completes_with_length():
    group, sched = computed_group(width=2, max_tokens=2)
    (root,) = group.live
    deliver(group, {root: [(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)]})
    group.step(sched)
    a, b = sorted(group.live, key=lambda r: group.live[r].cum_logprob, reverse=True)
    deliver(group, {a: [(9, -0.1), (3, -0.2), (4, -0.3), (4, -0.4)], b: [(9, -5.0), (3, -6.0), (4, -7.0), (8, -8.0)]})
    left = group.step(sched)
    assert b in left and not group.live and group.finished  # b's candidates lost; a's two reached max_tokens
    assert sorted((s.tokens[3:], s.finish_reason) for s in group.ranked()) == [([5, 3], "length"),
                                                                                ([5, 9], "length")]
    assert not sched.requests and sched.kv.num_free_blocks == sched.kv.num_blocks
