"""InputProcessor: a request's prompt and params checked and normalised before it enters the engine.

Owns the rules a request must meet to be queued: the prompt's forms (text, token ids, a prompt
dict with a cache salt), token ids inside the vocabulary, the length against ``max_model_len``
and the whole block pool (the scheduler's admission rule, ``Scheduler.check_admissible``), the
logprobs counts within ``max_logprobs``, the token ids params name, and bad words as token
sequences. Every check raises ``InvalidRequest`` / ``RequestTooLong`` and changes nothing, so a
bad request never enters the queue.
"""

from __future__ import annotations

import dataclasses
import operator

from pagedllm.engine.sampling_params import SamplingParams, logprobs_count
from pagedllm.engine.scheduler import Scheduler
from pagedllm.errors import InvalidRequest, require_utf8
from pagedllm.models.tokenizer import Tokenizer


class InputProcessor:
    """Prompt and params validation for one engine (its tokenizer, vocabulary, limits and scheduler)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_logprobs: int, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.scheduler = scheduler

    PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None]:
        """Normalise a prompt (text, token ids, or a {'prompt'|'prompt_token_ids'[, 'cache_salt']} dict)
        into (text, token ids, cache salt). Token ids may be Python, numpy or torch integers."""
        salt = None
        text: str | None = None
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in self.PROMPT_KEYS)
            if unknown:
                raise InvalidRequest(f"unknown key {unknown[0]!r} in a prompt dict "
                                     f"(expected one of {', '.join(self.PROMPT_KEYS)})")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequest("cache_salt must be a string")
            if salt is not None:
                require_utf8(salt, "cache_salt")  # it is encoded when block hashes are computed
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise InvalidRequest("prompt_token_ids must be a list of token ids, not a string")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise InvalidRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            require_utf8(prompt, "prompt")
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass token ids as the prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, bytes | bytearray) or not hasattr(prompt, "__iter__") or hasattr(prompt, "keys"):
            raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        else:
            ids = self.token_ids(prompt)
        if not ids and text:  # a rule of the tokenizer (it drops some control characters), not of a schema
            raise InvalidRequest("the prompt is empty: its text tokenizes to no token (the tokenizer drops it); "
                                 "it must have at least one")
        if not ids:
            raise InvalidRequest("the prompt is empty: it must have at least one token")
        return text, ids, salt

    def token_ids(self, values) -> list[int]:
        vocab = self.vocab_size
        try:
            values = list(values)
            ids = [operator.index(t) for t in values if not isinstance(t, bool)]
        except TypeError:
            ids = [-1]
        if len(ids) != len(values) or not all(0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def check_length(self, num_prompt: int, max_tokens: int | None) -> int:
        """The request's max_tokens (filled in up to max_model_len when None); raises RequestTooLong
        if it cannot fit max_model_len or the whole block pool (the scheduler's admission rule)."""
        return self.scheduler.check_admissible(num_prompt, max_tokens)

    def resolve_logprobs(self, params: SamplingParams) -> SamplingParams:
        """``logprobs`` / ``prompt_logprobs`` with -1 (the whole vocabulary) as the vocabulary's size,
        within ``max_logprobs`` (-1: no limit; InvalidRequest naming the field), as vLLM checks them,
        on a copy of the params (the caller's are left as they were)."""
        limit, vocab = self.max_logprobs, self.vocab_size
        resolved = {name: logprobs_count(name, getattr(params, name), limit, vocab)
                    for name in ("logprobs", "prompt_logprobs") if getattr(params, name) is not None}
        changed = {name: count for name, count in resolved.items() if count != getattr(params, name)}
        return dataclasses.replace(params, **changed) if changed else params

    def check_params(self, params: SamplingParams) -> list[list[int]]:
        """Token ids named by the params must exist; returns the bad words as token-id sequences."""
        vocab = self.vocab_size
        bad = [(name, t) for name, t in params.token_ids_to_check() if t >= vocab]
        if bad:
            raise InvalidRequest(f"{bad[0][0]}: token id {bad[0][1]} is outside the vocabulary [0, {vocab})")
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise InvalidRequest("bad_words needs a tokenizer; this model has none")
        words: list[list[int]] = []
        for word in params.bad_words:  # as vLLM: the word alone, and as a new word after a space
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words
