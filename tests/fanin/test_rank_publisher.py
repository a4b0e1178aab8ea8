"""RankPublisher: enrichment, channel frames, rank seq/epoch, bounded queue policies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Union

import msgspec
import pytest
import zmq
from conftest import free_tcp_endpoint

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.publish.rank_publisher import INLINE_MAX_EVENTS, RankPublisher
from sglang_kvpub.transport.channel import parse_channel_frames

pytestmark = pytest.mark.integration


# A stand-in with the shape of SGLang 0.5.23's own structs (tagged-map events, array batch).
class SgBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SgBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class SgBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[SgBlockStored, SgBlockRemoved]]
    attn_dp_rank: int | None = None


@pytest.fixture
def pull() -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    endpoint = free_tcp_endpoint()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    yield endpoint, sock
    sock.close(linger=0)
    ctx.term()


def recv(sock: zmq.Socket[bytes]) -> tuple[int, int, int, bytes]:
    assert sock.poll(10_000), "nothing on the channel"
    return parse_channel_frames(sock.recv_multipart())


@pytest.mark.timeout(30)
def test_enriches_and_sends_rank_frames(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    config = PluginConfig(hash_form="u64", heartbeat_s=60)
    publisher = RankPublisher(config, 5, 128, endpoint)
    try:
        tokens = list(range(256))
        publisher.publish(
            SgBatch(
                ts=1.0,
                events=[
                    SgBlockStored(
                        block_hashes=[-1, 7], parent_block_hash=-2, token_ids=tokens, block_size=128, lora_id=None
                    ),
                    SgBlockRemoved(block_hashes=[-1], medium="CPU_PINNED"),
                ],
            )
        )
        publisher.publish(wire.EventBatch(ts=2.0, events=[wire.AllBlocksCleared()]))
        decoder = wire.BatchDecoder()
        rank, epoch, seq, payload = recv(sock)
        assert (rank, seq) == (5, 0) and epoch == publisher.rank_epoch
        batch = decoder.decode(payload)
        assert batch.dp_rank == 5
        stored, removed = batch.events
        assert isinstance(stored, wire.BlockStored) and isinstance(removed, wire.BlockRemoved)
        assert stored.block_hashes == [2**64 - 1, 7] and stored.parent_block_hash == 2**64 - 2
        assert stored.medium == wire.MEDIUM_GPU and stored.block_size == 128 and stored.token_ids == tokens
        assert removed.medium == wire.MEDIUM_CPU and removed.block_hashes == [2**64 - 1]
        rank, epoch2, seq, payload = recv(sock)
        assert seq == 1 and epoch2 == epoch
        assert isinstance(decoder.decode(payload).events[0], wire.AllBlocksCleared)
        assert publisher.stats["published"] == 2 and publisher.stats["dropped"] == 0
    finally:
        publisher.shutdown()


@pytest.mark.timeout(30)
def test_i64_hash_form_and_array_encoding(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(hash_form="i64", event_encoding="array"), 0, 2, endpoint)
    try:
        event = wire.BlockStored(block_hashes=[2**64 - 3], parent_block_hash=None, token_ids=[1, 2], block_size=2)
        publisher.publish(wire.EventBatch(ts=1.0, events=[event]))
        _, _, _, payload = recv(sock)
        raw = msgspec.msgpack.decode(payload)
        assert raw[1][0][0] == "BlockStored" and raw[1][0][1] == [-3] and raw[2] == 0
    finally:
        publisher.shutdown()


@pytest.mark.timeout(30)
def test_idle_rank_sends_heartbeats_with_seqs(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(heartbeat_s=0.05), 1, 4, endpoint)
    try:
        frames = [recv(sock) for _ in range(3)]
        assert [f[3] for f in frames] == [b"", b"", b""]
        assert [f[2] for f in frames] == [0, 1, 2]
    finally:
        publisher.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("policy", "kept"), [("drop_oldest", [0, 7, 8, 9]), ("drop_newest", [0, 1, 2, 3])])
def test_full_queue_policy_counts_drops(
    policy: str, kept: list[int], pull: tuple[str, zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, sock = pull
    config = PluginConfig(rank_queue_size=3, full_policy=policy, heartbeat_s=60, rank_send="thread")  # type: ignore[arg-type]
    publisher = RankPublisher(config, 0, 4, endpoint)
    gate = threading.Event()
    entered = threading.Event()
    original = publisher._payload

    def stalled(batch: Any) -> bytes | None:
        entered.set()
        gate.wait(10.0)
        return original(batch)

    monkeypatch.setattr(publisher, "_payload", stalled)
    try:
        publisher.publish(wire.EventBatch(ts=0.0, events=[]))  # taken by the worker, which stalls
        assert entered.wait(10.0)
        for _ in range(9):
            publisher.publish(wire.EventBatch(ts=0.0, events=[]))
        assert publisher.stats["queue_dropped"] == 6 and publisher.stats["queue_depth"] == 3
        gate.set()
        seqs = [recv(sock)[2] for _ in range(4)]
        assert seqs == kept
    finally:
        gate.set()
        publisher.shutdown()


@pytest.mark.timeout(30)
def test_inline_send_happens_in_the_callers_thread(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(heartbeat_s=60), 3, 4, endpoint)
    threads: list[str] = []
    original = publisher._payload

    def spy(batch: Any) -> bytes | None:
        threads.append(threading.current_thread().name)
        return original(batch)

    publisher._payload = spy  # type: ignore[method-assign]
    try:
        publisher.publish(wire.EventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))
        assert publisher.stats["sent_inline"] == 1  # sent before publish() returned
        assert threads == [threading.current_thread().name]
        assert recv(sock)[:3:2] == (3, 0)
    finally:
        publisher.shutdown()


@pytest.mark.timeout(30)
def test_big_batches_go_to_the_sender_thread_in_order(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(heartbeat_s=60), 0, 4, endpoint)
    try:
        big: list[wire.Event] = [wire.BlockRemoved(block_hashes=[i]) for i in range(INLINE_MAX_EVENTS + 1)]
        publisher.publish(wire.EventBatch(ts=1.0, events=big))
        publisher.publish(wire.EventBatch(ts=2.0, events=[wire.AllBlocksCleared()]))
        received = [recv(sock) for _ in range(2)]
        assert [frame[2] for frame in received] == [0, 1]
        assert len(wire.BatchDecoder().decode(received[0][3]).events) == INLINE_MAX_EVENTS + 1
        # the sender thread counts a send after the system call returns: the peer may read it first
        deadline = time.monotonic() + 10.0
        while publisher.stats["sent"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert publisher.stats["sent"] == 2 and publisher.stats["sent_inline"] <= 1
    finally:
        publisher.shutdown()


@pytest.mark.timeout(30)
def test_inline_publish_never_overtakes_a_send_in_progress(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    """While one thread's inline send is stalled, other publishes queue behind it: the
    rank's sequence reaches the channel in order, nothing lost, nothing blocked."""
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(heartbeat_s=60), 0, 4, endpoint)
    gate, entered = threading.Event(), threading.Event()
    original = publisher._payload

    def stalled(batch: Any) -> bytes | None:
        if batch.ts == 0.0:
            entered.set()
            gate.wait(10.0)
        return original(batch)

    publisher._payload = stalled  # type: ignore[method-assign]
    first = threading.Thread(target=publisher.publish, args=(wire.EventBatch(ts=0.0, events=[]),))
    try:
        first.start()
        assert entered.wait(10.0)
        for index in range(1, 6):
            publisher.publish(wire.EventBatch(ts=float(index), events=[]))  # queued: the socket is taken
        assert publisher.stats["queue_depth"] == 5
        gate.set()
        first.join(10.0)
        assert [recv(sock)[2] for _ in range(6)] == [0, 1, 2, 3, 4, 5]
        assert publisher.stats["sent_inline"] == 1 and publisher.stats["dropped"] == 0
    finally:
        gate.set()
        first.join(10.0)
        publisher.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank_send", ["inline", "thread"])
def test_publish_never_blocks_without_a_fanin(rank_send: str) -> None:
    endpoint = free_tcp_endpoint()  # nobody listens
    config = PluginConfig(hwm=10, rank_queue_size=100, heartbeat_s=60, rank_send=rank_send)  # type: ignore[arg-type]
    publisher = RankPublisher(config, 0, 2, endpoint)
    try:
        event = wire.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
        for _ in range(2000):
            publisher.publish(wire.EventBatch(ts=0.0, events=[event]))
        deadline = time.monotonic() + 10.0
        while publisher.stats["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = publisher.stats
        assert stats["published"] == 2000 and stats["rank_seq"] == 1999
        assert stats["dropped"] > 0 and stats["sent"] + stats["dropped"] == 2000
    finally:
        publisher.shutdown(timeout_s=0.1)


@pytest.mark.timeout(30)
def test_ranks_of_one_process_share_one_sender(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    config = PluginConfig(heartbeat_s=60)
    ranks = [RankPublisher(config, rank, 4, endpoint) for rank in range(3)]
    try:
        sender = ranks[0]._sender
        assert all(publisher._sender is sender for publisher in ranks) and sender._thread is not None
        for index in range(5):
            for publisher in ranks:
                publisher.publish(wire.EventBatch(ts=float(index), events=[wire.AllBlocksCleared()]))
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        epochs = {}
        for _ in range(15):
            rank, epoch, seq, payload = recv(sock)
            seen[rank].append(seq)
            epochs[rank] = epoch
            assert wire.BatchDecoder().decode(payload).dp_rank == rank
        assert seen == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3, 4]}
        assert epochs == {publisher.dp_rank: publisher.rank_epoch for publisher in ranks}
        ranks[0].shutdown()  # the others keep being served
        ranks[2].publish(wire.EventBatch(ts=9.0, events=[]))
        assert recv(sock)[:3:2] == (2, 5)
    finally:
        for publisher in ranks:
            publisher.shutdown()
    deadline = time.monotonic() + 10.0
    while sender._thread is not None and time.monotonic() < deadline:  # the last shutdown ends it
        time.sleep(0.01)
    assert sender._thread is None
    again = RankPublisher(config, 7, 4, endpoint)  # and a new publisher starts a new one
    try:
        assert again._sender._thread is not None
        again.publish(wire.EventBatch(ts=1.0, events=[]))
        assert recv(sock)[:3:2] == (7, 0)
    finally:
        again.shutdown()


@pytest.mark.timeout(30)
def test_shutdown_flushes_what_is_queued(pull: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, sock = pull
    publisher = RankPublisher(PluginConfig(heartbeat_s=60), 3, 4, endpoint)
    for index in range(200):
        publisher.publish(wire.EventBatch(ts=float(index), events=[]))
    publisher.shutdown(timeout_s=10.0)
    publisher.publish(wire.EventBatch(ts=0.0, events=[]))  # after shutdown: ignored
    assert [recv(sock)[2] for _ in range(200)] == list(range(200))
    assert not sock.poll(50)
    assert publisher.stats["sent"] == 200 and publisher.stats["dropped"] == 0
