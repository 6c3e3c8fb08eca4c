"""The KV manager a cache configuration asks for: the one place the engine and the simulator build it."""

from __future__ import annotations

from pagedllm.kvcache.contiguous import ContiguousKVCacheManager
from pagedllm.kvcache.manager import KVCacheManager


def make_kv_manager(cache, num_blocks: int, max_model_len: int, num_host_blocks: int = 0):
    """``ContiguousKVCacheManager`` for ``kv_layout="contiguous"`` (reserving per request as
    ``contiguous_reservation`` says), else the paged ``KVCacheManager``. ``cache``: a ``CacheConfig``."""
    if cache.kv_layout == "contiguous":
        return ContiguousKVCacheManager(num_blocks, cache.block_size, max_model_len, cache.contiguous_reservation)
    return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.eviction_policy,
                          num_host_blocks, cache.prefix_caching_hash_algo, cache.prefix_caching_hash_seed)
