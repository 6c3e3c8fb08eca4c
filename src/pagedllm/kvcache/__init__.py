"""Control plane of the KV cache: plain Python, no torch.

Owns which physical block holds which tokens of which request. The data plane (``kvstore``)
owns the tensors; the two meet only through block ids and slot numbers
(``slot = block_id * block_size + offset``). The scheduler talks to one manager through
``KVCacheManagerProtocol``: ``KVCacheManager`` (paged) or ``ContiguousKVCacheManager`` (baseline).
"""

from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.block import Block, FreeBlockQueue
from pagedllm.kvcache.block_table import BlockTable
from pagedllm.kvcache.contiguous import ContiguousKVCacheManager
from pagedllm.kvcache.hashing import HASH_ALGOS, BlockHasher
from pagedllm.kvcache.interface import KVCacheManagerProtocol
from pagedllm.kvcache.manager import KVCacheManager

__all__ = ["HASH_ALGOS", "Block", "BlockAllocator", "BlockHasher", "BlockTable", "ContiguousKVCacheManager",
           "FreeBlockQueue", "KVCacheManager", "KVCacheManagerProtocol"]
