"""Publishing KV-cache events (``kvcache/kv_events.py``) over ZMQ as vLLM does, so routers built for
vLLM's stream can subscribe to a pagedllm engine.

Wire format (vLLM's ``ZmqEventPublisher``): each step's events are one batch, msgpack-encoded as
vLLM's msgspec structs encode (``array_like``, events tagged by class name):
``[ts, [["BlockStored", [hash, ...], parent_hash | None, [token_id, ...], block_size, lora_id, medium],
["BlockRemoved", [hash, ...], medium], ["AllBlocksCleared"], ...]]``, hashes as bytes. A PUB socket
bound at ``endpoint`` sends multipart ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter
from 0. A ROUTER socket at ``replay_endpoint`` (optional) answers a request ``(start seq, 8 bytes
big-endian)`` with every batch still buffered from that sequence on, ``(seq, payload)`` each, then an
end marker ``(-1 as 8 signed bytes, b"")``: a subscriber that sees a gap asks for what it missed.
The last ``buffer_steps`` batches are kept for replay.

Sending runs on a thread of its own (the engine thread only queues), which also serves replay
requests; ``close`` flushes what is queued and stops it. Listeners in the same process (the router)
get the events as objects instead (``Engine.kv_event_listeners``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from pagedllm.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent) -> list:
    """One event as vLLM's msgspec struct (array_like, tag=True) encodes it."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A batch back into (timestamp, events): what a subscriber does (tests, ``cluster/``)."""
    ts, raw = msgpack.unpackb(payload)
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    return ts, [kinds[e[0]](*e[1:]) for e in raw]


def encode_batch(events: list[KVEvent], ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e) for e in events]], use_bin_type=True)


class ZmqKVEventPublisher:
    """PUB (and replay ROUTER) sockets on a sending thread; ``publish`` queues one step's events."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self.topic = topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)  # raises zmq.ZMQError for an endpoint that cannot be bound
        self._replay = None
        self._bound = [self._pub.getsockopt_string(zmq.LAST_ENDPOINT), None]
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self._bound[1] = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue()
        self._next_seq = 0
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def bound_endpoints(self) -> tuple[str, str | None]:
        """The endpoints as bound (a wildcard port, ``tcp://*:*``, resolved to the one chosen):
        the PUB socket's and the replay socket's (None without one)."""
        return self._bound[0], self._bound[1]

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self._queue.put(events)

    def flush(self) -> int:
        """Wait until every queued batch is sent; returns how many have been published."""
        self._queue.join()
        return self.published

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                self._queue.task_done()
                return
            try:
                payload = encode_batch(events)
                seq = self._next_seq
                self._next_seq += 1
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
            except Exception:  # noqa: BLE001 - a lost batch is for replay to recover, never the engine's failure
                log.exception("could not publish a KV event batch")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
