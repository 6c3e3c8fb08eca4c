"""Trace generators and the JSONL trace format: seeded, with the promised length statistics,
sharing, arrivals, and precise errors for bad files."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from pagedllm.workloads.traces import (
    CHAT_SYSTEM_PROMPT_LEN,
    CODE_HEADER_LEN,
    TraceError,
    TraceRequest,
    make_trace,
    prompt_token_ids,
    read_trace,
    write_trace,
)


def test_same_seed_same_trace_other_seed_other_trace():
    for workload in ("sharegpt", "alpaca", "chat", "code"):
        assert make_trace(workload, 50, rate=2.0, seed=1) == make_trace(workload, 50, rate=2.0, seed=1)
        assert make_trace(workload, 50, rate=2.0, seed=1) != make_trace(workload, 50, rate=2.0, seed=2)


@pytest.mark.parametrize("workload,prompt_mean,output_mean", [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_length_means_match_the_vllm_papers_datasets(workload, prompt_mean, output_mean):
    trace = make_trace(workload, 4000, seed=0)
    assert len(trace) == 4000
    assert statistics.mean(r.prompt_len for r in trace) == pytest.approx(prompt_mean, rel=0.12)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(output_mean, rel=0.12)
    # log-normal: a long right tail, the median well under the mean
    assert statistics.median(r.prompt_len for r in trace) < 0.95 * prompt_mean


def test_chat_conversations_share_the_system_prompt_and_grow_past_2000_tokens():
    trace = make_trace("chat", 600, rate=1.0, seed=0)
    assert len(trace) == 600
    assert statistics.mean(r.prompt_len for r in trace) > 2000
    assert all(r.prefix_id == "system" and r.prefix_len == CHAT_SYSTEM_PROMPT_LEN for r in trace)
    by_conversation: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_conversation.setdefault(r.conversation, []).append(r)
    assert len(by_conversation) > 20
    for turns in by_conversation.values():
        assert [r.turn for r in turns] == list(range(len(turns)))  # in order of arrival
        for a, b in itertools.pairwise(turns):
            assert b.arrival > a.arrival
            assert b.prompt_len - a.prompt_len - a.output_len >= 4  # the last answer, then a new user message
            ids_a, ids_b = prompt_token_ids(a, 1000, 0), prompt_token_ids(b, 1000, 1)
            assert ids_b[:len(ids_a)] == ids_a  # turn k + 1 starts with turn k's prompt
    firsts = [turns[0] for turns in by_conversation.values()]
    a, b = prompt_token_ids(firsts[0], 1000, 0), prompt_token_ids(firsts[1], 1000, 1)
    n = CHAT_SYSTEM_PROMPT_LEN
    assert a[:n] == b[:n] and a[n:] != b[n:]


def test_code_completions_have_800_token_contexts_short_outputs_and_shared_headers():
    trace = make_trace("code", 2000, seed=0)
    assert statistics.mean(r.prompt_len for r in trace) == pytest.approx(800, rel=0.05)
    assert statistics.mean(r.output_len for r in trace) < 50
    repos = {r.prefix_id for r in trace}
    assert 2 <= len(repos) <= 8
    same = [r for r in trace if r.prefix_id == trace[0].prefix_id][:2]
    ids = [prompt_token_ids(r, 5000, i) for i, r in enumerate(same)]
    assert ids[0][:CODE_HEADER_LEN] == ids[1][:CODE_HEADER_LEN] and ids[0][CODE_HEADER_LEN:] != ids[1][CODE_HEADER_LEN:]
    assert all(len(x) == r.prompt_len and min(x) >= 100 for x, r in zip(ids, same, strict=True))


def test_poisson_arrivals_at_the_rate_and_all_at_once_when_infinite():
    trace = make_trace("sharegpt", 3000, rate=4.0, seed=3)
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(trace)]
    assert min(gaps) >= 0 and statistics.mean(gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.12)  # exponential: sd = mean
    assert {r.arrival for r in make_trace("alpaca", 20, rate=math.inf)} == {0.0}
    with pytest.raises(ValueError, match="rate must be positive"):
        make_trace("alpaca", 5, rate=0)
    with pytest.raises(ValueError, match="workload must be one of"):
        make_trace("sharegpt2", 5)


def test_jsonl_round_trip(tmp_path):
    trace = make_trace("chat", 40, rate=2.0, seed=0) + [TraceRequest(arrival=99.0, prompt="Hello there", output_len=3)]
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) >= {"arrival", "prompt_len", "output_len"} and "prompt" not in first  # defaults left out
    assert read_trace(path) == sorted(trace, key=lambda r: r.arrival)


@pytest.mark.parametrize("line,message", [
    ("{not json", "line 2: not JSON"),
    ('{"arrival": 0, "output_len": 4}', "line 2: .*give prompt or prompt_len"),
    ('{"arrival": -1, "prompt_len": 4, "output_len": 4}', "line 2: arrival: Input should be greater than or equal"),
    ('{"arrival": 0, "prompt_len": 4, "output_len": 0}', "line 2: output_len"),
    ('{"arrival": 0, "prompt_len": 4, "output_len": 4, "colour": 1}', "line 2: colour: Extra inputs"),
    ('{"arrival": 0, "prompt_len": 4, "output_len": 4, "prefix_id": "p", "prefix_len": 9}', "longer than prompt_len"),
])
def test_bad_trace_lines_are_named_with_the_problem(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 4, "output_len": 4}\n' + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)
