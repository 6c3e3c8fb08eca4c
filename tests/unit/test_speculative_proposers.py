"""The guess proposers (n-gram lookup, suffix trees) and the drafter's per-step choice (torch-free)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.request import Request
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.speculative import drafter as drafter_module
from pagedllm.engine.speculative.drafter import Drafter, best_extra_rows, step_cost
from pagedllm.engine.speculative.ngram import NgramProposer
from pagedllm.engine.speculative.suffix import SuffixProposer, SuffixTree


def ngram_reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Brute force: the longest n (hi..lo) whose last n tokens occurred earlier; the latest such."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_takes_the_longest_match_and_its_latest_occurrence():
    p = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # "1 2 3" (n = 3) occurred at 0: what followed it; not the later "2 3" (n = 2) match
    assert p.propose("a", tokens, 4) == [9, 2, 3, 8]
    assert p.propose("b", [5, 6, 5, 7, 5], 2) == [7, 5]  # "5" latest at 2, not at 0
    assert p.propose("c", [1, 2, 3, 4], 3) == []
    assert p.propose("d", [4, 4], 0) == []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 60), max_size=4),
       lo=st.integers(1, 3), extra=st.integers(0, 2), k=st.integers(1, 6))
def test_ngram_index_grown_step_by_step_equals_brute_force(tokens, cuts, lo, extra, k):
    p = NgramProposer(lo, lo + extra)
    for cut in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        assert p.propose("r", tokens[:cut], k) == ngram_reference(tokens[:cut], lo, lo + extra, k)
    p.finish("r", [])
    assert len(p) == 0


def substrings(seqs, depth):
    counts = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def tree_counts(tree):
    out = {}

    def walk(node, path):
        for t, c in tree.children(node).items():
            out[path + (t,)] = tree.count(c)
            walk(c, path + (t,))
    walk(tree.root, ())
    return out


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4),
       depth=st.integers(1, 6), cut=st.integers(0, 30))
def test_suffix_tree_counts_every_substring_and_removal_undoes_it(seqs, depth, cut):
    tree = SuffixTree(depth)
    for s in seqs[:-1]:
        tree.add(s)
    last = seqs[-1]
    active = tree.add(last, 0, min(cut, len(last)))
    tree.add(last, min(cut, len(last)), None, active)  # in two pieces: as if at once
    assert tree_counts(tree) == substrings(seqs, depth)
    assert tree.num_nodes == len(substrings(seqs, depth))
    tree.remove(seqs[0])
    assert tree_counts(tree) == substrings(seqs[1:], depth)
    for s in seqs[1:]:
        tree.remove(s)
    assert tree.children(tree.root) == {} and tree.num_nodes == 0


def test_a_suffix_tree_is_invisible_to_the_garbage_collector():
    """The global tree holds up to millions of nodes for the server's life: kept in containers of
    plain ints, no full collection walks them (a Python object per node cost 391 ms per
    collection at 800,000 nodes: scripts/suffix_tree_gc.py)."""
    import gc

    sequences = [[(7 * i + j * j) % 50 for j in range(60)] for i in range(20)]
    gc.collect()
    before = len(gc.get_objects())
    tree = SuffixTree(8)
    for s in sequences:
        tree.add(s)
    tree.remove(sequences[0])
    assert tree.num_nodes > 3000
    assert len(gc.get_objects()) - before < 20  # a few arrays and a dict, whatever the node count


def test_suffix_guess_follows_the_most_frequent_continuation_and_stops_at_low_probability():
    tree = SuffixTree(8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 6]):
        tree.add(s)
    tokens, score = tree.guess([7, 1, 2], 5, max_spec_factor=2.0, min_token_prob=0.1)
    assert tokens == [3, 4]  # after "1 2": 3 (3 of 3), then 4 (2 of 3)
    assert score == pytest.approx(1.0 + 2 / 3)
    assert tree.guess([7, 1, 2], 5, 2.0, 0.7)[0] == [3]  # 2/3 < 0.7: stops before 4
    assert tree.guess([7, 1, 2], 5, 0.5, 0.1)[0] == [3]  # the pattern "1 2" has 2 tokens: 0.5 x 2 = 1 guess
    assert tree.guess([8], 5, 1.0, 0.1) == ([], 0.0)


def test_suffix_proposer_learns_from_earlier_requests_and_forgets_the_oldest():
    p = SuffixProposer(16, max_cached_requests=1, max_spec_factor=4.0, min_token_prob=0.1)
    answer = [40, 41, 42, 43, 44, 45]
    assert p.propose("a", [1, 2, 40, 41], 4) == []  # nothing seen yet
    p.finish("a", answer)
    assert p.propose("b", [7, 40, 41], 4) == [42, 43, 44, 45]  # from a's output
    p.finish("b", [60, 61, 62])  # queued: the tree changes on the next guess
    assert p.global_tree.num_nodes == len(substrings([answer], 16))
    assert p.propose("c", [7, 40, 41], 4) == []  # the global tree keeps 1 request: a's output left
    assert p.global_tree.num_nodes == len(substrings([[60, 61, 62]], 16))
    assert len(p) == 1  # c is live


def test_suffix_proposer_guesses_from_the_requests_own_tokens():
    p = SuffixProposer(24, 10, 1.0, 0.1)
    tokens = list(range(10)) * 3
    assert p.propose("a", tokens, 5) == [0, 1, 2, 3, 4]
    assert p.propose("a", tokens + [0, 1], 3) == [2, 3, 4]  # grown incrementally


# a fixed cost table, so the choices below test the rule, not the figures measured on one CPU
TABLE = (1.0, 1.07, 1.26, 1.43, 1.67, 1.92, 2.15, 2.44)


def test_step_cost_and_extra_rows_follow_the_table(monkeypatch):
    measured = drafter_module.STEP_COST
    assert list(measured) == sorted(measured) and measured[0] == 1.0  # more rows never cost less
    monkeypatch.setattr(drafter_module, "STEP_COST", TABLE)
    assert step_cost(1) == 1.0 and step_cost(0) == 1.0 and step_cost(4) == 1.43
    assert step_cost(len(TABLE) + 2) == pytest.approx(TABLE[-1] + 2 * (TABLE[-1] - TABLE[-2]))
    # one request: three sure guesses in 4 rows (1.43x one row's cost); a 5th row (+0.24) for 0.3 tokens does not pay
    assert best_extra_rows(1, [1.0, 1.0, 1.0, 0.3], None) == 3
    assert best_extra_rows(1, [0.1, 0.05], None) == 0  # guesses that are rarely right never pay
    # four requests (1.43): 3 guesses of 0.9 (2.15) give 6.7 / 2.15 = 3.12 tokens per unit, 1.11x the
    # plain 2.80; guesses of 0.6 give at most 2.71 (2 guesses), below it
    assert best_extra_rows(4, [0.9] * 4, None) == 3
    assert best_extra_rows(4, [0.6] * 4, None) == 0
    assert best_extra_rows(1, [1.0] * 7, 4) == 3  # at most 4 rows in all
    assert best_extra_rows(1, [1.0] * 7, None) == 7  # all sure: 8 rows carry 8 tokens for ~3 rows' cost


def make_request(rid, tokens, **params):
    return Request(rid, tokens, SamplingParams(max_tokens=64, **params), max_tokens=64)


def test_drafter_guesses_only_what_pays_and_stays_off_above_the_batch_size():
    d = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=7, disable_by_batch_size=2))
    looping = make_request("a", [1, 2, 3, 4] * 6)
    plan = d.plan_step([(looping, 10)], num_rows=1)
    assert 1 <= len(plan["a"]) <= 7 and plan["a"] == [1, 2, 3, 4, 1, 2, 3][:len(plan["a"])]
    assert d.plan_step([(looping, 10)], num_rows=3) == {}  # 3 running > disable_by_batch_size
    assert d.plan_step([(looping, 2)], num_rows=1)["a"] == [1, 2]  # its own limit
    opted_out = make_request("b", [1, 2, 3, 4] * 6, speculative_decoding=False)
    assert d.plan_step([(opted_out, 10)], num_rows=1) == {}
    d.row_limit = 2  # the small-step kernels' limit: 1 row + 1 guess
    assert len(d.plan_step([(looping, 10)], num_rows=1)["a"]) == 1


def test_drafter_learns_acceptance_and_probes_again_later():
    d = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=7))
    r = make_request("a", [5, 6, 7] * 8)
    for _ in range(6):  # every guess rejected: the rate falls until no guess pays
        plan = d.plan_step([(r, 10)], 1)
        if not plan:
            break
        d.record("a", len(plan["a"]), 0)
    assert d.plan_step([(r, 10)], 1) == {}
    probes = [bool(d.plan_step([(r, 10)], 1)) for _ in range(drafter_module.PROBE_INTERVAL + 1)]
    # two idle steps came before (the loop's last call and the one above): the rate returns to the
    # prior on the step whose idle count first exceeds PROBE_INTERVAL, and only then
    assert probes.index(True) == drafter_module.PROBE_INTERVAL - 2
    s = d.stats
    assert s.num_draft_tokens >= s.num_drafts > 0 and s.num_accepted_tokens == 0
    d.record("a", 4, 4)
    assert d.stats.accepted_per_position[:4] == [1, 1, 1, 1]
    assert d.stats.mean_accepted_length == pytest.approx(1 + 4 / d.stats.num_drafts)
    d.finish("a", r.output_token_ids)
    assert len(d) == 0


def test_drafter_cuts_guesses_where_the_constraint_rejects_them():
    d = Drafter(SpeculativeConfig(method="ngram"), validate=lambda rid, guesses: 2)
    plan = d.plan_step([(make_request("a", [1, 2, 3] * 5), 10)], 1)
    assert plan["a"] == [1, 2]


def test_speculative_config_is_validated():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="eagle")


def test_drafter_asks_no_proposer_when_even_full_guesses_cannot_pay():
    d = Drafter(SpeculativeConfig(method="suffix"))
    calls = []
    propose = d.proposer.propose
    d.proposer.propose = lambda rid, tokens, most: calls.append(rid) or propose(rid, tokens, most)
    four = [(make_request(str(i), [1, 2, 3, 4] * 6), 10) for i in range(4)]
    assert d.plan_step(four, num_rows=4) == {} and calls == []  # 4 rows: 5-8 cost too much at the prior
    assert d.plan_step(four[:1], num_rows=1) and calls == ["0"]  # one request: guessing pays
