"""How long a client may take to send a request (issue 21): a slow or stalled client is cut off.

Two limits, on two layers:

- **headers** (``header_timeout_protocol``): uvicorn's HTTP/1.1 protocol (h11), subclassed so a
  connection must deliver a complete request line and headers within ``header_timeout_s`` of
  connecting, and of the first byte after each response; otherwise the connection is closed. (A
  plain uvicorn waits for headers forever: 200 slowloris connections stay open.)
- **body** (``server/app.py``'s body middleware): once the headers are in, the whole body must
  arrive within ``body_timeout_s`` (408), and within the byte limit (413), before the route sees it.

Invariant: a timer is armed exactly while the connection waits for a request's headers, and
cancelled as soon as uvicorn has parsed them (it has started a new request cycle).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderTimeoutH11(H11Protocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None and self._waiting_for_headers():
            self._cycle_when_armed = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is self._cycle_when_armed and not self.transport.is_closing():
            self.transport.close()  # no request arrived in time: drop the connection

    def data_received(self, data: bytes) -> None:
        self._arm()  # the first byte of a request after a response (keep-alive) re-arms it
        super().data_received(data)
        if self.cycle is not self._cycle_when_armed:
            self._disarm()  # the headers are in: a new request cycle started

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``seconds`` limit on receiving each request's headers."""
    if not seconds > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {seconds!r}")
    return type("HeaderTimeoutH11", (_HeaderTimeoutH11,), {"header_timeout_s": float(seconds)})
