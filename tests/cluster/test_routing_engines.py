"""The prefix-aware policy over two real engines (in-process, no Ray): each replica's view is fed
by its engine's KV events and its own stats; the router hashes a prompt as the replicas do (one
cluster-wide ``prefix_caching_hash_seed``), sends a follow-up turn to the replica that served the
conversation, and to the other one once that replica's queue is over the threshold."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.cluster.routing import PrefixAware, ReplicaState, request_block_hashes
from pagedllm.kvcache.hashing import BlockHasher
from tests.conftest import make_tiny_checkpoint

SEED = 0x5EC12E7


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("replicas"), "llama", seed=6)
    out = []
    for name in ("a", "b"):
        llm = LLM(model=folder, dtype="float32", num_kv_blocks=64, prefix_caching_hash_seed=SEED)
        view = ReplicaState(name)
        llm.engine.enable_kv_event_log()
        llm.engine.kv_event_listeners.append(view.apply)
        out.append((llm, view))
    return out


def refresh(llm, view) -> None:
    """The replica's routing stats, as it reports them."""
    stats = llm.engine.stats()
    view.num_waiting, view.num_running = stats["num_requests_waiting"], stats["num_requests_running"]
    view.kv_usage = stats["num_used_blocks"] / stats["num_blocks"]


def test_a_follow_up_turn_follows_its_prefix_until_that_replica_is_overloaded(replicas):
    (a, view_a), (b, view_b) = replicas
    hasher = BlockHasher("xxh3_128", SEED)
    assert a.engine.kv_manager.hasher.seed == SEED
    turn1 = [1, *range(20, 67)]  # 48 tokens: 3 full blocks
    a.generate({"prompt_token_ids": [1, *range(300, 340)]}, SamplingParams(max_tokens=4), use_tqdm=False)
    out = b.generate({"prompt_token_ids": turn1}, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    follow_up = turn1 + list(out.outputs[0].token_ids) + list(range(400, 420))
    hashes = request_block_hashes(hasher, follow_up, 16)
    assert view_b.prefix_blocks(hashes) >= 3 and view_a.prefix_blocks(hashes) == 0
    policy = PrefixAware(load_threshold=4)
    for llm, view in replicas:
        refresh(llm, view)
    assert policy.choose(hashes, [view_a, view_b]) == 1
    for i in range(6):  # b gets a queue: six requests waiting, a has none
        b.engine.add_request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    for llm, view in replicas:
        refresh(llm, view)
    assert view_b.num_waiting == 6 and view_a.load == 0
    assert policy.choose(hashes, [view_a, view_b]) == 0
    assert policy.decisions == {"prefix": 1, "overloaded": 1, "short_prefix": 0, "no_prefix": 0}
    while b.engine.has_unfinished():
        b.engine.step()
