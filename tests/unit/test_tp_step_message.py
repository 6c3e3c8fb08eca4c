"""Rank 0's per-step message: block tables travel as changes and come back whole on a worker."""

from __future__ import annotations

import pickle

import torch

from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedllm.parallel.step_message import StepDecoder, StepEncoder


def _step(*chunks, copies=(), swap_out=(), swap_in=()):
    return SchedulerOutput(chunks=[ScheduledChunk(*c, sample=True) for c in chunks], copies=list(copies),
                           swap_out=list(swap_out), swap_in=list(swap_in))


def test_tables_travel_as_changes_and_are_rebuilt_whole():
    enc, dec = StepEncoder(), StepDecoder()
    steps = [
        _step(("a", [1, 2, 3, 4, 5], 0, [7, 8]), ("b", [9], 0, [3])),        # new requests: whole tables
        _step(("a", [6], 5, [7, 8]), ("b", [10], 1, [3])),                 # decodes in their blocks: nothing new
        _step(("a", [11], 6, [7, 8, 12]), copies=[(3, 4)]),                  # a grows a block; a copy
        _step(("a", [13], 7, [7, 9, 12])),                                  # copy-on-write replaced block 8
        _step(("c", [1, 2], 0, [7, 20]), swap_out=[(5, 0)], swap_in=[(1, 6)]),  # c shares a's first block
    ]
    live = [{"a", "b"}, {"a", "b"}, {"a", "b"}, {"a"}, {"a", "c"}]
    sent = []
    for out, alive in zip(steps, live, strict=True):
        msg = pickle.loads(pickle.dumps(enc.encode(out, alive)))  # what crosses the process boundary
        sent.append(msg)
        back = dec.decode(msg)
        assert [(c.request_id, c.token_ids, c.start_pos, c.block_ids) for c in back.chunks] == [
            (c.request_id, c.token_ids, c.start_pos, c.block_ids) for c in out.chunks]
        assert not any(c.sample for c in back.chunks)  # workers never sample
        assert (back.copies, back.swap_out, back.swap_in) == (out.copies, out.swap_out, out.swap_in)
    assert [(c[3], c[4]) for c in sent[1].chunks] == [(2, []), (1, [])]
    assert [(c[3], c[4]) for c in sent[2].chunks] == [(2, [12])]
    assert [(c[3], c[4]) for c in sent[3].chunks] == [(1, [9, 12])]
    assert sent[3].released == ["b"] and set(dec.tables) == {"a", "c"} == set(enc.tables)


def test_a_chunks_guesses_reach_the_workers_so_every_rank_lays_the_step_out_alike():
    """Rank 0 lays a chunk with speculative guesses out as decode rows, sorted with the decodes; a
    worker that saw it as a prefill chunk would sort it after them and its all-reduces would add
    other rows' partial sums (the guesses were once dropped from the message)."""
    from pagedllm.engine.model_runner import build_metadata

    guessed = ScheduledChunk("a", [5, 6, 7, 8], 20, [0, 1], True, draft_token_ids=[6, 7, 8])
    plain = ScheduledChunk("b", [9], 30, [2, 3], True)
    out = SchedulerOutput(chunks=[guessed, plain])
    decoded = StepDecoder().decode(StepEncoder().encode(out))
    assert [c.draft_token_ids for c in decoded.chunks] == [[6, 7, 8], []]
    rank0 = build_metadata(out.chunks, 16, torch.device("cpu"))
    worker = build_metadata(decoded.chunks, 16, torch.device("cpu"))
    assert rank0[2].seq_lens_list == worker[2].seq_lens_list == [21, 22, 23, 24, 31]
    assert rank0[2].num_decodes == worker[2].num_decodes == 5
