"""``pagedllm simulate --replicas N --routing ...``: replicas behind the routing policies on one
virtual clock; every request is accounted for, round-robin alternates, and on a multi-turn chat
trace the prefix-aware router finds cached prefixes that the load-only policies scatter."""

from __future__ import annotations

import json

from pagedllm.cli import main


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
