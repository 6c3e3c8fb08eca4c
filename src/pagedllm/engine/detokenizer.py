"""Incremental detokenization: generated token ids -> text deltas, primed with the prompt's tail.

A token's text can depend on the tokens before it: SentencePiece tokenizers (Llama 2, Mistral)
drop the leading space of the first token of a string, and a multi-byte character can span
several tokens. So the stream is primed with the last tokens of the prompt (context that is
never emitted), and text is emitted only once it is complete UTF-8.

Fast tokenizers use the ``tokenizers`` library's ``DecodeStream`` (what vLLM v1 uses); others
decode a short window of ids around the newest token (vLLM v0's prefix/read offsets).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pagedllm.models.tokenizer import Tokenizer

PRIME_MIN, PRIME_MAX = 4, 24  # prompt tokens used as context: at least 4, more if they end mid-character


def prompt_tail(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> list[int]:
    """The last few prompt tokens, starting where their decoded text is complete characters."""
    if len(prompt_ids) <= PRIME_MIN:
        return list(prompt_ids)
    for n in range(PRIME_MIN, min(len(prompt_ids), PRIME_MAX) + 1):
        tail = list(prompt_ids[-n:])
        if "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=False):
            return tail
    return list(prompt_ids[-PRIME_MIN:])


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated tokens (``add`` one token at a time)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_tail(tokenizer, prompt_ids)
        self._backend = tokenizer.backend
        if self._backend is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # the window decoder's state (also the fallback when DecodeStream rejects an id)
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        if self._backend is not None:
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:  # noqa: BLE001 - an id the decoder cannot place: decode by windows from here
                self._backend = None
                self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        return self._add_windowed(token_id)

    def _add_windowed(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        after = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return after[len(before):]
        return ""
