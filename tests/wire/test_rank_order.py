"""Per-rank order on the instance stream: each rank's (epoch, seq) is contiguous through a
rank restart and a replay, and ``sglang-kvpub tail --check`` names the rank that lost a batch.

Real parts: a :class:`FanIn` fed through :meth:`FanIn.ingest` (the sidecar's path) publishing
on loopback, plain SUB / DEALER sockets, a relay (XPUB) between the fan-in and the real
``sglang-kvpub tail`` CLI run as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from conftest import free_tcp_port

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.transport.replay import ReplayClient

pytestmark = pytest.mark.integration

BS = 4
EPOCH_0, EPOCH_1, EPOCH_1B = 11, 21, 22


def stored(seed: int) -> wire.EventBatch:
    tokens = [seed * 10 + i for i in range(BS)]
    event = wire.BlockStored([seed], None, tokens, BS, None, wire.MEDIUM_GPU)
    return wire.EventBatch(ts=time.time(), events=[event])


class Rig:
    def __init__(self) -> None:
        self.config = PluginConfig(
            endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            heartbeat_s=3600.0,  # only the start's heartbeat: the test counts every message
            load_report_s=0,
            rank_order=True,
        )
        self.fanin = FanIn(self.config, 2, listen_channel=False)
        self.fanin.start()
        self.context: zmq.Context[Any] = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(self.config.endpoint)
        self.messages: list[tuple[int, bytes]] = []
        self.rank_seq = {0: 0, 1: 0}
        self.seed = 0
        while not self.messages:  # the SUB is up once a probe of rank 0 arrives
            self.send(0, EPOCH_0)
            self.receive(until=lambda: bool(self.messages), timeout_s=0.2, must=False)

    def send(self, rank: int, epoch: int) -> None:
        self.seed += 1
        self.fanin.ingest(rank, epoch, self.rank_seq[rank], stored(self.seed))
        self.rank_seq[rank] += 1

    def receive(self, until: Any, timeout_s: float = 20.0, must: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                assert not must, "messages did not arrive"
                return
            if self.sub.poll(20):
                _, seq, payload = wire.parse_live_frames(self.sub.recv_multipart())
                self.messages.append((seq, payload))

    def settle(self) -> None:
        last = self.fanin.stats()["seq"]
        self.receive(until=lambda: bool(self.messages) and self.messages[-1][0] >= last)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()
        self.fanin.stop()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    try:
        yield made
    finally:
        made.close()


def scenario(rig: Rig) -> None:
    """Both ranks publish; rank 1 restarts (a new rank epoch) and publishes again."""
    for _ in range(4):
        rig.send(0, EPOCH_0)
        rig.send(1, EPOCH_1)
    rig.rank_seq[1] = 0
    for _ in range(2):
        rig.send(1, EPOCH_1B)
    rig.settle()


def orders(messages: list[tuple[int, bytes]]) -> list[tuple[int | None, wire.RankOrder | None]]:
    return [wire.read_rank_order(payload) for _, payload in messages]


def test_each_ranks_order_is_contiguous_through_a_restart() -> None:
    rig = Rig()
    try:
        scenario(rig)
        check = wire.RankOrderCheck()
        gaps = [gap for rank, order in orders(rig.messages) if (gap := check.observe(rank, order))]
        assert gaps == [] and check.restarts == {1: 1}
        tagged = [(rank, o.epoch, o.seq) for rank, o in orders(rig.messages) if o is not None]
        rank1 = [(epoch, seq) for rank, epoch, seq in tagged if rank == 1]
        # the fan-in's own clear opens the new epoch at seq 0
        assert rank1 == [(EPOCH_1, n) for n in range(4)] + [(EPOCH_1B, n) for n in range(3)]
        opened = [
            p
            for (r, o), (_, p) in zip(orders(rig.messages), rig.messages, strict=True)
            if o and (r, o.epoch, o.seq) == (1, EPOCH_1B, 0)
        ]
        assert [type(e) for e in wire.BatchDecoder().decode(opened[0]).events] == [wire.AllBlocksCleared]
        # every reader that does not know the order still reads the batches (trailing element)
        for _, payload in rig.messages:
            wire.BatchDecoder().decode(payload)
    finally:
        rig.close()


def test_order_survives_a_replay_and_a_snapshot(rig: Rig) -> None:
    scenario(rig)
    first = rig.messages[3][0]
    with ReplayClient(rig.context, rig.config.replay_endpoint or "") as client:
        replayed = list(client.fetch(first, timeout_s=10.0))
        snapshot = list(client.fetch(0, snapshot=True, timeout_s=10.0))
    assert replayed == [m for m in rig.messages if m[0] >= first]  # the same bytes: the same orders
    check = wire.RankOrderCheck()
    for _, payload in snapshot:
        assert check.observe(*wire.read_rank_order(payload)) is None
    live_last = {rank: (o.epoch, o.seq) for rank, o in orders(rig.messages) if rank is not None and o is not None}
    assert check.positions() == live_last and live_last[1] == (EPOCH_1B, 2)  # the snapshot states where each rank is
    start = len(rig.messages)
    rig.send(0, EPOCH_0)
    rig.send(1, EPOCH_1B)
    rig.settle()
    assert [check.observe(*wire.read_rank_order(p)) for _, p in rig.messages[start:]] == [None, None]
    assert check.gaps == {}


def relay_to_tail(rig: Rig, drop: int | None) -> subprocess.CompletedProcess[str]:
    """Sends the fan-in's messages again on an XPUB (seq renumbered contiguous, message
    ``drop`` left out) to ``sglang-kvpub tail --check``; returns the finished CLI."""
    xpub = rig.context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    port = free_tcp_port()
    xpub.bind(f"tcp://127.0.0.1:{port}")
    kept = [m for i, m in enumerate(rig.messages) if i != drop]
    cmd = [sys.executable, "-m", "sglang_kvpub.cli", "tail", f"tcp://127.0.0.1:{port}", "--check"]
    cmd += ["--count", str(len(kept))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert xpub.poll(30_000), "tail never subscribed"
        xpub.recv()  # its subscription
        base = kept[0][0]
        for offset, (_, payload) in enumerate(kept):
            xpub.send_multipart(wire.live_frames(b"", base + offset, payload))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        xpub.close(linger=0)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_tail_check_reports_the_rank_that_lost_a_batch(rig: Rig) -> None:
    scenario(rig)
    ranks = [rank for rank, _ in orders(rig.messages)]
    drop = [i for i, rank in enumerate(ranks) if rank == 1][2]  # rank 1's third batch
    lost = wire.read_rank_order(rig.messages[drop][1])[1]
    assert lost is not None
    done = relay_to_tail(rig, drop)
    print(done.stderr)
    assert done.returncode == 1, done.stderr
    gap_line = f"rank gap: dp_rank 1 epoch {lost.epoch}: expected rank seq {lost.seq}, got {lost.seq + 1}"
    assert gap_line in done.stderr
    summary = json.loads(done.stderr.split("check: ", 1)[1].splitlines()[0])
    assert summary["instance_gaps"] == 0 and summary["gaps"] == {"1": 1}
    clean = relay_to_tail(rig, None)
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stderr.split("check: ", 1)[1].splitlines()[0])["gaps"] == {}


def test_the_adapters_stream_health_counts_the_lost_batch_per_rank(rig: Rig) -> None:
    """The adapter's subscriber behind the same relay: the instance seq is contiguous, yet the
    rank order shows rank 1 lost one batch (health ``rank_gaps``, the metric)."""
    from motor_adapter.adapter_metrics import AdapterMetrics
    from motor_adapter.stream import StreamSubscriber
    from sglang_kvpub.core.index import PrefixIndex

    scenario(rig)
    ranks = [rank for rank, _ in orders(rig.messages)]
    drop = [i for i, rank in enumerate(ranks) if rank == 1][2]
    xpub = rig.context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    xpub.bind(endpoint)
    sub = StreamSubscriber("inst", endpoint, PrefixIndex(BS), context=rig.context)
    sub.start()
    try:
        assert xpub.poll(30_000), "the adapter never subscribed"
        xpub.recv()
        kept = [m for i, m in enumerate(rig.messages) if i != drop]
        for offset, (_, payload) in enumerate(kept):
            xpub.send_multipart(wire.live_frames(b"", kept[0][0] + offset, payload))
        assert sub.wait_for(lambda h: h.rank_gaps == {1: 1}, 20), sub.health()
        assert sub.health().gaps == 0  # the instance seq had no hole
        text = AdapterMetrics().render({("m", "default", BS, endpoint): [sub.health()]}, [])
        assert 'motor_kv_adapter_stream_rank_gaps_total{engine_dp_rank="1",instance="inst",model="m"} 1' in text
    finally:
        sub.stop()
        xpub.close(linger=0)
