"""Fan-in end to end: rank publisher processes -> internal channel -> fan-in process -> plain SUB.

Everything is real: spawned processes, ZMQ on loopback, the internal channel (Unix SEQPACKET,
the default, and ZMQ ipc) in a private tmp dir.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_tcp_endpoint
from kvpub_procs import BLOCK_SIZE, batch_events, hash_of, run_fanin, run_rank, spawn_context

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher
from sglang_kvpub.transport.channel import channel_frames, default_channel_endpoint

pytestmark = pytest.mark.integration

Msg = tuple[int, wire.EventBatch, bytes]  # (seq, batch, payload)


class Sub:
    """A plain SUB on the instance stream, as any consumer would use it."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, topic: bytes = b"") -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.decoder = wire.BatchDecoder()
        self.msgs: list[Msg] = []

    def pump_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "condition not reached before the deadline"
            if self.socket.poll(50):
                while True:
                    try:
                        frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    _, seq, payload = wire.parse_live_frames(frames)
                    self.msgs.append((seq, self.decoder.decode(payload), bytes(payload)))

    def rank_batches(self, rank: int) -> list[wire.EventBatch]:
        return [b for _, b, _ in self.msgs if b.dp_rank == rank and b.events]


def replay(ctx: zmq.Context[Any], endpoint: str, start: int, snapshot: bool = False) -> list[list[bytes]]:
    """Raw reply frames (as a DEALER sees them) up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(wire.replay_request_frames(start, snapshot))
        replies: list[list[bytes]] = []
        while True:
            assert dealer.poll(10_000), "no replay reply"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[-2:] == [wire.END_SEQ_BYTES, b""]:
                return replies
    finally:
        dealer.close(linger=0)


class Cluster:
    """A fan-in process plus rank processes, torn down whatever happens."""

    def __init__(self, config: PluginConfig, dp_size: int, channel: str) -> None:
        self.mp = spawn_context()
        self.config = config
        self.channel = channel
        self.go = self.mp.Event()
        self.done = self.mp.Queue()
        self.commands = self.mp.Queue()
        self.answers = self.mp.Queue()
        ready = self.mp.Event()
        self.fanin = self.mp.Process(
            target=run_fanin, args=(config, dp_size, channel, ready, self.commands, self.answers), daemon=True
        )
        self.fanin.start()
        assert ready.wait(30.0), "fan-in did not start"
        self.ranks: dict[int, Any] = {}

    def start_rank(self, rank: int, count: int, interval_s: float = 0.0, go: Any = None) -> Any:
        proc = self.mp.Process(
            target=run_rank,
            args=(self.config, rank, self.channel, count, go or self.go, self.done, interval_s),
            daemon=True,
        )
        proc.start()
        self.ranks[rank] = proc
        return proc

    def stats(self) -> dict[str, Any]:
        self.commands.put("stats")
        stats: dict[str, Any] = self.answers.get(timeout=10.0)
        return stats

    def close(self) -> None:
        for proc in self.ranks.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        self.commands.put("stop")
        self.fanin.join(10.0)
        if self.fanin.is_alive():
            self.fanin.kill()
            self.fanin.join(5.0)


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(dp_size: int, channel_kind: str = "unixpkt", **overrides: Any) -> Cluster:
        values: dict[str, Any] = {
            "endpoint": free_tcp_endpoint(),
            "replay_endpoint": free_tcp_endpoint(),
            "bind": True,
            "heartbeat_s": 0.2,
            "topic": "kv",
        }
        values.update(overrides)
        # unixpkt: the default channel on one node; ipc: ZMQ's, the fallback and an option
        channel = f"{channel_kind}://{tmp_path}/ch{len(clusters)}.sock"
        cluster = Cluster(PluginConfig(**values), dp_size, channel)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


def check_rank_batch(batch: wire.EventBatch, rank: int, index: int) -> None:
    expected = batch_events(rank, index)
    assert len(batch.events) == len(expected)
    for got, want in zip(batch.events, expected, strict=True):
        assert type(got) is type(want)
        assert got.medium in (wire.MEDIUM_GPU, wire.MEDIUM_CPU)  # type: ignore[union-attr,operator]
        assert got.block_hashes == want.block_hashes  # type: ignore[union-attr]
        if isinstance(got, wire.BlockStored):
            assert isinstance(want, wire.BlockStored)
            assert got.token_ids == want.token_ids and got.parent_block_hash == want.parent_block_hash
            assert got.block_size == BLOCK_SIZE
            assert got.medium == (want.medium or wire.MEDIUM_GPU)


def wait_for_heartbeat(sub: Sub) -> None:
    sub.pump_until(lambda: any(not b.events and b.dp_rank is None for _, b, _ in sub.msgs))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("dp_size", "channel_kind"), [(1, "unixpkt"), (2, "unixpkt"), (4, "unixpkt"), (16, "unixpkt"), (16, "ipc")]
)
def test_every_event_once_in_order_tagged(
    dp_size: int, channel_kind: str, cluster_factory: Callable[..., Cluster], ctx: Any
) -> None:
    count = 30
    cluster = cluster_factory(dp_size, channel_kind)
    sub = Sub(ctx, cluster.config.endpoint, b"kv")
    wait_for_heartbeat(sub)  # the subscription is live: nothing after this can be missed
    for rank in range(dp_size):
        cluster.start_rank(rank, count)
    cluster.go.set()
    sub.pump_until(lambda: all(len(sub.rank_batches(r)) >= count for r in range(dp_size)))
    heartbeats_before = sum(1 for _, b, _ in sub.msgs if not b.events)
    sub.pump_until(lambda: sum(1 for _, b, _ in sub.msgs if not b.events) > heartbeats_before)

    for rank in range(dp_size):
        batches = sub.rank_batches(rank)
        assert len(batches) == count  # exactly once
        for index, batch in enumerate(batches):  # per-rank order kept
            check_rank_batch(batch, rank, index)
    assert all(b.dp_rank is None for _, b, _ in sub.msgs if not b.events)
    seqs = [seq for seq, _, _ in sub.msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous instance seq
    assert len({wire.seq_epoch(s) for s in seqs}) == 1 and wire.seq_epoch(seqs[0]) > 0

    stats = cluster.stats()
    assert stats["malformed"] == 0 and stats["never_seen"] == []
    for rank in range(dp_size):
        assert stats["ranks"][rank]["gaps"] == 0 and stats["ranks"][rank]["last_rank_seq"] >= count - 1

    # Replay from a seq in the middle: exactly the batches from there, SGLang 0.5.23's frames.
    middle = len(sub.msgs) // 2
    start = sub.msgs[middle][0]
    replies = replay(ctx, cluster.config.replay_endpoint or "", start)
    assert replies[-1] == [b"", b"", wire.END_SEQ_BYTES, b""]
    body = replies[:-1]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == b"kv" for f in body)
    live_tail = [(seq, payload) for seq, _, payload in sub.msgs[middle:]]
    replayed = [(wire.decode_seq(f[2]), f[3]) for f in body]
    assert replayed[: len(live_tail)] == live_tail
    assert all(not wire.BatchDecoder().decode(p).events for _, p in replayed[len(live_tail) :])  # later heartbeats


def apply_stream(states: dict[int, RankResidency], batch: wire.EventBatch) -> None:
    if batch.dp_rank is not None:
        states.setdefault(batch.dp_rank, RankResidency()).apply_all(batch.events)


def canonical(states: dict[int, RankResidency]) -> dict[int, dict[str, dict[int, tuple[int | None, list[int]]]]]:
    return {
        rank: {m: {h: (res.parent(h, m), res.tokens(h, m)) for h in res.hashes(m)} for m in res.counts()}
        for rank, res in states.items()
        if len(res)
    }


class LateJoiner:
    """A late subscriber: snapshot + tail, then live batches newer than what it applied."""

    def __init__(self, ctx: Any, config: PluginConfig, start: int, snapshot: bool) -> None:
        self.sub = Sub(ctx, config.endpoint, b"kv")
        self.sub.pump_until(lambda: len(self.sub.msgs) > 0)  # subscribed before asking
        self.states: dict[int, RankResidency] = {}
        self.last = -1
        self.applied = 0
        decoder = wire.BatchDecoder()
        replies = replay(ctx, config.replay_endpoint or "", start, snapshot)
        snapshot_seq = None
        for frames in replies[:-1]:
            reply = wire.parse_replay_reply(frames)
            batch = decoder.decode(reply.payload)
            if snapshot_seq is None:
                snapshot_seq = reply.seq
                assert isinstance(batch.events[0], wire.AllBlocksCleared)
            assert reply.seq >= self.last
            self.last = reply.seq
            apply_stream(self.states, batch)
        assert snapshot_seq is not None and snapshot_seq >= self.sub.msgs[0][0] - 1
        self.catch_up()

    def catch_up(self) -> None:
        for seq, batch, _ in self.sub.msgs[self.applied :]:
            if seq > self.last:
                assert seq == self.last + 1, "live stream must continue right after the reply"
                apply_stream(self.states, batch)
                self.last = seq
        self.applied = len(self.sub.msgs)


@pytest.mark.timeout(120)
def test_snapshot_after_more_batches_than_the_buffer(cluster_factory: Callable[..., Cluster], ctx: Any) -> None:
    dp_size, count = 4, 2500  # 10,000 rank batches through a 500-batch buffer
    cluster = cluster_factory(dp_size, buffer_steps=500)
    full = Sub(ctx, cluster.config.endpoint, b"kv")
    wait_for_heartbeat(full)
    for rank in range(dp_size):
        cluster.start_rank(rank, count, interval_s=0.0003)
    cluster.go.set()
    total = dp_size * count

    def received() -> int:
        return sum(len(full.rank_batches(r)) for r in range(dp_size))

    full.pump_until(lambda: received() >= total // 3)
    late = LateJoiner(ctx, cluster.config, full.msgs[0][0], snapshot=False)  # too old -> snapshot
    full.pump_until(lambda: received() >= total)
    late.sub.pump_until(lambda: late.sub.msgs[-1][0] >= full.msgs[-1][0])
    late.catch_up()
    full_states: dict[int, RankResidency] = {}
    for _, batch, _ in full.msgs:
        apply_stream(full_states, batch)
    assert sum(len(r) for r in full_states.values()) > 1000
    assert canonical(late.states) == canonical(full_states)

    # An explicit snapshot request with a current seq gives the same state with nothing else.
    explicit = LateJoiner(ctx, cluster.config, full.msgs[-1][0], snapshot=True)
    assert canonical(explicit.states) == canonical(full_states)
    stats = cluster.stats()
    assert stats["snapshots_served"] == 2 and all(s["gaps"] == 0 for s in stats["ranks"].values())


@pytest.mark.timeout(90)
def test_kill_9_rank_others_keep_flowing_restart_detected(cluster_factory: Callable[..., Cluster], ctx: Any) -> None:
    cluster = cluster_factory(3)
    sub = Sub(ctx, cluster.config.endpoint, b"kv")
    wait_for_heartbeat(sub)
    for rank in range(3):
        cluster.start_rank(rank, -1, interval_s=0.01)
    cluster.go.set()
    sub.pump_until(lambda: all(len(sub.rank_batches(r)) >= 5 for r in range(3)))
    victim = cluster.ranks[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10.0)
    seen_at_kill = {r: len(sub.rank_batches(r)) for r in (0, 2)}

    def reported_dead() -> bool:
        sub.pump_until(lambda: True)
        return 1 in cluster.stats()["dead"]

    deadline = time.monotonic() + 20.0
    while not reported_dead():
        assert time.monotonic() < deadline, "the dead rank was never reported"
    stats = cluster.stats()
    assert stats["dead"] == [1] and stats["ranks"][0]["alive"] and stats["ranks"][2]["alive"]
    sub.pump_until(lambda: all(len(sub.rank_batches(r)) >= seen_at_kill[r] + 10 for r in (0, 2)))

    mark = len(sub.msgs)
    cluster.start_rank(1, -1, interval_s=0.01)  # same rank, new process: new rank epoch
    # the fan-in's AllBlocksCleared for the restarted rank, then its first new batch
    sub.pump_until(lambda: sum(1 for _, b, _ in sub.msgs[mark:] if b.dp_rank == 1 and b.events) >= 2)
    rank1 = [b for _, b, _ in sub.msgs[mark:] if b.dp_rank == 1]
    assert [type(e) for e in rank1[0].events] == [wire.AllBlocksCleared]  # stale blocks dropped first
    check_rank_batch(rank1[1], 1, 0)
    stats = cluster.stats()
    assert stats["ranks"][1]["restarts"] == 1 and stats["rank_restarts"] == 1
    assert stats["ranks"][1]["alive"] and stats["dead"] == []


def _fanin_inprocess(tcp_channel: str, **overrides: Any) -> FanIn:
    values: dict[str, Any] = {"endpoint": free_tcp_endpoint(), "bind": True, "heartbeat_s": 0.2}
    values.update(overrides)
    fanin = FanIn(PluginConfig(**values), 2, channel_endpoint=tcp_channel)
    fanin.start()
    return fanin


@pytest.mark.timeout(30)
def test_malformed_channel_frames_are_counted_and_skipped(ctx: Any) -> None:
    channel = free_tcp_endpoint()
    fanin = _fanin_inprocess(channel)
    try:
        sub = Sub(ctx, fanin.config.endpoint)
        wait_for_heartbeat(sub)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(channel)
        untagged = wire.enrich_batch(
            wire.EventBatch(ts=1.0, events=batch_events(0, 0)), dp_rank=0, block_size=BLOCK_SIZE
        )
        untagged.dp_rank = None
        good = msgspec.msgpack.encode(untagged)
        push.send_multipart([b"only", b"two"])
        push.send_multipart([b"wrong!", b"x" * 20, good])
        push.send_multipart([b"kvpub1", b"short", good])
        push.send_multipart(channel_frames(0, 7, 0, b"\xc1 not msgpack"))
        push.send_multipart(channel_frames(0, 7, 1, b""))  # rank heartbeat: liveness only
        push.send_multipart(channel_frames(0, 7, 2, good))  # untagged payload: re-tagged with rank 0
        sub.pump_until(lambda: len(sub.rank_batches(0)) == 1)
        check_rank_batch(sub.rank_batches(0)[0], 0, 0)
        stats = fanin.stats()
        assert stats["malformed"] == 4
        assert stats["ranks"][0]["last_rank_seq"] == 2 and stats["ranks"][0]["gaps"] == 0
        assert [b.dp_rank for _, b, _ in sub.msgs if b.events] == [0]
        push.send_multipart(channel_frames(0, 7, 5, good))  # 3 and 4 lost
        push.send_multipart(channel_frames(0, 7, 5, good))  # duplicate
        sub.pump_until(lambda: fanin.stats()["ranks"][0]["duplicates"] == 1)
        assert fanin.stats()["ranks"][0]["gaps"] == 2
        push.close(linger=0)
    finally:
        fanin.stop()


@pytest.mark.timeout(30)
def test_a_failing_loop_turn_is_counted_and_the_stream_goes_on(ctx: Any) -> None:
    channel = free_tcp_endpoint()
    fanin = _fanin_inprocess(channel)
    failures: list[int] = []
    liveness = fanin._check_liveness

    def fails_once(now: float) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("injected fault")
        liveness(now)

    fanin._check_liveness = fails_once  # type: ignore[method-assign]
    try:
        sub = Sub(ctx, fanin.config.endpoint)
        sub.pump_until(lambda: fanin.stats()["loop_errors"] == 1)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(channel)
        batch = wire.enrich_batch(wire.EventBatch(ts=1.0, events=batch_events(1, 0)), dp_rank=1, block_size=BLOCK_SIZE)
        push.send_multipart(channel_frames(1, 7, 0, msgspec.msgpack.encode(batch)))
        sub.pump_until(lambda: len(sub.rank_batches(1)) == 1)
        check_rank_batch(sub.rank_batches(1)[0], 1, 0)
        push.close(linger=0)
    finally:
        fanin.stop()


@pytest.mark.timeout(30)
def test_bad_replay_requests_do_not_stop_the_router(ctx: Any) -> None:
    fanin = _fanin_inprocess(free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint())
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(fanin.config.replay_endpoint or "")
        dealer.send_multipart([b"", b"123"])  # short seq
        dealer.send_multipart([b"", wire.encode_seq(0), b"what"])  # unknown 4th frame
        future = wire.make_seq(fanin.epoch, 1 << 39)
        replies = replay(ctx, fanin.config.replay_endpoint or "", future)  # nothing newer: just the end marker
        assert replies == [[b"", b"", wire.END_SEQ_BYTES, b""]]
        # The bad requests came on another connection: nothing orders them before the replay
        # request, so wait for their count (seen 0 once under load) instead of reading it once.
        deadline = time.monotonic() + 10
        while fanin.stats()["bad_requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a counter with a deadline
        assert fanin.stats()["bad_requests"] == 2
        dealer.close(linger=0)
    finally:
        fanin.stop()


@pytest.mark.timeout(30)
def test_dp_size_1_inproc_in_one_process(ctx: Any) -> None:
    """With dp_size 1 the rank process can serve the stream itself over an inproc channel."""
    config = PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2)
    fanin = FanIn(config, 1, channel_endpoint="inproc://kvpub-rank", context=ctx)
    fanin.start()
    publisher = RankPublisher(config, 0, BLOCK_SIZE, "inproc://kvpub-rank", context=ctx)
    try:
        sub = Sub(ctx, config.endpoint)
        wait_for_heartbeat(sub)
        for index in range(3):
            publisher.publish(wire.EventBatch(ts=time.time(), events=batch_events(0, index)))
        sub.pump_until(lambda: len(sub.rank_batches(0)) == 3)
        for index, batch in enumerate(sub.rank_batches(0)):
            check_rank_batch(batch, 0, index)
        assert fanin.stats()["ranks"][0]["resident"] == {wire.MEDIUM_GPU: 3}
        assert hash_of(0, 2) in fanin._residency[0].hashes()
    finally:
        publisher.shutdown()
        fanin.stop()


@pytest.mark.unit
def test_default_channel_endpoint_is_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    first = default_channel_endpoint("tcp://*:5557")
    assert first == default_channel_endpoint("tcp://*:5557") != default_channel_endpoint("tcp://*:5558")
    assert first.startswith("unixpkt://")  # Linux: the Unix SEQPACKET channel
    directory = Path(first[len("unixpkt://") :]).parent
    assert directory.parent == tmp_path and (directory.stat().st_mode & 0o777) == 0o700


@pytest.mark.timeout(30)
def test_first_start_freezes_the_host_objects_once(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first fan-in start of a process moves the objects alive then to the GC's permanent
    generation (full collections on the forwarding path skip them); later starts do not
    freeze again, so objects made since stay collectable."""
    import gc

    from sglang_kvpub.publish import fanin as fanin_module

    monkeypatch.setattr(fanin_module, "_frozen", [False])
    freezes: list[int] = []
    real_freeze = gc.freeze

    def counted_freeze() -> None:
        freezes.append(1)
        real_freeze()

    monkeypatch.setattr(gc, "freeze", counted_freeze)
    gc.unfreeze()
    marker = [object()]  # alive before the first start: frozen with the rest
    first = FanIn(PluginConfig(endpoint=free_tcp_endpoint(), bind=True), 1, channel_endpoint="inproc://f1", context=ctx)
    try:
        first.start()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and marker and len(freezes) == 1
        later = [[object()] for _ in range(5_000)]  # made after: not frozen by the next start
        second = FanIn(
            PluginConfig(endpoint=free_tcp_endpoint(), bind=True), 1, channel_endpoint="inproc://f2", context=ctx
        )
        second.start()
        second.stop()
        # Frozen objects that die leave the permanent generation, so the count may fall;
        # a second freeze would have raised it by every list in ``later``.
        assert len(freezes) == 1
        assert gc.get_freeze_count() < frozen + len(later)
    finally:
        first.stop()
        gc.unfreeze()
