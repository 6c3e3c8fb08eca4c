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

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

Positive = Annotated[int, Field(strict=True, ge=1)]
AtLeastZero = Annotated[int, Field(strict=True, ge=0)]
Seconds = Annotated[float, Field(gt=0)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ServerLimits:
    max_prompt_bytes: Positive | None = None
    max_logit_bias: AtLeastZero = 1024
    max_stop: AtLeastZero = 64
    max_stop_chars: AtLeastZero = 1024
    default_chat_max_tokens: Positive | None = None
    header_timeout_s: Seconds = 10.0
    body_timeout_s: Seconds = 30.0


