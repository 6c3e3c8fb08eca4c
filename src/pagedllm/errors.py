"""The exceptions pagedllm raises on purpose.

Every error a user can cause is a ``PagedLLMError``; the ones about a single bad request are
``InvalidRequest`` (and also ``ValueError``, so vLLM-style callers that catch ``ValueError`` work).
"""


class PagedLLMError(Exception):
    """Base class of every error pagedllm raises on purpose."""


class ConfigError(PagedLLMError, ValueError):
    """An engine option is unknown or has a bad value; the message names the option."""


class InvalidRequest(PagedLLMError, ValueError):
    """A request (its prompt or its parameters) is malformed; the engine is unaffected."""


def require_utf8(text: str, field: str) -> None:
    """InvalidRequest naming ``field`` unless ``text`` encodes as UTF-8 (JSON lets a client send a
    lone surrogate such as "\\ud800", which no encoder or tokenizer accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field} is not valid UTF-8 text: a lone surrogate {text[e.start]!r} at "
                             f"position {e.start}") from None


class RequestTooLong(InvalidRequest):
    """A request can never fit: over ``max_model_len`` or over the whole KV block pool."""


class OutOfKVMemory(PagedLLMError):
    """The KV pool is too small to hold even one block per layer, or sizing failed."""


class ModelLoadError(PagedLLMError):
    """The model could not be found or its files are not understood."""


class EngineStopped(PagedLLMError):
    """The engine stopped and takes no more requests: under tensor parallelism a failed step or a
    dead worker rank ends it (the ranks' collectives cannot resume), naming the cause."""


class ReplicaLost(PagedLLMError):
    """The cluster replica serving a request stopped (it died or was removed) before the request
    finished; its output so far is lost, and a retry goes to another replica."""
