"""``pagedllm simulate --replicas N --routing ...``: replicas behind the routing policies on one
virtual clock; every request is accounted for, round-robin alternates, and on a multi-turn chat
trace the prefix-aware router finds cached prefixes that the load-only policies scatter."""

from __future__ import annotations

import json

from pagedllm.cli import main
from pagedllm.workloads.traces import TraceRequest, write_trace


def test_prefix_aware_routing_hits_more_cache_on_a_chat_trace(tmp_path):
    out = tmp_path / "replicas.json"
    assert main(["simulate", "--workload", "chat", "--num-requests", "120", "--rate", "2", "--model", "llama-2-7b",
                 "--device", "a100-80gb", "--replicas", "2", "--kv-memory", "4GiB", "--no-progress",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"prefix-aware", "power-of-two", "round-robin"}
    for r in results.values():
        assert r["finished"] + r["rejected"] == 120
        assert sum(r["requests_per_replica"]) == 120 - r["rejected"]
        assert max(r["peak_kv_blocks_per_replica"]) <= report["num_blocks_per_replica"]
    rr = results["round-robin"]["requests_per_replica"]
    assert abs(rr[0] - rr[1]) <= results["round-robin"]["rejected"] + 1
    aware, p2 = results["prefix-aware"], results["power-of-two"]
    assert aware["prefix_cache_hit_rate"] > p2["prefix_cache_hit_rate"]
    assert aware["decisions"]["prefix"] > 0 and sum(aware["decisions"].values()) == sum(aware["requests_per_replica"]) \
        + aware["rejected"]


def test_one_replica_is_the_plain_simulator(tmp_path, capsys):
    assert main(["simulate", "--workload", "alpaca", "--num-requests", "20", "--rate", "5", "--model", "llama-2-7b",
                 "--device", "a100-80gb", "--layout", "paged", "--no-progress"]) == 0
    assert "output tokens/s" in capsys.readouterr().out


def test_new_conversations_warm_every_replica_unless_the_match_rate_is_zero(tmp_path):
    """Every conversation opens with the same 64-token system prompt and a 96-token question (so the
    system prompt is 40% of a first turn); the next turns repeat the conversation so far. With
    ``--routing-min-match-rate 0`` the system prompt alone is prefix enough, and the replica that
    served the first conversation gets every new one while the other stays cold; with 0.5 (the
    default) a first turn goes to the least-loaded replica."""
    trace = [TraceRequest(arrival=10.0 * c + 3.0 * k, prompt_len=64 + 96 * (k + 1) + 24 * k, output_len=24,
                          prefix_id="system", prefix_len=64, conversation=f"c{c}", turn=k)
             for c in range(8) for k in range(3)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, sorted(trace, key=lambda r: r.arrival))
    served = {}
    for rate in ("0", "0.5"):
        out = tmp_path / f"replicas_{rate}.json"
        assert main(["simulate", "--trace", str(path), "--model", "llama-2-7b", "--device", "a100-80gb",
                     "--replicas", "2", "--kv-memory", "4GiB", "--routing", "prefix-aware",
                     "--routing-min-match-rate", rate, "--no-progress", "--json", str(out)]) == 0
        served[rate] = json.loads(out.read_text())["results"]["prefix-aware"]
    assert sorted(served["0"]["requests_per_replica"]) == [0, 24]
    assert served["0"]["decisions"] == {"prefix": 23, "overloaded": 0, "short_prefix": 0, "no_prefix": 1}
    assert min(served["0.5"]["requests_per_replica"]) >= 3  # both serve: the replicas are idle when a
    # conversation opens, so its first turn goes to one drawn at random (seeded)
    assert served["0.5"]["decisions"] == {"prefix": 16, "overloaded": 0, "short_prefix": 7, "no_prefix": 1}


def test_the_load_threshold_reaches_the_simulated_router_and_bad_settings_are_refused(tmp_path, capsys):
    common = ["simulate", "--workload", "chat", "--num-requests", "120", "--rate", "2", "--model", "llama-2-7b",
              "--device", "a100-80gb", "--replicas", "2", "--kv-memory", "4GiB", "--routing", "prefix-aware",
              "--no-progress"]
    overloaded = {}
    for threshold in ("4", "0"):
        out = tmp_path / f"t{threshold}.json"
        assert main([*common, "--routing-load-threshold", threshold, "--json", str(out)]) == 0
        overloaded[threshold] = json.loads(out.read_text())["results"]["prefix-aware"]["decisions"]["overloaded"]
    assert overloaded["0"] > overloaded["4"]  # a holder any busier than the other replica loses the request
    capsys.readouterr()
    assert main([*common, "--routing-min-match-rate", "2"]) == 2
    assert "--routing-min-match-rate must be between 0 and 1, got 2.0" in capsys.readouterr().err
    assert main([*common, "--routing-load-threshold", "-1"]) == 2
    assert "--routing-load-threshold must be 0 or more, got -1" in capsys.readouterr().err
