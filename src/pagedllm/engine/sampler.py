"""Sampler: next token ids (and log-probabilities) from a batch of logits, vectorised over rows.

Order, as in vLLM: the grammar bitmask of structured-output rows (``GrammarBitmask``: tokens it
disallows set to -inf; rows without a grammar untouched, and no work at all without one), logits
processors (``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias``), then penalties
(repetition on prompt + output tokens; frequency and presence on output tokens), then greedy rows
take the arg-max, sampling rows apply temperature, min-p, top-k, top-p and draw with the
exponential race ``argmax(p / E)``, ``E = -log U`` from the request's own ``torch.Generator``
(``draw``; so a seeded request gives the same tokens alone or in any batch).
Log-probabilities are those of the model's raw distribution (vLLM's default ``raw_logprobs``).
Every tensor stays on the logits' device. Rows that use none of a feature cost nothing for it.
Between steps the sampler keeps only scratch buffers (the bitmask applier's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.engine.request import Request
from pagedllm.engine.structured_output import BitmaskApplier, GrammarBitmask


@dataclass
class TokenLogprobs:
    """Log-probabilities (raw distribution) at one position: of the chosen token and the top k."""

    token_id: int
    logprob: float
    rank: int                          # 1 = the most likely token
    top: list[tuple[int, float]]       # (token id, logprob), most likely first
    top_ranks: list[int] | None = None  # each top entry's rank, where top is not the top k (logprob_token_ids)


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [rows, n] -> int64 [rows]: each row's first largest


def row_argmax(x: torch.Tensor, argmax: Argmax | None = None) -> list[int]:
    """Each row's first index of its largest value, as ``argmax(dim=-1)`` (both take the first
    index of a tie), through ``argmax`` where given (the model's layer ops: on CPU our one-pass
    kernel), else ``max``, whose reduction is faster than ``argmax``'s on the CPUs measured
    (docs/design.md, "Figures behind the code's choices")."""
    return (argmax(x) if argmax is not None else x.max(dim=-1).indices).tolist()


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None], argmax: Argmax | None = None) -> list[int]:
    """One token per row of ``probs`` by the exponential race ``argmax(p / E)``, ``E = -log U`` with
    ``U`` uniform from the row's generator. The race, unlike inverse transform sampling, keeps its
    pick when the probabilities move by rounding (a recomputed prefix, another batch shape): the
    leader changes only if another token's ratio overtakes it, not whenever a cumulative sum crosses
    ``U``. ``uniform_`` and one batched ``log_`` cost less than ``exponential_``, which drew the
    noise before (figures: docs/design.md). A ``U`` of exactly 0 gives ``E = inf``: that token loses."""
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].uniform_(generator=g)
    return row_argmax(probs / noise.log_().neg_(), argmax)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, ids in enumerate(token_lists):
            padded[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on logits [R, V]: repetition divides positive / multiplies negative logits of
    every token seen in the prompt or output; frequency subtracts ``f * count`` and presence ``p`` for
    every token in the output. ``presence``/``frequency``/``repetition``: [R] tensors."""
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab, logits.device)
    if bool((repetition != 1.0).any()):
        seen = (token_counts(prompt_ids, vocab, logits.device) > 0) | (out_counts > 0)
        rep = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * out_counts - presence.unsqueeze(1) * (out_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely one's. [R, V], [R]."""
    probs = logits.softmax(-1)
    drop = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(drop, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the tokens at least as likely as the k-th (``top_k`` <= 0: all) and then the
    smallest prefix of the remaining ones whose mass reaches ``top_p`` (the top token always stays).
    logits [R, V]; top_k [R] long; top_p [R] float."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((top_p >= 1.0).all()):
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    ordered, order = logits.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    # drop a token when the mass strictly before it already reaches top_p (rows with p = 1 drop none)
    p = torch.where(top_p >= 1.0, 2.0, top_p).unsqueeze(1)
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def banned_tokens(req: Request) -> list[int]:
    """Token ids a request may not produce next: bad words whose prefix its output ends with, and
    EOS / stop tokens while it has fewer than ``min_tokens`` output tokens."""
    params = req.sampling_params
    out = req.output_token_ids
    banned = []
    for word in req.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
            banned.append(word[-1])
    if len(out) < params.min_tokens:
        banned.extend(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(req.eos_token_ids)
    return banned


def apply_logits_processors(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``allowed_token_ids``, bad words, ``min_tokens``, ``logit_bias`` and penalties on [R, V] logits
    (one row per request)."""
    device = logits.device
    allowed_rows = [i for i, r in enumerate(reqs) if r.sampling_params.allowed_token_ids]
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), logits.shape[1], dtype=torch.bool)
        for j, i in enumerate(allowed_rows):
            keep[j, reqs[i].sampling_params.allowed_token_ids] = True
        rows = torch.tensor(allowed_rows, device=device)
        logits[rows] = logits[rows].masked_fill(~keep.to(device), float("-inf"))
    ban_rows, ban_ids, bias_rows, bias_ids, biases = [], [], [], [], []
    for i, r in enumerate(reqs):
        banned = banned_tokens(r)
        ban_rows += [i] * len(banned)
        ban_ids += banned
        for t, b in (r.sampling_params.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(t)
            biases.append(b)
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
                          torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device)] = float("-inf")
    pen_rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
    if pen_rows:
        rows = torch.tensor(pen_rows, device=device)
        ps = [reqs[i].sampling_params for i in pen_rows]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in ps], device=device, dtype=logits.dtype)

        logits[rows] = apply_penalties(logits[rows], [reqs[i].prompt_token_ids for i in pen_rows],
                                       [reqs[i].output_token_ids for i in pen_rows], column("presence_penalty"),
                                       column("frequency_penalty"), column("repetition_penalty"))
    return logits


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], k: int,
                named: Sequence[list[int] | None] | None = None) -> list[TokenLogprobs]:
    """Log-probabilities of ``token_ids[i]`` under row i of logits [R, V], with their ranks and the
    top ``k`` of each row; a row with ``named[i]`` (``logprob_token_ids``) gets those tokens, with
    their ranks, in place of its top ``k``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=logits.device, dtype=torch.long).unsqueeze(1)
    chosen = logp.gather(1, ids)
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if k:
        top_lp, top_ids = logp.topk(k, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp = top_ids = [[] for _ in token_ids]
    out = [TokenLogprobs(t, chosen[i], ranks[i], list(zip(top_ids[i], top_lp[i], strict=True)))
           for i, t in enumerate(token_ids)]
    for i, wanted in enumerate(named or ()):
        if wanted is not None:  # in the order given, each with its rank
            values = logp[i, torch.tensor(wanted, device=logits.device, dtype=torch.long)]
            out[i].top = list(zip(wanted, values.tolist(), strict=True))
            out[i].top_ranks = ((logp[i].unsqueeze(0) > values.unsqueeze(1)).sum(-1) + 1).tolist()
    return out


class Sampler:
    """Samples one token per row of a logits batch; ``argmax``: the row pick to use (``row_argmax``)."""

    def __init__(self, argmax: Argmax | None = None) -> None:
        self._masker = BitmaskApplier()
        self._argmax = argmax

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request], generators: Sequence[torch.Generator | None],
               grammar: GrammarBitmask | None = None) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """logits [S, V] (one row per request) -> S token ids, and logprobs for the rows whose
        request asked for them (keyed by row). ``grammar``: allowed tokens of the structured rows,
        masked in the caller's ``logits`` in place (unless those rows want logprobs). Logits in the
        model's dtype are widened to float32 first, unless every row only takes their arg-max
        (``takes_raw_argmax``): then the pick is read from them as they are, the same token, without
        a float32 copy of the batch (at batch 64, 64 x 49,152 logits of SmolLM2: 12 MiB)."""
        if logits.dtype != torch.float32 and (
                grammar is not None or not all(r.sampling_params.takes_raw_argmax for r in reqs)):
            logits = logits.float()
        raw = logits
        if grammar is not None:
            logits = self._apply_grammar(logits, reqs, grammar)
        processed = [i for i, r in enumerate(reqs) if r.sampling_params.has_logits_processors]
        if processed:
            if logits is raw:
                logits = logits.clone()
            rows = torch.tensor(processed, device=logits.device)
            logits[rows] = apply_logits_processors(logits[rows], [reqs[i] for i in processed])
        tokens = self._choose(logits, reqs, generators)
        wanted = [i for i, r in enumerate(reqs) if r.sampling_params.wants_logprobs]
        if not wanted:
            return tokens, {}
        k = max((reqs[i].sampling_params.logprobs for i in wanted
                 if reqs[i].sampling_params.logprob_token_ids is None), default=0)
        named = [reqs[i].sampling_params.logprob_token_ids for i in wanted]
        lps = logprobs_of(raw[torch.tensor(wanted, device=raw.device)], [tokens[i] for i in wanted], k, named)
        out = {}
        for i, lp in zip(wanted, lps, strict=True):
            if reqs[i].sampling_params.logprob_token_ids is None:
                lp.top = lp.top[:reqs[i].sampling_params.logprobs]
            out[i] = lp
        return tokens, out

    def _apply_grammar(self, logits: torch.Tensor, reqs: Sequence[Request], grammar: GrammarBitmask) -> torch.Tensor:
        """Disallowed tokens of the rows whose request has a grammar -> -inf: in place, unless one of
        those rows still needs its raw values for logprobs (then on a copy)."""
        rows = [i for i, r in enumerate(reqs) if r.request_id in grammar.rows]
        if not rows:
            return logits
        if any(reqs[i].sampling_params.wants_logprobs for i in rows):
            logits = logits.clone()
        order = [grammar.rows[reqs[i].request_id] for i in rows]
        bitmask = grammar.bitmask if order == list(range(len(grammar.rows))) else grammar.bitmask[order]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        index = None if len(rows) == len(reqs) else torch.tensor(rows, device=logits.device)
        with torch.inference_mode():  # the model's logits are inference tensors: updated in place only here
            self._masker.apply(logits, bitmask, index)
        return logits

    def _choose(self, logits: torch.Tensor, reqs: Sequence[Request],
                generators: Sequence[torch.Generator | None]) -> list[int]:
        params = [r.sampling_params for r in reqs]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        out = row_argmax(logits, self._argmax) if len(sampled) < len(params) else [0] * len(params)
        if not sampled:
            return out
        device = logits.device
        ps = [params[i] for i in sampled]

        def column(values: list, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, device=device, dtype=dtype)

        sub = logits[column(sampled, torch.long)] / column([p.temperature for p in ps]).unsqueeze(1)
        if any(p.min_p > 0 for p in ps):
            sub = apply_min_p(sub, column([p.min_p for p in ps]))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
            sub = apply_top_k_top_p(sub, column([p.top_k for p in ps], torch.long), column([p.top_p for p in ps]))
        for i, t in zip(sampled, draw(sub.softmax(-1), [generators[i] for i in sampled], self._argmax), strict=True):
            out[i] = t
        return out
