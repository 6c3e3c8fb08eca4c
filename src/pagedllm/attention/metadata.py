"""AttentionMetadata: everything a backend needs for one step, built once per step.

The batch is flat (no padding): ``num_tokens`` query rows, sequences laid out one after another,
decode sequences (one new token each) first, then prefill chunks. Built by the model runner and
passed explicitly to every layer: no globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat batch over the paged KV cache.

    slot_mapping:   [num_tokens] long; slot of each new token's K/V, -1 = padding (not written)
    query_start_loc:[num_seqs + 1] long; row offsets of each sequence's queries
    seq_lens:       [num_seqs] long; context length after this step (cached + new tokens)
    block_tables:   [num_seqs, max_blocks] int32/long; physical block ids (padded with 0)
    num_decodes:    how many leading sequences have exactly one query token
    Host-side copies (``*_list``) let a backend loop over sequences without device syncs.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    has_padding_slots: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)
