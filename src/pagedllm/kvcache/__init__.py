"""Control plane of the KV cache: plain Python, no torch.

Owns which physical block holds which tokens of which request. The data plane (``kvstore``)
owns the tensors; the two meet only through block ids and slot numbers
(``slot = block_id * block_size + offset``).
"""

from pagedllm.kvcache.allocator import BlockAllocator
from pagedllm.kvcache.block import Block, FreeBlockQueue
from pagedllm.kvcache.block_table import BlockTable
from pagedllm.kvcache.manager import KVCacheManager

__all__ = ["Block", "BlockAllocator", "BlockTable", "FreeBlockQueue", "KVCacheManager"]
