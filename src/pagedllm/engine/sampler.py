"""Sampler: next token ids from logits, per request parameters.

Greedy rows take the arg-max. Other rows: temperature, then top-k, then top-p (nucleus), then a
draw from the request's own ``torch.Generator`` (seeded from ``SamplingParams.seed`` when given,
else from the engine seed and the request's arrival order), so a seeded request gives the same
tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row [V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top one stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class TokenLogprobs:
    """Log-probabilities (of the model's raw distribution) at one generated position."""

    token_logprob: float                 # of the token that was generated
    top: dict[int, float]                # the k most likely tokens (k = SamplingParams.logprobs)


class Sampler:
    """Samples one token per row of a logits batch."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None],
               ) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """logits [S, V] float32 -> S token ids, and logprobs for the rows that asked for them."""
        tokens = self._choose(logits, params, generators)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return tokens, {}
        logp = torch.log_softmax(logits[wanted], dim=-1)
        k = max(params[i].logprobs for i in wanted)
        top_lp, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
        chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in wanted])).squeeze(1).tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out = {}
        for j, i in enumerate(wanted):
            n = params[i].logprobs
            out[i] = TokenLogprobs(chosen[j], dict(zip(top_ids[j][:n], top_lp[j][:n], strict=True)))
        return tokens, out

    def _choose(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
        greedy_ids = logits.argmax(dim=-1).tolist()
        out = []
        for i, p in enumerate(params):
            if p.greedy:
                out.append(greedy_ids[i])
                continue
            row = logits[i] / p.temperature
            row = apply_top_k_top_p(row, p.top_k, p.top_p)
            probs = row.softmax(-1)
            # Gumbel-max equivalent: argmax(p / E), E ~ Exp(1), drawn from the request's generator
            noise = torch.empty_like(probs).exponential_(generator=generators[i])
            out.append(int((probs / noise).argmax()))
        return out
