"""The router's subscription to its replicas' KV-cache events (``engine/kv_event_publisher.py``'s
wire format, as vLLM's): one thread, one ZMQ SUB socket per replica, each batch applied to that
replica's ``ReplicaState`` under the feed's lock.

On ``watch`` the feed connects the SUB socket first, then asks the replica's replay socket for every
buffered batch from sequence 0, so a router that starts after the replica (or after its first
requests) still learns what it caches; batches met twice (replayed and published) are applied once
(``ReplicaState.apply`` skips a sequence number already seen), a gap marks the view approximate.
``forget`` closes a replica's socket (it left the deployment). ``close`` stops the thread.
"""

from __future__ import annotations

import logging
import threading

import zmq

from pagedllm.cluster.routing import ReplicaState
from pagedllm.engine.kv_event_publisher import END_SEQ, decode_batch

log = logging.getLogger("pagedllm.cluster")

REPLAY_TIMEOUT_MS = 2000


class KVEventFeed:
    def __init__(self, topic: str = "") -> None:
        self.topic = topic.encode()
        self.lock = threading.Lock()  # held while a batch is applied; the router holds it to read
        self._context = zmq.Context()
        self._subs: dict[str, tuple[zmq.Socket, ReplicaState]] = {}
        self._pending: list[tuple[str, str, str | None, ReplicaState]] = []
        self._dropped: list[str] = []
        self._changes = threading.Lock()
        self._stop = threading.Event()
        self.batches = 0  # applied, for tests and /cluster
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-feed", daemon=True)
        self._thread.start()

    def watch(self, replica_id: str, endpoint: str, replay_endpoint: str | None, state: ReplicaState) -> None:
        """Subscribe to a replica's events, applied to ``state`` (any thread)."""
        with self._changes:
            self._pending.append((replica_id, endpoint, replay_endpoint, state))

    def forget(self, replica_id: str) -> None:
        with self._changes:
            self._dropped.append(replica_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # -- the feed's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket, ReplicaState] = {}
        try:
            while not self._stop.is_set():
                with self._changes:
                    pending, self._pending = self._pending, []
                    dropped, self._dropped = self._dropped, []
                for replica_id in dropped:
                    entry = self._subs.pop(replica_id, None)
                    if entry is not None:
                        poller.unregister(entry[0])
                        by_socket.pop(entry[0], None)
                        entry[0].close(linger=0)
                for replica_id, endpoint, replay, state in pending:
                    sub = self._context.socket(zmq.SUB)
                    sub.setsockopt(zmq.SUBSCRIBE, self.topic)
                    sub.connect(endpoint)
                    self._subs[replica_id] = (sub, state)
                    by_socket[sub] = state
                    poller.register(sub, zmq.POLLIN)
                    if replay:
                        self._replay(replay, state)
                if not by_socket:  # zmq's poll returns at once with nothing to poll: wait instead of spinning
                    self._stop.wait(0.1)
                    continue
                for sock, _ in poller.poll(100):
                    while True:
                        try:
                            _topic, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._apply(by_socket[sock], int.from_bytes(seq, "big"), payload)
        finally:
            for sock, _ in self._subs.values():
                sock.close(linger=0)
            self._context.term()

    def _apply(self, state: ReplicaState, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except Exception:  # noqa: BLE001 - a batch we cannot read is a lost one
            log.warning("KV events: an unreadable batch from replica %s", state.replica_id)
            state.exact = False
            return
        with self.lock:
            if state.last_seq < 0 and seq > 0:
                state.exact = False  # its first batches are gone from the replica's buffer
            state.apply(events, seq)
            self.batches += 1

    def _replay(self, endpoint: str, state: ReplicaState) -> None:
        """Every batch the replica still buffers, from sequence 0 (a late subscriber catching up)."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self._apply(state, int.from_bytes(seq, "big"), payload)
        except zmq.Again:
            log.warning("KV events: replica %s did not answer a replay request", state.replica_id)
            state.exact = False
        finally:
            dealer.close(linger=0)
