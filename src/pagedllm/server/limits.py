"""The server's per-request cost limits (issue 21): what one request may ask for before any work is
done on it, and how long a client may take to send it.

``ServerLimits`` is a frozen config validated on construction. Its limits, and why each exists:

- ``max_prompt_bytes``: a text prompt (or a chat's messages, all together) over this many UTF-8
  bytes is refused before it is tokenized. ``None`` derives it from the model: ``max_model_len``
  x the most bytes one token of the vocabulary spells (``Tokenizer.max_token_bytes``), so any longer
  prompt must have more than ``max_model_len`` tokens, and refusing it loses nothing.
- ``max_logit_bias`` entries and ``max_stop`` stop strings of at most ``max_stop_chars``
  characters each: both cost the engine work on every step of the request.
- ``default_chat_max_tokens``: a chat request without ``max_tokens`` gets this many at most
  (``None``: the rest of the context, as vLLM and OpenAI do).
- ``header_timeout_s``, ``body_timeout_s``: a client has this long to send its request line and
  headers, and then its body (``server/timeouts.py``); a slow or stalled client is disconnected.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_prompt_bytes: int | None = None
    max_logit_bias: int = 1024
    max_stop: int = 64
    max_stop_chars: int = 1024
    default_chat_max_tokens: int | None = None
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "default_chat_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("max_logit_bias", "max_stop", "max_stop_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

