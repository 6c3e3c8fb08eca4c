"""The ingress's engine: what the OpenAI server (``server/``) asks of an ``AsyncEngine``, served by
the engine deployment's replicas through a Ray Serve handle.

- ``EngineFacts`` stands for ``AsyncEngine.engine`` where the server reads it: the tokenizer (loaded
  here from the replicas' model file, so prompts are tokenized and chat templates rendered in the
  ingress, and the router hashes the token ids), the context length, vocabulary and limits the
  replicas describe, and the structured-output compiler (a bad schema is a 400 before routing).
- ``ClusterEngine.add_request`` sends ``generate`` through the handle (the request router picks the
  replica) and waits for its first item: the replica accepted the request (its id) or raised the
  engine's own error (``InvalidRequest``...), so a bad request is refused as on one server.
- ``RemoteStream`` yields the replica's delta outputs; ``close`` cancels the call, which aborts the
  request on the replica. A replica that dies under a stream ends it with ``ReplicaLost`` (503;
  the stream's error event), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from pathlib import Path

from ray.exceptions import RayError, RayTaskError

from pagedllm.engine.async_engine import StreamEnd
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.errors import PagedLLMError, ReplicaLost
from pagedllm.models.tokenizer import Tokenizer

log = logging.getLogger("pagedllm.cluster")

REMEMBERED = 10_000  # request id -> replica, for /cluster and tests


class EngineFacts:
    """The engine attributes the server reads, as the replicas describe them (``describe()``)."""

    def __init__(self, described: dict, max_replicas: int, chat_template: str | None = None) -> None:
        self.model_path = Path(described["model_path"])
        self.tokenizer = Tokenizer.load(self.model_path, described["gguf"])
        if chat_template is not None and self.tokenizer is not None:
            path = Path(chat_template)
            self.tokenizer.hf.chat_template = path.read_text() if path.is_file() else chat_template
        self.max_model_len: int = described["max_model_len"]
        self.vocab_size: int = described["vocab_size"]
        self.max_logprobs: int = described["max_logprobs"]
        self.max_num_seqs: int = described["max_num_seqs"] * max_replicas  # what the cluster runs at once
        self.eos_token_ids = frozenset(described["eos_token_ids"])
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def compile_grammar(self, spec):
        return self.structured.compile(spec)


def _unwrapped(exc: BaseException) -> BaseException:
    """The replica's own error from Ray's wrapper; a lost replica as ``ReplicaLost``."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, PagedLLMError | ValueError):
            return cause
        if cause is not None and not isinstance(cause, RayError):
            log.error("a replica failed a request: %r", cause)
            return cause
    if isinstance(exc, RayError):
        return ReplicaLost("the replica serving this request stopped before it finished; retry (another replica "
                           "takes it)")
    return exc


class RemoteStream(StreamEnd):
    """One request's deltas from its replica (the interface of ``async_engine.RequestStream``)."""

    def __init__(self, response, request_id: str) -> None:
        super().__init__()
        self._response, self.request_id = response, request_id
        self.replica: str | None = None

    async def start(self) -> str:
        """Wait for the replica to accept the request (or raise its refusal); returns its id."""
        first = await self._next()
        self.replica = first["replica"]
        return self.replica

    async def _next(self):
        try:
            return await self._response.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except asyncio.CancelledError:  # our own task was cancelled (the client left): not the replica's fault
            self.close()
            raise
        except BaseException as exc:
            self._end()
            error = _unwrapped(exc)
            if error is exc:
                raise
            raise error from None

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._next()
        if out.finished:
            self._end()
        return out

    def close(self) -> None:
        if not self.finished:
            self._end()
            self._response.cancel()  # the replica's generator is cancelled: it aborts the request

    async def aclose(self) -> None:
        self.close()


class ClusterEngine:
    """``AsyncEngine``'s face for the server, over the engine deployment's handle."""

    def __init__(self, handle, facts: EngineFacts) -> None:
        self.engine = facts
        self._generate = handle.options(stream=True).generate
        self._open: dict[str, RemoteStream] = {}
        self.served: OrderedDict[str, str] = OrderedDict()  # request id -> the replica that took it
        self._stopping = False

    @property
    def healthy(self) -> bool:
        return not self._stopping

    async def add_request(self, request_id: str, prompt, params) -> RemoteStream:
        stream = RemoteStream(self._generate.remote(request_id, prompt, params), request_id)
        try:
            replica = await stream.start()
        except BaseException:
            stream.close()
            raise
        self.served[request_id] = replica
        while len(self.served) > REMEMBERED:
            self.served.popitem(last=False)
        self._open[request_id] = stream
        stream.on_done(lambda: self._open.pop(request_id, None))
        return stream

    def shutdown(self) -> None:
        self._stopping = True
        for stream in list(self._open.values()):
            stream.close()
