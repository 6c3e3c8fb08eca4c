"""AsyncEngine: an ``Engine`` driven by one background thread, used from asyncio (the server).

Only the engine thread touches the ``Engine``. Other threads and the event loop talk to it through
a command queue (add a request, abort one, run a function between two steps) and get each
request's outputs on an ``asyncio.Queue`` of their own. Outputs are deltas
(``RequestOutputKind.DELTA``): new text, token ids and logprobs since the request's previous
output, so a long stream costs O(n). When no request is unfinished and no command is queued, the
thread sleeps on a condition variable: an idle engine uses no CPU.

Give ``AsyncEngine`` a factory (``AsyncEngine(lambda: build_engine(...))``) and the engine
is built on its own thread, so that thread is the first to run torch's OpenMP parallel regions in
the process. Measured on 2 cores (torch 2.13 CPU, GNU OpenMP): once the main thread has run a
parallel region, the same decode steps on another thread ran 40% slower with only ~1.2 cores busy,
while an engine built and stepped on one background thread (the main thread never running a
parallel op) matches the offline ``LLM`` on the main thread (``scripts/engine_thread_check.py``).

Invariants: every request added through ``generate`` either yields a finished output, raises the
error that rejected it, or is aborted when its consumer stops listening (a client that hung up),
so its blocks are freed within one step. If ``Engine.step`` itself raises (a bug outside the
model step, which the engine already isolates), the engine is marked dead: every open stream
ends with ``EngineDeadError`` and ``healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.engine.engine import Engine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.errors import EngineStopped, PagedLLMError

log = logging.getLogger(__name__)


class EngineDeadError(PagedLLMError):
    """The engine thread stopped on an unexpected error; no request can be served."""


class EngineShutdown(PagedLLMError):
    """The engine is shutting down; the request was aborted."""


class StreamEnd:
    """What every request stream has: ``finished``, and callbacks run once when it ends."""

    def __init__(self) -> None:
        self.finished = False
        self._on_done: list[Callable[[], None]] = []

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once, when the stream ends: finished, failed, closed or dropped unread."""
        if self.finished:
            fn()
        else:
            self._on_done.append(fn)

    def _end(self) -> None:
        if self.finished:
            return
        self.finished = True
        callbacks, self._on_done = self._on_done, []
        for fn in callbacks:
            fn()


class RequestStream(StreamEnd):
    """One request's outputs, as the engine thread hands them out. ``close()`` (or leaving an
    ``async for`` through ``aclose``) aborts the request if it has not finished."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.engine, self.request_id, self.loop = engine, request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def close(self) -> None:
        if not self.finished:
            self._end()
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:  # a stream dropped unread (its response never started): no ghost request
        if not self.finished and self.engine.healthy:
            self.close()


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread; ``generate`` streams a request's deltas."""

    def __init__(self, engine: Engine | Callable[[], Engine],
                 on_output: Callable[[RequestOutput], None] | None = None) -> None:
        """``engine``: an ``Engine``, or a function that builds one, called on the engine thread
        (its error, if any, is raised here)."""
        self.on_output = on_output          # called on the engine thread for every output (metrics)
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self.dead: BaseException | None = None
        build = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="pagedllm-engine", daemon=True)
        self._thread.start()
        self.engine: Engine = built.result()  # waits for the build; re-raises its error

    # -- any thread ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps; its result (or error) in a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(EngineDeadError(f"the engine stopped: {self.dead!r}"))
            return future
        if self._stopping:
            future.set_exception(EngineShutdown("the engine is shutting down"))
            return future
        with self._wake:
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (no-op if it already finished)."""
        self.call(lambda: self._abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with ``EngineShutdown``) and stop the thread."""
        if not self._thread.is_alive():
            return
        done = self.call(self._abort_all)
        with contextlib.suppress(Exception):  # shutting down regardless
            done.result(timeout)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- asyncio ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Validate and queue a request (its error, e.g. ``InvalidRequest``, is raised here) and
        return the stream of its delta outputs."""
        if isinstance(params, SamplingParams):  # a beam search (BeamSearchParams) has one, final, output
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        added = self.call(lambda: self._add(request_id, prompt, params, stream))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have run already: undo it
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its deltas until it finishes; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    # -- the engine thread -----------------------------------------------------------------------
    def _add(self, request_id: str, prompt, params: SamplingParams, stream: RequestStream) -> None:
        self.engine.add_request(request_id, prompt, params)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self._streams.pop(request_id, None)

    def _abort_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(EngineShutdown("the server is shutting down; the request was aborted"))
        self._streams.clear()

    def _run(self, build: Callable[[], Engine], built: concurrent.futures.Future) -> None:
        try:
            engine = build()
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(engine)
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                watch = self.engine.tensor_parallel is not None  # a worker may die while all is idle
                with self._wake:
                    while not self._commands and not self._stopping and not self.engine.has_unfinished():
                        self._wake.wait(1.0 if watch else None)  # idle: sleep until a command arrives
                        if watch:
                            self._dispatch(self.engine.check_workers())
                            self._raise_if_stopped()
                    if self._stopping:
                        self.engine.shutdown()
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, future in commands:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as exc:  # noqa: BLE001 - the caller gets it
                            future.set_exception(exc)
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                self._raise_if_stopped()
        except BaseException as exc:  # noqa: BLE001 - a bug outside the isolated model step
            log.exception("the engine thread stopped")
            self.dead = exc
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._streams.clear()
            with self._wake:
                for _, future in self._commands:
                    future.set_exception(EngineDeadError(f"the engine stopped: {exc!r}"))
                self._commands.clear()

    def _raise_if_stopped(self) -> None:
        """A tensor-parallel engine that stopped (its requests already failed) ends the loop: the
        server answers 503 from then on."""
        if self.engine.dead is not None:
            raise EngineStopped(self.engine.dead)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if self.on_output is not None:
                try:
                    self.on_output(out)
                except Exception:  # noqa: BLE001 - metrics must never stop the engine
                    log.exception("on_output failed")
            if stream is not None:
                stream.put(out)
