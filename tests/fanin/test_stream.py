"""StreamSubscriber against real publishers on loopback (tests/stream_publisher.py in a subprocess).

"Truth" is what the publisher process holds; the index must equal it via ``resident``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_port_block, free_tcp_endpoint

from motor_adapter.stream import StreamHealth, StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.core.index import PrefixIndex

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PUBLISHER = Path(__file__).resolve().parents[1] / "stream_publisher.py"
BLOCK_SIZE = 4
GPU = wire.MEDIUM_GPU
FAST = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, backoff_max_s=0.5, poll_s=0.02)


class Pub:
    """One stream_publisher.py process, driven by JSON lines."""

    def __init__(self, endpoint: str, replay: str | None, *args: str) -> None:
        self.endpoint = endpoint
        self.replay = replay
        argv = [sys.executable, str(PUBLISHER), "--endpoint", endpoint, "--block-size", str(BLOCK_SIZE), *args]
        if replay:
            argv += ["--replay-endpoint", replay]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"publisher exited with {self.proc.wait()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def cmd(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def truth(self, rank: int, medium: str = GPU) -> set[int]:
        ranks = self.cmd("truth")["truth"]
        return set(ranks.get(str(rank), {}).get(medium, []))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def make_pub() -> Iterator[Callable[..., Pub]]:
    pubs: list[Pub] = []

    def make(*args: str, endpoint: str | None = None, replay: str | None = None) -> Pub:
        pub = Pub(endpoint or free_tcp_endpoint(), replay, *args)
        pubs.append(pub)
        return pub

    yield make
    for pub in pubs:
        pub.close()


@pytest.fixture
def make_sub(ctx: zmq.Context[Any]) -> Iterator[Callable[..., StreamSubscriber]]:
    subs: list[StreamSubscriber] = []

    def make(index: PrefixIndex, pub: Pub, **kw: Any) -> StreamSubscriber:
        kw.setdefault("options", FAST)
        kw.setdefault("replay_endpoint", pub.replay)
        sub = StreamSubscriber("inst", pub.endpoint, index, context=ctx, **kw)
        subs.append(sub)
        sub.start()
        return sub

    yield make
    for sub in subs:
        sub.stop()
        assert not sub.is_alive()


def hashes(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def converged(sub: StreamSubscriber, index: PrefixIndex, pub: Pub, ranks: list[int], timeout: float = 10.0) -> bool:
    """Waits until the index holds exactly the publisher's blocks on every rank and medium."""
    truth = pub.cmd("truth")["truth"]
    media = {m for r in truth.values() for m in r} | {GPU}
    want = {(r, m): set(truth.get(str(r), {}).get(m, [])) for r in ranks for m in media}

    def same(_: StreamHealth) -> bool:
        return all(index.resident("inst", r, m) == blocks for (r, m), blocks in want.items())

    return sub.wait_for(same, timeout)


def receiving(health: StreamHealth) -> bool:
    return health.connected and health.last_seq is not None


def listen(sub: StreamSubscriber, pub: Pub) -> None:
    """Without periodic heartbeats: pings until the subscriber hears this connection."""
    while not sub.wait_for(lambda h: h.connected, 0.1):
        pub.cmd("heartbeat")


def instance_pub(make_pub: Callable[..., Pub], *args: str) -> Pub:
    return make_pub("--heartbeat", "0.05", *args, replay=free_tcp_endpoint())


# ---------------------------------------------------------------------------- instance stream


def test_in_order_stream_is_applied(make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]) -> None:
    pub = make_pub("--heartbeat", "0.05")  # no replay endpoint: the live stream alone
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub)
    assert sub.wait_for(receiving, 10)
    for rank in range(3):
        pub.cmd("store", rank=rank, hashes=hashes(100 * rank, 5))
    pub.cmd("remove", rank=1, hashes=[101, 102])
    pub.cmd("store", rank=2, hashes=[7001, 7002], medium=wire.MEDIUM_CPU)
    pub.cmd("remove", rank=2, hashes=[7001], medium=wire.MEDIUM_CPU)
    assert converged(sub, index, pub, [0, 1, 2])
    assert index.resident("inst", 1, GPU) == {100, 103, 104}
    assert index.resident("inst", 2, wire.MEDIUM_CPU) == {7002}
    health = sub.health()
    assert (health.gaps, health.decode_errors, health.restarts) == (0, 0, 0)
    assert health.events >= 6
    assert health.epoch == 1
    assert health.last_event_age_s is not None


def test_late_subscriber_starts_from_snapshot(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    pub = instance_pub(make_pub)
    pub.cmd("store", rank=0, hashes=hashes(1, 4))
    pub.cmd("store", rank=3, hashes=hashes(50, 2))
    pub.cmd("remove", rank=0, hashes=[2])
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub)
    assert converged(sub, index, pub, [0, 3])
    assert index.resident("inst", 0, GPU) == {1, 3, 4}
    assert sub.health().snapshots >= 1


@pytest.mark.parametrize("old_replies", [False, True], ids=["3-frame", "2-frame"])
def test_gap_is_filled_by_replay(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber], old_replies: bool
) -> None:
    pub = instance_pub(make_pub, *(["--old-replies"] if old_replies else []))
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub)
    pub.cmd("store", rank=0, hashes=hashes(10, 3))
    assert converged(sub, index, pub, [0])
    before = sub.health()
    pub.cmd("store", rank=1, hashes=hashes(20, 3), live=False)
    pub.cmd("remove", rank=0, hashes=[10], live=False)
    pub.cmd("store", rank=0, hashes=[99], live=False)
    pub.cmd("store", rank=1, hashes=[30])
    assert converged(sub, index, pub, [0, 1])
    assert index.resident("inst", 0, GPU) == {11, 12, 99}
    after = sub.health()
    assert after.gaps > before.gaps
    assert after.replays > before.replays
    assert after.replayed_batches - before.replayed_batches >= 3
    assert after.snapshots == before.snapshots
    assert after.restarts == 0


@pytest.mark.parametrize("auto_snapshot", [True, False], ids=["fanin-answers-snapshot", "asked-explicitly"])
def test_gap_older_than_buffer_rebuilds_from_snapshot(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber], auto_snapshot: bool
) -> None:
    args = ["--buffer-steps", "3", *([] if auto_snapshot else ["--no-auto-snapshot"])]
    pub = make_pub("--heartbeat", "0", *args, replay=free_tcp_endpoint())  # no heartbeats to roll the buffer
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub, options=StreamOptions(expect_heartbeats=False, replay_timeout_s=0.5, poll_s=0.02))
    listen(sub, pub)
    pub.cmd("store", rank=0, hashes=hashes(1, 4))
    pub.cmd("store", rank=1, hashes=hashes(100, 2))
    assert converged(sub, index, pub, [0, 1])
    before = sub.health()
    pub.cmd("remove", rank=0, hashes=[1, 2], live=False)  # stale unless the snapshot replaces the state
    pub.cmd("clear", rank=1, live=False)
    for i in range(6):
        pub.cmd("store", rank=2, hashes=[500 + i], live=False)
    pub.cmd("store", rank=0, hashes=[42])
    assert converged(sub, index, pub, [0, 1, 2])
    assert index.resident("inst", 0, GPU) == {3, 4, 42}
    assert index.resident("inst", 1, GPU) == set()
    after = sub.health()
    assert after.gaps > before.gaps
    assert after.snapshots > before.snapshots


def test_epoch_change_rebuilds_state(make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]) -> None:
    pub = instance_pub(make_pub)
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub)
    pub.cmd("store", rank=0, hashes=hashes(1, 3))
    pub.cmd("store", rank=1, hashes=hashes(11, 3))
    assert converged(sub, index, pub, [0, 1])
    pub.cmd("restart", epoch=7)
    pub.cmd("store", rank=0, hashes=[1, 77])
    assert converged(sub, index, pub, [0, 1])
    assert index.resident("inst", 0, GPU) == {1, 77}
    assert index.resident("inst", 1, GPU) == set()  # old epoch's blocks gone, not mixed
    health = sub.health()
    assert health.restarts >= 1
    assert health.epoch == 7


def test_malformed_frames_are_counted_and_skipped(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    pub = instance_pub(make_pub)
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub)
    assert sub.wait_for(receiving, 10)
    pub.cmd("store", rank=0, hashes=[1])
    pub.cmd("badframes")
    pub.cmd("garbage")
    pub.cmd("store", rank=0, hashes=[2])
    assert converged(sub, index, pub, [0])
    assert sub.wait_for(lambda h: h.decode_errors >= 3, 10)
    assert sub.is_alive()
    pub.cmd("store", rank=0, hashes=[3])
    assert converged(sub, index, pub, [0])
    assert index.resident("inst", 0, GPU) == {1, 2, 3}


# ---------------------------------------------------------------------------- compatibility mode


def test_compat_per_rank_streams_and_restart(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    ranks = 2
    base, replay_base = free_port_block(ranks), free_port_block(ranks)
    pubs = [
        make_pub(
            "--compat",
            "--rank",
            str(rank),
            endpoint=f"tcp://127.0.0.1:{base + rank}",
            replay=f"tcp://127.0.0.1:{replay_base + rank}",
        )
        for rank in range(ranks)
    ]
    index = PrefixIndex(BLOCK_SIZE)
    subs = [make_sub(index, pubs[rank], dp_rank_override=rank) for rank in range(ranks)]
    for rank, pub in enumerate(pubs):
        for i in range(3):
            pub.cmd("store", hashes=[1000 * rank + i])
    for rank in range(ranks):
        assert converged(subs[rank], index, pubs[rank], [rank])
    assert index.resident("inst", 1, GPU) == {1000, 1001, 1002}
    pubs[1].cmd("store", hashes=[1003])  # seen live: the sub now knows this connection's seqs
    assert subs[1].wait_for(lambda h: h.connected and h.last_seq == 3, 10)  # plain SGLang seq: 0..3
    pubs[1].cmd("restart")  # a restarted SGLang rank: seq from 0 again, empty cache
    pubs[1].cmd("store", hashes=[5555])
    assert subs[1].wait_for(lambda _h: index.resident("inst", 1, GPU) == {5555}, 10)
    assert subs[1].health().restarts == 1
    assert subs[1].health().last_seq == 0
    assert index.resident("inst", 0, GPU) == {0, 1, 2}  # the other rank untouched
    assert subs[0].health().restarts == 0


def test_compat_restart_seen_only_through_replay_is_detected(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    """The old seqs were only replayed, never seen live: a reused seq with other content is a restart."""
    pub = make_pub("--compat", replay=free_tcp_endpoint())
    for i in range(3):
        pub.cmd("store", hashes=[10 + i], live=False)
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub, dp_rank_override=0)
    assert converged(sub, index, pub, [0])
    assert sub.health().replayed_batches == 3
    pub.cmd("restart")
    pub.cmd("store", hashes=[99])
    assert sub.wait_for(lambda _h: index.resident("inst", 0, GPU) == {99}, 10)
    assert sub.health().restarts == 1


def test_compat_without_replay_endpoint_clears_rank_on_gap(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    pub = make_pub("--compat")
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, pub, dp_rank_override=2)
    listen(sub, pub)
    pub.cmd("store", hashes=[2])
    assert sub.wait_for(lambda _h: index.resident("inst", 2, GPU) == {2}, 10)
    pub.cmd("store", hashes=[3], live=False)
    pub.cmd("store", hashes=[4])  # a gap without replay: the rank is cleared, rebuilt from here on
    assert sub.wait_for(lambda _h: index.resident("inst", 2, GPU) == {4}, 10)
    assert sub.health().gaps == 1


# ---------------------------------------------------------------------------- real fan-in


def test_real_fanin_snapshot_live_rank_restart_and_fanin_restart(ctx: zmq.Context[Any]) -> None:
    fanin_mod = pytest.importorskip("sglang_kvpub.publish.fanin")
    from sglang_kvpub.config import PluginConfig

    endpoint, replay = free_tcp_endpoint(), free_tcp_endpoint()
    config = PluginConfig(endpoint=endpoint, replay_endpoint=replay, bind=True, heartbeat_s=0.05)
    truth: dict[int, set[int]] = {0: set(), 1: set()}
    rank_seq = [0, 0]

    def store(fanin: Any, rank: int, blocks: list[int], epoch: int = 1) -> None:
        tokens = [b % 1000 for b in blocks for _ in range(BLOCK_SIZE)]
        event = wire.BlockStored(block_hashes=blocks, token_ids=tokens, block_size=BLOCK_SIZE)
        fanin.ingest(rank, epoch, rank_seq[rank], wire.EventBatch(ts=0.0, events=[event]))
        rank_seq[rank] += 1
        truth[rank].update(blocks)

    def same(_: StreamHealth) -> bool:
        return all(index.resident("inst", r, GPU) == truth[r] for r in truth)

    fanin = fanin_mod.FanIn(config, 2, listen_channel=False)
    fanin.start()
    try:
        store(fanin, 0, [1, 2, 3])
        store(fanin, 1, [11, 12])
        index = PrefixIndex(BLOCK_SIZE)
        sub = StreamSubscriber("inst", endpoint, index, replay_endpoint=replay, context=ctx, options=FAST)
        sub.start()
        try:
            assert sub.wait_for(same, 10)  # a late subscriber: from the snapshot
            assert sub.health().snapshots >= 1
            store(fanin, 1, [13])
            assert sub.wait_for(same, 10)
            rank_seq[1] = 0
            truth[1] = set()
            store(fanin, 1, [21], epoch=2)  # rank 1 restarted: the fan-in clears it first
            assert sub.wait_for(same, 10)
            old_epoch = fanin.epoch
            fanin.stop()
            fanin = fanin_mod.FanIn(config, 2, listen_channel=False)  # same ports, a new epoch
            fanin.start()
            truth = {0: set(), 1: set()}
            rank_seq[:] = [0, 0]
            store(fanin, 0, [3, 40])
            assert sub.wait_for(lambda h: same(h) and h.epoch == fanin.epoch, 15)
            assert fanin.epoch != old_epoch
            assert sub.health().restarts >= 1
        finally:
            sub.stop()
    finally:
        fanin.stop()


# ---------------------------------------------------------------------------- lifecycle


def test_stop_is_prompt_during_a_replay_wait(ctx: zmq.Context[Any]) -> None:
    replay = free_tcp_endpoint()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay)
    try:
        options = StreamOptions(replay_timeout_s=120.0)
        sub = StreamSubscriber(
            "inst", free_tcp_endpoint(), PrefixIndex(BLOCK_SIZE), replay_endpoint=replay, context=ctx, options=options
        )
        sub.start()
        assert router.poll(10_000), "no snapshot request arrived"
        _identity, _start, snapshot = wire.parse_replay_request(router.recv_multipart())
        assert snapshot  # the request is pending and never answered: the thread waits in the replay
        sub.stop(timeout=5.0)
        assert not sub.is_alive()
    finally:
        router.close(0)


def test_reconnects_after_publisher_restart_on_same_port(
    make_pub: Callable[..., Pub], make_sub: Callable[..., StreamSubscriber]
) -> None:
    endpoint, replay = free_tcp_endpoint(), free_tcp_endpoint()
    first = make_pub("--heartbeat", "0.05", "--epoch", "3", endpoint=endpoint, replay=replay)
    index = PrefixIndex(BLOCK_SIZE)
    sub = make_sub(index, first)
    first.cmd("store", rank=0, hashes=hashes(1, 3))
    first.cmd("store", rank=1, hashes=[9])
    assert converged(sub, index, first, [0, 1])
    first.kill()
    assert sub.wait_for(lambda h: not h.connected and h.reconnects >= 1, 15)
    second = make_pub("--heartbeat", "0.05", "--epoch", "4", endpoint=endpoint, replay=replay)
    second.cmd("store", rank=0, hashes=[3, 40])
    assert converged(sub, index, second, [0, 1], timeout=15)
    assert index.resident("inst", 1, GPU) == set()
    assert sub.wait_for(lambda h: h.connected and h.epoch == 4, 10)
