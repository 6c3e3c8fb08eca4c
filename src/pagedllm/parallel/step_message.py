"""The plain message rank 0 sends every worker each step, and how a worker turns it back into the
``SchedulerOutput`` its model runner takes.

A worker needs, per scheduled chunk, its token ids, first position and block table, plus the
step's block copies and swaps. Block tables are sent as changes: ``StepEncoder`` (rank 0)
remembers the table each worker last saw for a request and sends only how much of it still holds
(``keep``) and the blocks after that (a decode that stays in its block sends none; copy-on-write or
a preemption's new table replaces the tail); ``released`` lists the requests the workers may
forget. ``StepDecoder`` (each worker) keeps the same tables. Token ids are a chunk's own: a
prompt's ids travel once, in the chunks that compute them, a decode's one id per step.
Tuples and lists of ints only: cheap to pickle, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput

# (request id, token ids, start position, table entries kept, table entries after them, how many of
# the token ids are speculative guesses: the chunk is then laid out as decode rows, on every rank alike)
ChunkMessage = tuple[str, list[int], int, int, list[int], int]


@dataclass
class StepMessage:
    chunks: list[ChunkMessage] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    stop: bool = False  # the engine is shutting down: the worker leaves its loop
    report: bool = False  # after the step, each rank gives how many block tables it holds (an all-gather)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StepEncoder:
    """Rank 0: a ``SchedulerOutput`` -> the ``StepMessage`` for the workers."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}  # what the workers hold for each request

    def encode(self, out: SchedulerOutput, live: set[str] | None = None) -> StepMessage:
        """``live``: the requests still known to the scheduler; the others' tables are released."""
        msg = StepMessage(copies=list(out.copies), swap_out=list(out.swap_out), swap_in=list(out.swap_in))
        for c in out.chunks:
            known = self.tables.get(c.request_id, [])
            keep = _common_prefix(known, c.block_ids) if known else 0
            msg.chunks.append((c.request_id, list(c.token_ids), c.start_pos, keep, list(c.block_ids[keep:]),
                               len(c.draft_token_ids)))
            self.tables[c.request_id] = list(c.block_ids)
        if live is not None:
            msg.released = [rid for rid in self.tables if rid not in live]
            for rid in msg.released:
                del self.tables[rid]
        return msg


class StepDecoder:
    """A worker: a ``StepMessage`` -> the ``SchedulerOutput`` its runner executes (nothing samples)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        chunks = []
        for rid, token_ids, start_pos, keep, tail, num_guesses in msg.chunks:
            table = self.tables.get(rid, [])[:keep] + tail
            self.tables[rid] = table
            guesses = token_ids[len(token_ids) - num_guesses:] if num_guesses else []
            chunks.append(ScheduledChunk(rid, token_ids, start_pos, table, sample=False, draft_token_ids=guesses))
        for rid in msg.released:
            self.tables.pop(rid, None)
        return SchedulerOutput(chunks=chunks, copies=msg.copies, swap_out=msg.swap_out, swap_in=msg.swap_in)
