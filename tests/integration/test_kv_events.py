"""KV-cache events in vLLM's schema over ZMQ: a subscriber rebuilds the engine's set of cached
blocks exactly after a run with evictions, the token ids and parents chain as the engine's hashes
do, a late subscriber recovers what it missed through the replay socket, and a reset clears all."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.engine.kv_event_publisher import END_SEQ, decode_batch
from pagedllm.errors import ConfigError
from pagedllm.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, replay
from pagedllm.parallel.collectives import free_port
from tests.conftest import make_tiny_checkpoint

BLOCK = 16


class Subscriber:
    """A SUB socket collecting (seq, payload) on a thread, as a router would."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.received: list[tuple[int, bytes]] = []
        self.topics: set[bytes] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # PUB/SUB: a subscription takes a moment to reach the publisher

    def _run(self) -> None:
        while not self._stop:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.topics.add(topic)
                self.received.append((int.from_bytes(seq, "big"), payload))

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sub.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("events"), "llama", seed=4)


def cached_hashes(llm) -> set[bytes]:
    manager = llm.engine.kv_manager
    return {manager.hash_bytes(h) for h in manager.prefix_cache.map}


def test_a_subscriber_rebuilds_the_cached_blocks_exactly_after_evictions(tiny):
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(model=tiny, dtype="float32", num_kv_blocks=12, kv_events_endpoint=pub, kv_events_replay_endpoint=rep,
              kv_events_topic="kv")
    sub = Subscriber(pub, "kv")
    try:
        prompts = [[1, *range(10 + 7 * i, 10 + 7 * i + 40)] for i in range(6)]  # 6 x 41 tokens: 12 blocks fill up
        params = SamplingParams(temperature=0.0, max_tokens=8)
        for p in prompts:  # one at a time: each leaves its blocks cached, the later ones evict the earlier
            llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        assert llm.engine.kv_manager.allocator.num_evictions > 0
        published = llm.engine.kv_event_publisher.flush()
        sub.wait_for(published)
        assert sub.topics == {b"kv"}
        assert [seq for seq, _ in sub.received] == list(range(published))  # no gap
        events = [e for _, payload in sub.received for e in decode_batch(payload)[1]]
        assert any(isinstance(e, BlockRemoved) for e in events)
        assert replay(events) == cached_hashes(llm) and cached_hashes(llm)
        # every stored run: block_size tokens per hash, the tokens of a prompt, chained to its parent
        hasher, manager = llm.engine.kv_manager.hasher, llm.engine.kv_manager
        for e in (e for e in events if isinstance(e, BlockStored)):
            assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes) and e.medium == "CPU"
            parent = 0 if e.parent_block_hash is None else int.from_bytes(e.parent_block_hash, "little")
            for i, h in enumerate(e.block_hashes):
                parent = hasher.hash_block(parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK])
                assert manager.hash_bytes(parent) == h
        # a late subscriber asks the replay socket for everything from sequence 0
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(rep)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        context.term()
        assert replayed == sub.received
        # a reset clears every cached block, and says so
        assert llm.reset_prefix_cache()
        sub.wait_for(llm.engine.kv_event_publisher.flush())
        ts, last = decode_batch(sub.received[-1][1])
        assert last == [AllBlocksCleared()] and ts > 0 and cached_hashes(llm) == set()
    finally:
        sub.close()
        llm.engine.shutdown()


def test_the_wire_format_is_vllms():
    """msgspec's array_like, tag=True structs: the class name first, then the fields in order."""
    from pagedllm.engine.kv_event_publisher import encode_batch

    events = [BlockStored([b"\x01" * 16], None, list(range(16)), 16, None, "CPU"), BlockRemoved([b"\x02" * 16], "CPU"),
              AllBlocksCleared()]
    assert msgpack.unpackb(encode_batch(events, ts=1.5)) == [1.5, [
        ["BlockStored", [b"\x01" * 16], None, list(range(16)), 16, None, "CPU"],
        ["BlockRemoved", [b"\x02" * 16], "CPU"],
        ["AllBlocksCleared"]]]


def test_bad_endpoints_are_refused_naming_the_option(tiny):
    with pytest.raises(ConfigError, match="kv_events_endpoint.*ZMQ endpoint"):
        LLM(model=tiny, dtype="float32", num_kv_blocks=8, kv_events_endpoint="http://localhost:5557")
    with pytest.raises(ConfigError, match="kv_layout=paged only"):
        LLM(model=tiny, dtype="float32", num_kv_blocks=8, kv_layout="contiguous",
            kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
