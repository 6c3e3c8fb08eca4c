"""Both KV managers implement ``KVCacheManagerProtocol``, the interface the scheduler is typed with."""

from __future__ import annotations

import inspect

import pytest

from pagedllm.kvcache import ContiguousKVCacheManager, KVCacheManager, KVCacheManagerProtocol

MANAGERS = [KVCacheManager(num_blocks=8, block_size=8),
            ContiguousKVCacheManager(num_blocks=8, block_size=8, max_model_len=32)]
METHODS = sorted(name for name, value in vars(KVCacheManagerProtocol).items()
                 if inspect.isfunction(value) and not name.startswith("_"))
PROPERTIES = sorted(name for name, value in vars(KVCacheManagerProtocol).items() if isinstance(value, property))
ATTRIBUTES = sorted(KVCacheManagerProtocol.__annotations__)


def test_the_protocol_lists_what_the_scheduler_calls():
    assert {"allocate_slots", "cached_prefix", "record_prefix_query", "cache_full_blocks", "fork", "take_copies",
            "begin_step", "swap_out", "swap_in", "take_swaps", "block_ids", "free", "choose_victim",
            "record_preemption", "stats", "check_invariants", "max_blocks_for_request",
            "blocks_for_tokens"} <= set(METHODS)
    assert set(PROPERTIES) == {"num_blocks", "num_free_blocks", "num_cow_copies"}
    assert set(ATTRIBUTES) == {"layout", "block_size", "enable_prefix_caching", "tables", "num_preemptions", "events"}


@pytest.mark.parametrize("kv", MANAGERS, ids=lambda kv: kv.layout)
def test_each_manager_satisfies_the_protocol(kv):
    assert isinstance(kv, KVCacheManagerProtocol)
    for name in METHODS:
        expected = inspect.signature(getattr(KVCacheManagerProtocol, name))
        got = inspect.signature(getattr(type(kv), name))
        assert list(got.parameters) == list(expected.parameters), name
        assert [p.default for p in got.parameters.values()] == [p.default for p in expected.parameters.values()], name
    for name in PROPERTIES + ATTRIBUTES:
        assert hasattr(kv, name), name
    assert isinstance(kv.num_blocks, int) and isinstance(kv.num_free_blocks, int)


def test_an_object_missing_one_method_is_not_a_manager():
    class NoSwapIn(ContiguousKVCacheManager):
        swap_in = None  # a non-callable member does not satisfy the protocol

    assert not isinstance(NoSwapIn(num_blocks=8, block_size=8, max_model_len=32), KVCacheManagerProtocol)
