"""The Unix SEQPACKET internal channel: real sockets, both ends in this process.

Rank side (PacketPusher) and fan-in side (PacketListener) are driven directly, so every
state - backlog, drop, reconnection, a cut message, a foreign peer - is reached on
purpose instead of by racing a loaded machine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_tcp_endpoint

from sglang_kvpub import wire
from sglang_kvpub.config import ConfigError, PluginConfig
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher
from sglang_kvpub.transport import packet_channel
from sglang_kvpub.transport.channel import parse_channel_message, seqpacket_available
from sglang_kvpub.transport.packet_channel import PACKET_BYTES, PacketListener, PacketPusher, packet_path

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not seqpacket_available(), reason="no Unix SEQPACKET sockets on this platform"),
]

Received = tuple[int, int, bytes]  # (dp_rank, rank_seq, payload)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"unixpkt://{tmp_path}/ch.pkt"


@pytest.fixture
def listener(endpoint: str) -> Iterator[PacketListener]:
    made = PacketListener(endpoint)
    yield made
    made.close()


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reconnection attempts are due at once: the tests decide when they happen."""
    monkeypatch.setattr(packet_channel, "RETRY_S", 0.0)


def read_all(
    listener: PacketListener, want: int, *pushers: PacketPusher, timeout_s: float = 10.0
) -> list[Received | wire.WireError]:
    """Accepts and reads until ``want`` items (messages or errors) arrived, servicing
    ``pushers`` (the sender thread's job) between reads."""
    out: list[Received | wire.WireError] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want:
        assert time.monotonic() < deadline, f"got {len(out)} of {want} messages"
        for pusher in pushers:
            pusher.service()
        listener.accept()
        for fd in list(listener.connections):
            items, _ = listener.read(fd, 64)
            for item in items:
                if isinstance(item, wire.WireError):
                    out.append(item)
                else:
                    rank, _epoch, seq, payload = parse_channel_message(item)
                    out.append((rank, seq, payload))
    return out


def fill_socket(pusher: PacketPusher, payload: bytes) -> int:
    """Sends until the socket buffer is full (the first message that lands in the backlog)."""
    seq = 0
    while not pusher.backlog:
        assert pusher.send(0, 1, seq, payload)
        seq += 1
        assert seq < 100_000, "the socket never filled"
    return seq


def test_messages_arrive_whole_and_in_order_per_connection(listener: PacketListener, endpoint: str) -> None:
    pushers = [PacketPusher(endpoint) for _ in range(3)]
    for seq in range(50):
        for rank, pusher in enumerate(pushers):
            assert pusher.send(rank, 7, seq, f"r{rank}-{seq}".encode())
    got = read_all(listener, 150)
    for rank in range(3):
        mine = [item for item in got if not isinstance(item, wire.WireError) and item[0] == rank]
        assert [(seq, payload) for _, seq, payload in mine] == [(s, f"r{rank}-{s}".encode()) for s in range(50)]
    assert all(p.sent == 50 and p.dropped == 0 and p.backlog == 0 for p in pushers)
    assert all(p.reconnections() == 0 for p in pushers)  # a first connection needs no resync


def test_big_message_is_cut_and_reassembled_between_small_ones(listener: PacketListener, endpoint: str) -> None:
    pusher = PacketPusher(endpoint)
    big = bytes(range(256)) * (5 * PACKET_BYTES // 256 + 7)  # six packets, the last one short
    assert pusher.send(0, 1, 0, b"before")
    assert pusher.send(0, 1, 1, big)
    assert pusher.send(0, 1, 2, b"after")
    got = read_all(listener, 3, pusher)  # more than a socket buffer: part of it waits in the backlog
    assert got == [(0, 0, b"before"), (0, 1, big), (0, 2, b"after")]
    assert pusher.sent == 3


def test_full_socket_backlogs_in_order_then_drains(listener: PacketListener, endpoint: str) -> None:
    pusher = PacketPusher(endpoint)
    payload = b"p" * 2000
    first_backlogged = fill_socket(pusher, payload)
    for seq in range(first_backlogged, first_backlogged + 20):  # more behind the first backlogged one
        assert pusher.send(0, 1, seq, payload)
    total = first_backlogged + 20
    assert pusher.backlog >= 20 and pusher.dropped == 0
    got: list[Received | wire.WireError] = []

    got.extend(read_all(listener, total, pusher))
    assert [item[1] for item in got if not isinstance(item, wire.WireError)] == list(range(total))
    assert pusher.backlog == 0 and pusher.sent == total and pusher.dropped == 0


def test_backlog_limit_drops_whole_messages_and_counts_them(listener: PacketListener, endpoint: str) -> None:
    pusher = PacketPusher(endpoint, limit=5)
    payload = b"q" * 2000
    first_backlogged = fill_socket(pusher, payload)
    results = [pusher.send(0, 1, seq, payload) for seq in range(first_backlogged, first_backlogged + 10)]
    assert results == [True] * 4 + [False] * 6  # the first backlogged one + 4 fill the limit of 5
    assert pusher.dropped == 6 and pusher.backlog == 5
    got: list[Received | wire.WireError] = []

    got.extend(read_all(listener, first_backlogged + 4, pusher))
    seqs = [item[1] for item in got if not isinstance(item, wire.WireError)]
    assert seqs == list(range(first_backlogged + 4))  # the fan-in sees the gap after these
    assert pusher.reconnections() == 0  # a drop on a live connection is a gap, not a resync


def test_messages_sent_before_the_fanin_exists_wait_and_need_no_resync(endpoint: str) -> None:
    pusher = PacketPusher(endpoint)
    assert not pusher.connected
    for seq in range(5):
        assert pusher.send(0, 1, seq, b"early")
    assert pusher.backlog == 5 and pusher.dropped == 0
    late = PacketListener(endpoint)
    try:
        pusher.service()
        assert pusher.connected and pusher.backlog == 0
        assert [item[1] for item in read_all(late, 5) if not isinstance(item, wire.WireError)] == list(range(5))
        assert pusher.reconnections() == 0
    finally:
        late.close()


def test_fanin_restart_is_noticed_and_counts_one_resync(endpoint: str) -> None:
    first = PacketListener(endpoint)
    pusher = PacketPusher(endpoint)
    assert pusher.send(0, 1, 0, b"a")
    assert read_all(first, 1) == [(0, 0, b"a")]
    first.close()  # the fan-in goes away: its end of the connection closes
    pusher.service()  # end of file seen; no fan-in to reconnect to yet
    assert not pusher.connected and pusher.resets == 1
    assert pusher.send(0, 1, 1, b"b")  # waits in the backlog
    second = PacketListener(endpoint)
    try:
        pusher.service()
        assert pusher.connected and pusher.connects == 2
        assert pusher.reconnections() == 1 and pusher.reconnections() == 0
        assert read_all(second, 1) == [(0, 1, b"b")]
    finally:
        second.close()


def test_a_closing_fanin_takes_no_reconnection_from_the_ranks_it_closes(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a fan-in closes its ranks' connections, a rank that sees its own close and
    reconnects at once (the sender thread does, any time) finds no listener - not the closing
    one, which would queue the connection, reset it and cost the rank a resync for a fan-in
    already gone."""
    listener = PacketListener(endpoint)
    pusher = PacketPusher(endpoint)
    assert pusher.send(0, 1, 0, b"a") and read_all(listener, 1) == [(0, 0, b"a")]
    closing = listener._close
    attempts: list[bool] = []

    def close_then_reconnect(fd: int) -> None:
        closing(fd)
        pusher.service()  # end of file seen, a reconnection tried at once (RETRY_S is 0 here)
        attempts.append(pusher.connected)

    monkeypatch.setattr(listener, "_close", close_then_reconnect)
    listener.close()
    assert attempts == [False]  # the connection closed; no listener took the rank back
    assert pusher.resets == 1 and pusher.connects == 1
    successor = PacketListener(endpoint)
    try:
        pusher.service()
        assert pusher.connected and pusher.connects == 2 and pusher.reconnections() == 1  # one resync, for it
    finally:
        successor.close()


def test_first_connection_after_a_drop_counts_as_a_resync(endpoint: str) -> None:
    pusher = PacketPusher(endpoint, limit=2)
    assert [pusher.send(0, 1, seq, b"x") for seq in range(3)] == [True, True, False]
    late = PacketListener(endpoint)
    try:
        pusher.service()
        assert pusher.connected and pusher.reconnections() == 1  # the fan-in missed a batch
    finally:
        late.close()


def test_listener_reports_bad_packets_and_keeps_reading(listener: PacketListener, endpoint: str) -> None:
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    foreign.connect(packet_path(endpoint))
    foreign.send(b"\x07unknown flag")
    foreign.send(b"\x01a piece")  # MORE ...
    foreign.send(b"\x00a whole message inside a cut one")
    pusher = PacketPusher(endpoint)
    assert pusher.send(3, 1, 0, b"fine")
    got = read_all(listener, 3)
    errors = [str(item) for item in got if isinstance(item, wire.WireError)]
    assert len(errors) == 2 and "flag" in errors[0] and "cut" in errors[1]
    assert (3, 0, b"fine") in got
    foreign.close()


def test_oversized_and_cut_messages_are_dropped_not_delivered(
    listener: PacketListener, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packet_channel, "MAX_MESSAGE_BYTES", 2 * PACKET_BYTES)
    pusher = PacketPusher(endpoint)
    assert pusher.send(0, 1, 0, b"z" * (3 * PACKET_BYTES))  # four packets, over the limit
    assert pusher.send(0, 1, 1, b"next")
    got = read_all(listener, 2, pusher)
    assert isinstance(got[0], wire.WireError) and "too large" in str(got[0])
    assert got[1] == (0, 1, b"next")
    # A peer that closes in the middle of a message: the piece is dropped with the connection.
    cut = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cut.connect(packet_path(endpoint))
    cut.send(b"\x01" + b"half")
    cut.close()
    deadline = time.monotonic() + 10
    listener.accept()
    while len(listener.connections) > 1:  # the pusher's connection stays
        assert time.monotonic() < deadline
        for fd in list(listener.connections):
            items, _closed = listener.read(fd, 8)
            assert items == []
            listener.accept()


def test_connections_beyond_the_bound_are_shed(endpoint: str) -> None:
    bounded = PacketListener(endpoint, max_connections=2)
    try:
        pushers = [PacketPusher(endpoint) for _ in range(3)]
        assert all(p.connected for p in pushers)  # the kernel accepted all three
        bounded.accept()
        assert len(bounded.connections) == 2 and bounded.refused == 1
        shed = pushers[2]
        shed.service()  # the shed one sees end of file and goes back to retrying
        assert shed.resets == 1
    finally:
        bounded.close()


def test_closing_an_old_listener_keeps_a_newer_ones_socket(endpoint: str) -> None:
    old = PacketListener(endpoint)
    new = PacketListener(endpoint)  # a restarted fan-in binds the same path first
    old.close()
    try:
        pusher = PacketPusher(endpoint)
        assert pusher.connected and pusher.send(0, 1, 0, b"to the new one")
        assert read_all(new, 1) == [(0, 0, b"to the new one")]
    finally:
        new.close()


def test_endpoint_and_config_validation() -> None:
    with pytest.raises(ValueError, match="unixpkt://<path>"):
        packet_path("unixpkt://")
    with pytest.raises(ValueError, match="unixpkt://<path>"):
        packet_path("ipc:///tmp/x")
    assert (
        PluginConfig(internal_channel="unixpkt:///run/kvpub/ch.pkt").internal_channel == "unixpkt:///run/kvpub/ch.pkt"
    )
    for bad, fix in (
        ("unixpkt://", "socket path"),
        ("unixpkt:///" + "d" * 120, "107 bytes"),
        ("udp://x", "unixpkt://"),
    ):
        with pytest.raises(ConfigError, match="internal_channel") as info:
            PluginConfig(internal_channel=bad)
        assert fix in str(info.value)


@pytest.mark.timeout(30)
def test_fanin_counts_a_foreign_peer_and_serves_the_ranks(endpoint: str) -> None:
    """The FanIn on a unixpkt channel: garbage from a local peer is counted, never fatal."""
    config = PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2)
    fanin = FanIn(config, 2, channel_endpoint=endpoint)
    fanin.start()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(config.endpoint)
        assert sub.poll(10_000), "no heartbeat"  # the subscription is live
        foreign = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        foreign.connect(packet_path(endpoint))
        foreign.send(b"\x00not a channel message")
        foreign.send(b"\x09")
        pusher = PacketPusher(endpoint)
        batch = wire.EventBatch(ts=1.0, events=[wire.AllBlocksCleared()], dp_rank=1)
        assert pusher.send(1, 5, 0, wire.BatchEncoder().encode(batch))
        decoder = wire.BatchDecoder()
        deadline = time.monotonic() + 10
        while True:
            assert time.monotonic() < deadline, "the rank batch never arrived"
            if not sub.poll(100):
                continue
            _, _, payload = wire.parse_live_frames(sub.recv_multipart())
            if decoder.decode(payload).dp_rank == 1:
                break
        stats = fanin.stats()
        assert stats["malformed"] == 2 and stats["loop_errors"] == 0
        assert stats["channel_connections"] == 2 and stats["ranks"][1]["batches"] == 1
        foreign.close()
        sub.close(linger=0)
    finally:
        fanin.stop()
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_rank_publisher_shutdown_gives_the_backlog_its_time(listener: PacketListener, endpoint: str) -> None:
    """Batches the socket could not take yet still reach a fan-in that reads during shutdown."""
    config = PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=30.0)
    publisher = RankPublisher(config, 2, 16, endpoint)
    tokens = list(range(16))
    count = 0
    while publisher.stats["queue_depth"] == 0 and publisher._packet is not None and not publisher._packet.backlog:
        events: list[wire.Event] = [
            wire.BlockStored(block_hashes=[count + 1], parent_block_hash=None, token_ids=tokens)
        ]
        publisher.publish(wire.EventBatch(ts=1.0, events=events))
        count += 1
        assert count < 200_000, "the socket never filled"
    for _ in range(50):  # more behind the backlog
        publisher.publish(wire.EventBatch(ts=1.0, events=[wire.BlockRemoved(block_hashes=[count + 1])]))
        count += 1
    closer = threading.Thread(target=publisher.shutdown, kwargs={"timeout_s": 30.0})
    closer.start()
    got = [item for item in read_all(listener, count, timeout_s=30.0) if not isinstance(item, wire.WireError)]
    closer.join(30.0)
    assert not closer.is_alive()
    batches = [(rank, seq) for rank, seq, payload in got if payload]  # not the rank heartbeats
    assert batches == [(2, seq) for seq in range(count)]
    assert publisher.stats["dropped"] == 0
