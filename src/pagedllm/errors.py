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


class RequestTooLong(InvalidRequest):
    """A request can never fit: over ``max_model_len`` or over the whole KV block pool."""


class OutOfKVMemory(PagedLLMError):
    """The KV pool is too small to hold even one block per layer, or sizing failed."""


class ModelLoadError(PagedLLMError):
    """The model could not be found or its files are not understood."""
