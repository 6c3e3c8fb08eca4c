"""Prompt lookup (vLLM's ``ngram`` method): the request's last n tokens, looked up among its earlier
tokens (prompt and output), propose the tokens that followed their most recent earlier occurrence.

Owns, per request, an index from each n-gram (``prompt_lookup_min <= n <= prompt_lookup_max``) to
where its latest occurrence's continuation starts, extended incrementally: each step indexes only
the tokens appended since the last one, so a lookup costs O(n) and the whole request O(length x
sizes). Invariant: the index holds every n-gram ending before the request's last token, and none
ending at it (its own occurrence would be its only match).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-gram -> continuation start, for each n."""

    __slots__ = ("tables", "indexed")

    def __init__(self, sizes: range) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def extend(self, token_ids: Sequence[int], end: int) -> None:
        """Index the n-grams ending at positions ``indexed .. end - 1``."""
        for p in range(self.indexed, end):
            for n, table in self.tables.items():
                if p + 1 >= n:
                    table[tuple(token_ids[p + 1 - n:p + 1])] = p + 1
        self.indexed = max(self.indexed, end)


class NgramProposer:
    """Guesses from the request's own tokens: the longest n-gram match wins, its latest occurrence."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_len: int) -> list[int]:
        """Up to ``max_len`` guessed next tokens of ``token_ids`` (empty when no n-gram recurs)."""
        if max_len <= 0:
            return []
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = NgramIndex(self.sizes)
        num = len(token_ids)
        index.extend(token_ids, num - 1)
        for n in reversed(self.sizes):
            if num <= n:
                continue
            start = index.tables[n].get(tuple(token_ids[num - n:]))
            if start is not None:
                return list(token_ids[start:start + max_len])
        return []

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._index.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._index)
