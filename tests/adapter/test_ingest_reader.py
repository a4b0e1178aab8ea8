"""One reader thread serving many streams (motor_adapter/ingest.py), over real ZMQ sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from motor_adapter import stream
from motor_adapter.ingest import IngestReader
from motor_adapter.stream import StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.core.index import PrefixIndex
from tests.conftest import free_tcp_endpoint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BLOCK_SIZE = 4
GPU = wire.MEDIUM_GPU
QUIET = StreamOptions(expect_heartbeats=False, poll_s=0.02)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def _payload(block: int, rank: int = 0) -> bytes:
    stored = wire.BlockStored(block_hashes=[block], token_ids=[block] * BLOCK_SIZE, block_size=BLOCK_SIZE, medium=GPU)
    return wire.BatchEncoder().encode(wire.EventBatch(ts=1.0, events=[stored], dp_rank=rank))


class _Publisher:
    """A bound PUB that sends consecutive seqs, one stored block each (block = 1000 + seq)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.endpoint = free_tcp_endpoint()
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoint)
        self.seq = 0

    def send(self) -> None:
        self.socket.send_multipart(wire.live_frames(b"", self.seq, _payload(1000 + self.seq)))
        self.seq += 1

    def close(self) -> None:
        self.socket.close(0)


def _until(sub: StreamSubscriber, pub: _Publisher, done: Any) -> bool:
    """Publishes until ``done(health)``: a SUB hears a PUB only once connected (no fixed sleep)."""
    for _ in range(400):
        pub.send()
        if sub.wait_for(done, 0.05):
            return True
    return False


def test_a_stalled_replay_delays_only_its_own_stream(ctx: zmq.Context[Any]) -> None:
    stalled_replay = ctx.socket(zmq.ROUTER)  # takes the snapshot request and never answers
    stalled_replay.setsockopt(zmq.LINGER, 0)
    replay_endpoint = free_tcp_endpoint()
    stalled_replay.bind(replay_endpoint)
    pubs = [_Publisher(ctx) for _ in range(9)]
    index = PrefixIndex(BLOCK_SIZE)
    payload_size = len(_payload(1000))
    stalled = StreamSubscriber(
        "stalled",
        pubs[0].endpoint,
        index,
        replay_endpoint=replay_endpoint,
        context=ctx,
        # room for one queued batch: the next ones push the oldest out (counted)
        options=StreamOptions(replay_timeout_s=120.0, poll_s=0.02, live_buffer_bytes=payload_size + 1),
    )
    others = [
        StreamSubscriber(f"i{n}", pub.endpoint, index, context=ctx, options=QUIET) for n, pub in enumerate(pubs[1:])
    ]
    subs = [stalled, *others]
    try:
        for sub in subs:
            sub.start()
        assert stalled_replay.poll(10_000), "no snapshot request arrived"
        _identity, _start, snapshot = wire.parse_replay_request(stalled_replay.recv_multipart())
        assert snapshot  # the stalled stream's sync now waits for an answer that never comes

        for sub, pub in zip(others, pubs[1:], strict=True):
            assert _until(sub, pub, lambda h: h.batches >= 3), f"{sub.instance_id} got nothing"
            assert index.resident(sub.instance_id, 0, GPU) >= {1000 + pub.seq - 1}
        assert _until(stalled, pubs[0], lambda h: h.dropped_live >= 2)  # its batches wait, bounded
        health = stalled.health()
        assert (health.batches, health.snapshots) == (0, 0)  # nothing of it applied: still syncing
        assert index.resident("stalled", 0, GPU) == set()

        names = [thread.name for thread in threading.enumerate()]
        assert names.count("kv-ingest-reader") == 1  # every stream on one reader
        assert not [name for name in names if name.startswith("kv-stream-")]
        reader = next(thread for thread in threading.enumerate() if thread.name == "kv-ingest-reader")
    finally:
        for sub in subs:
            sub.stop(timeout=5.0)
        for pub in pubs:
            pub.close()
        stalled_replay.close(0)
    assert not [sub.instance_id for sub in subs if sub.is_alive()]  # the stalled sync too
    reader.join(5.0)
    assert not reader.is_alive()  # the last stream gone, the reader ends


def test_a_stream_restarts_after_stop_on_a_new_reader(ctx: zmq.Context[Any]) -> None:
    pub = _Publisher(ctx)
    index = PrefixIndex(BLOCK_SIZE)
    try:
        for name in ("first", "second"):  # the reader ends with its last stream; the next starts one
            sub = StreamSubscriber(name, pub.endpoint, index, context=ctx, options=QUIET)
            sub.start()
            try:
                assert _until(sub, pub, lambda h: h.batches >= 2)
            finally:
                sub.stop(timeout=5.0)
            assert not sub.is_alive()
            assert index.resident(name, 0, GPU)
    finally:
        pub.close()


def test_live_buffer_is_bounded_in_bytes() -> None:
    sub = StreamSubscriber(
        "inst", "tcp://127.0.0.1:1", PrefixIndex(BLOCK_SIZE), options=StreamOptions(live_buffer_bytes=100)
    )
    for seq in range(5):
        sub._enqueue(stream._Item(seq, None, 0, 40))
    assert [item.seq for item in sub._pending] == [3, 4]  # 80 bytes held, a third would be 120
    assert sub._pending_bytes == 80
    assert sub.health().dropped_live == 3
    sub._enqueue(stream._Item(5, None, 0, 500))  # larger than the bound alone: kept, the rest dropped
    assert [item.seq for item in sub._pending] == [5]
    assert sub.health().dropped_live == 5
    sub.stop()


class _Client:
    """A bare reader client: opens (or fails to), ticks, closes; records what ran."""

    def __init__(self, fail_open: bool = False) -> None:
        self.fail_open = fail_open
        self.opened = threading.Event()
        self.closed = threading.Event()

    def _reader_open(self, reader: Any) -> None:
        if self.fail_open:
            raise RuntimeError("open failed on purpose")
        self.opened.set()

    def _reader_readable(self) -> bool:
        return False

    def _reader_tick(self, now: float) -> None:
        pass

    def _reader_close(self) -> None:
        self.closed.set()


def test_a_failing_stream_handler_is_contained_and_counted() -> None:
    reader = IngestReader()
    bad, good = _Client(fail_open=True), _Client()
    assert reader.attach(bad).wait(10)  # the command completes although the open raised
    assert reader.attach(good).wait(10) and good.opened.is_set()  # the thread still serves others
    assert reader.handler_errors == 1 and not bad.opened.is_set()
    assert reader.detach(bad).wait(10) and reader.detach(good).wait(10)
    assert good.closed.is_set()
