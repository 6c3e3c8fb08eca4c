"""Synthetic workloads: N requests with prompt and output lengths drawn from ranges (seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"32:512"`` -> (32, 512)."""
    try:
        lo, _, hi = text.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError as e:
        raise ValueError(f"{name} must look like 128 or 32:512, got {text!r}") from e
    if a < 1 or b < a:
        raise ValueError(f"{name} must be positive with min <= max, got {text!r}")
    return a, b


def random_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0, first_token: int = 100) -> list[BenchRequest]:
    """Random token-id prompts (ids from ``first_token`` up, avoiding special tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        ids = [rng.randrange(first_token, vocab_size) for _ in range(n)]
        out.append(BenchRequest(ids, rng.randint(*output_len)))
    return out
