"""ModelRunner: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

Owns the model, the KV tensors (``KVCacheStorage``), the attention backend, the sampler and each
request's random generator. Sees block ids and token ids, never scheduling policy.
Per step it builds one ``AttentionMetadata`` (shared by every layer), lays the batch out flat
with decode sequences first, and computes logits only for rows that sample (and, for requests
asking for ``prompt_logprobs``, for their prompt rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sampler, TokenLogprobs, logprobs_of
from pagedllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedllm.engine.structured_output import GrammarBitmask
from pagedllm.kvcache.block_table import slot_mapping
from pagedllm.kvstore.host_tier import HostTier
from pagedllm.kvstore.storage import KVCacheStorage
from pagedllm.models.llama import LlamaForCausalLM


@dataclass
class StepResult:
    """What one step produced: a token per sampling sequence, and logprobs where asked."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> [(position p, logprobs of the prompt token at p + 1)]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)


PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into logits at a time (bounds the [rows, vocab] tensor)


def build_metadata(chunks: list[ScheduledChunk], block_size: int, device: torch.device):
    """Flat inputs and attention metadata for chunks already ordered decode-first."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens = []
    num_decodes = 0
    for c in chunks:
        if c.num_tokens == 1 and num_decodes == len(seq_lens):
            num_decodes += 1
        input_ids.extend(c.token_ids)
        start, end = c.start_pos, c.seq_len
        positions.extend(range(start, end))
        slots.extend(slot_mapping(c.block_ids, block_size, start, end))
        qsl.append(len(input_ids))
        seq_lens.append(end)
    max_blocks = max(len(c.block_ids) for c in chunks)
    tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots), query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables),
        num_decodes=num_decodes, query_start_loc_list=qsl, seq_lens_list=seq_lens)
    return t(input_ids), t(positions), meta


class ModelRunner:
    """Executes scheduled steps on one device."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCacheStorage, backend, device: torch.device,
                 host: HostTier | None = None) -> None:
        self.model = model
        self.kv = kv
        self.host = host
        self.backend = backend
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.sampling_params.greedy:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.sampling_seed)
            self._generators[req.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def recover(self) -> None:
        """After a failed step: wait for any block copy still running in the background, so the
        blocks of the failed requests can be freed and reused safely."""
        if self.host is not None:
            self.host.wait()

    def execute(self, out: SchedulerOutput, requests: dict[str, Request],
                grammar: GrammarBitmask | None = None) -> StepResult:
        """Run one step; returns the sampled token (and logprobs if asked) of every chunk that samples.
        ``grammar``: the allowed tokens of the sampling sequences that have a structured-output grammar."""
        ran = self.run_model(out)
        result = StepResult()
        if ran is None:
            return result
        chunks, hidden, meta = ran
        for i, c in enumerate(chunks):
            req = requests[c.request_id]
            if req.sampling_params.prompt_logprobs is not None and c.start_pos < req.num_prompt_tokens - 1:
                result.prompt_logprobs[c.request_id] = self._prompt_logprobs(hidden, meta.query_start_loc_list[i],
                                                                             c, req)
        # one logits row per sampling chunk; parallel-sampling siblings draw from the same row
        rows, reqs = [], []
        for i, c in enumerate(chunks):
            if c.sample:
                for rid in (c.request_id, *c.fork_ids):
                    rows.append(meta.query_start_loc_list[i + 1] - 1)
                    reqs.append(requests[rid])
        if not rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = self.sampler.sample(logits, reqs, [self._generator(r) for r in reqs], grammar)
        result.tokens = {r.request_id: tok for r, tok in zip(reqs, tokens, strict=True)}
        result.logprobs = {reqs[i].request_id: lp for i, lp in logprobs.items()}
        return result

    def run_model(self, out: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor, AttentionMetadata] | None:
        """The step's KV block moves (swap out, copies, swap in started), then the model over its
        chunks: (the chunks decode-first, their hidden states, the metadata), or None without chunks.
        What a tensor-parallel worker runs each step (``parallel/worker.py``): no sampling."""
        if self.host is not None:
            self.host.wait()  # blocks prefetched during the previous step are in place now
            if out.swap_out:
                self.host.swap_out(out.swap_out)
        if out.copies:
            self.kv.copy_blocks(out.copies)
        if out.swap_in:  # overlaps this step's forward; its requests compute next step
            self.host.start_swap_in(out.swap_in)
        if not out.chunks:
            return None
        chunks = sorted(out.chunks, key=lambda c: c.num_tokens != 1)  # stable: decodes first
        input_ids, positions, meta = build_metadata(chunks, self.kv.block_size, self.device)
        return chunks, self.model(input_ids, positions, meta, self.kv, self.backend), meta

    def _prompt_logprobs(self, hidden: torch.Tensor, first_row: int, chunk: ScheduledChunk,
                         req: Request) -> list[tuple[int, TokenLogprobs]]:
        """Log-probabilities of the prompt tokens that follow this chunk's positions."""
        end = min(chunk.seq_len, req.num_prompt_tokens - 1)  # position p predicts the token at p + 1
        out = []
        for lo in range(chunk.start_pos, end, PROMPT_LOGPROB_ROWS):
            hi = min(end, lo + PROMPT_LOGPROB_ROWS)
            rows = hidden[first_row + lo - chunk.start_pos:first_row + hi - chunk.start_pos]
            lps = logprobs_of(self.model.compute_logits(rows), req.prompt_token_ids[lo + 1:hi + 1],
                              req.sampling_params.prompt_logprobs)
            out.extend(zip(range(lo, hi), lps, strict=True))
        return out
