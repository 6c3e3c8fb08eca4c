"""KV-cache events: what the prefix cache gains and loses, recorded as plain data in vLLM's schema
(``vllm.distributed.kv_events``), so a router that reads vLLM's stream (llm-d, Dynamo, Ray's KV
router, ``cluster/`` here) can read a pagedllm replica's.

- ``BlockStored``: full blocks entered the prefix cache: their hashes (a chain: each block's parent
  is the one before it, the first's is ``parent_block_hash``, None at a sequence's start), their
  token ids (``block_size`` per block), the LoRA id (always None here) and the medium ("CPU" or
  "GPU": where the pool lives);
- ``BlockRemoved``: cached blocks were evicted (reused for other content);
- ``AllBlocksCleared``: the prefix cache was reset.

A block is "cached" from the step its last token was computed until the allocator hands it out
again (a freed block stays hittable), so replaying the events in order rebuilds the set of cached
hashes exactly (``KVEventLog`` asserts nothing about order: the manager records as it goes).
Hashes are the block hashes' digest bytes (``BlockHasher``), as vLLM sends its bytes by default.
No torch, no I/O: the engine hands each step's events to a publisher (``engine/kv_event_publisher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """The events recorded since the last ``take``; consecutive removals share one event."""

    medium: str | None = None
    events: list[KVEvent] = field(default_factory=list)

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        self.events.append(BlockStored(hashes, parent, token_ids, block_size, None, self.medium))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def replay(events, cached: set[bytes] | None = None) -> set[bytes]:
    """The set of cached block hashes after ``events`` (applied to ``cached``, or to an empty set)."""
    cached = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()
    return cached
