"""ModelRunner: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

Owns the model, the KV tensors (``KVCacheStorage``), the attention backend, the sampler and each
request's random generator. Sees block ids and token ids, never scheduling policy.
Per step it builds one ``AttentionMetadata`` (shared by every layer), lays the batch out flat
with decode sequences first, and computes logits only for rows that sample (and, for requests
asking for ``prompt_logprobs``, for their prompt rows).
"""

from __future__ import annotations

import itertools
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
    """What one step produced: the tokens of each sampling sequence (one; with speculative guesses,
    the accepted guesses and the model's next token), and their logprobs where asked."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> [(position p, logprobs of the prompt token at p + 1)]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)


class GuessPosition:
    """What the sampler reads of a request at the position after its first ``j`` speculative guesses:
    the request as if those guesses were its tokens (penalties, bad words, min_tokens count them);
    ``request_id`` is ``(id, j)``, its row in the grammar bitmask."""

    __slots__ = ("request_id", "sampling_params", "prompt_token_ids", "output_token_ids", "eos_token_ids",
                 "bad_words_token_ids")

    def __init__(self, req: Request, guesses: list[int], j: int) -> None:
        self.request_id = (req.request_id, j)
        self.sampling_params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = req.output_token_ids + guesses[:j]
        self.eos_token_ids = req.eos_token_ids
        self.bad_words_token_ids = req.bad_words_token_ids


def accepted_prefix(sampled: list[int], guesses: list[int]) -> int:
    """How many leading guesses equal the tokens sampled at their positions."""
    n = 0
    while n < len(guesses) and sampled[n] == guesses[n]:
        n += 1
    return n


PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into logits at a time (bounds the [rows, vocab] tensor)


def build_metadata(chunks: list[ScheduledChunk], block_size: int, device: torch.device):
    """Flat inputs and attention metadata for chunks already ordered decode-first.

    A chunk with speculative guesses is laid out as one-token sequences, one per position (its
    block table each time): each row then attends exactly as a decode step at that position would
    (the same kernel over the same stored K/V, which the step stores for every row before any row
    attends), so verifying a guess computes what decoding it would have."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens = []
    tables = []
    num_decodes = 0
    max_blocks = max(len(c.block_ids) for c in chunks)
    for c in chunks:
        input_ids.extend(c.token_ids)
        start, end = c.start_pos, c.seq_len
        positions.extend(range(start, end))
        slots.extend(slot_mapping(c.block_ids, block_size, start, end))
        table = c.block_ids + [0] * (max_blocks - len(c.block_ids))
        pieces = range(start + 1, end + 1) if c.draft_token_ids else (end,)
        for seq_end in pieces:
            if c.num_tokens == 1 or c.draft_token_ids:
                num_decodes += num_decodes == len(seq_lens)
            qsl.append(qsl[-1] + (1 if c.draft_token_ids else c.num_tokens))
            seq_lens.append(seq_end)
            tables.append(table)

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
        self.sampler = Sampler(model.layer_ops.row_argmax)
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
        chunks, hidden, _ = ran
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))  # each chunk's rows end here
        for i, c in enumerate(chunks):
            req = requests[c.request_id]
            if req.sampling_params.prompt_logprobs is not None and c.start_pos < req.num_prompt_tokens - 1:
                result.prompt_logprobs[c.request_id] = self._prompt_logprobs(hidden, ends[i] - c.num_tokens, c, req)
        # one logits row per sampling chunk; parallel-sampling siblings draw from the same row; a
        # chunk with guesses samples at the position of its last known token and of each guess
        rows, reqs, gens = [], [], []
        guessed: list[tuple[Request, list[int], int]] = []  # (request, guesses, its first row)
        for i, c in enumerate(chunks):
            if not c.sample:
                continue
            end = ends[i]
            if c.draft_token_ids:
                req, k = requests[c.request_id], len(c.draft_token_ids)
                guessed.append((req, c.draft_token_ids, len(rows)))
                gen = self._generator(req)
                for j in range(k + 1):
                    rows.append(end - 1 - k + j)
                    reqs.append(req if j == 0 else GuessPosition(req, c.draft_token_ids, j))
                    gens.append(gen)
                continue
            for rid in (c.request_id, *c.fork_ids):
                rows.append(end - 1)
                reqs.append(requests[rid])
                gens.append(self._generator(requests[rid]))
        if not rows:
            return result
        # a guessing request's generator draws once per row, as it would over as many steps; what the
        # rejected rows drew is given back (the state restored, then advanced by the rows kept)
        states = {req.request_id: g.get_state() for req, _, first in guessed if (g := gens[first]) is not None}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)], widen=False)
        tokens, logprobs = self.sampler.sample(logits, reqs, gens, grammar)
        skip = set()
        for req, guesses, first in guessed:
            k = len(guesses)
            kept = accepted_prefix(tokens[first:first + k], guesses) + 1
            rid = req.request_id
            result.tokens[rid] = tokens[first:first + kept]
            if first in logprobs:
                result.logprobs[rid] = [logprobs[first + j] for j in range(kept)]
            if kept <= k and rid in states:
                self._replay(gens[first], states[rid], kept, logits.shape[1])
            skip.update(range(first, first + k + 1))
        for i, r in enumerate(reqs):
            if i not in skip:
                result.tokens[r.request_id] = [tokens[i]]
                if i in logprobs:
                    result.logprobs[r.request_id] = [logprobs[i]]
        return result

    def _replay(self, generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab: int) -> None:
        """Set ``generator`` to ``state`` advanced by ``num_draws`` of the sampler's draws (one
        ``uniform_`` over a vocabulary row each, as ``sampler.draw``)."""
        generator.set_state(state)
        row = torch.empty(vocab, device=self.device)
        for _ in range(num_draws):
            row.uniform_(generator=generator)

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
        # stable: decodes (and verifications, laid out as decodes) first
        chunks = sorted(out.chunks, key=lambda c: c.num_tokens != 1 and not c.draft_token_ids)
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
