"""`sglang-kvpub fanin` (a real subprocess) against plain per-rank publishers on base+rank.

The per-rank publishers behave like SGLang 0.5.23's ZmqEventPublisher: PUB on base+rank
with ``[topic, seq, payload]`` (seq from 0 per start), a replay ROUTER on
replay_base+rank answering ``[id, b"", start]`` with ``[id, b"", topic, seq, payload]``
and the END_SEQ marker, and batches that leave ``medium`` unset.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_port_block, free_tcp_endpoint
from kvpub_procs import BLOCK_SIZE, batch_events

from fanin.test_fanin import Sub, check_rank_batch, replay, wait_for_heartbeat
from sglang_kvpub import wire

pytestmark = pytest.mark.integration

TOPIC = b"kv"


class PlainRank:
    """One SGLang-like rank publisher; ``live=False`` keeps a batch in the replay buffer only."""

    def __init__(self, ctx: zmq.Context[Any], rank: int, port: int, replay_port: int) -> None:
        self.rank = rank
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.lock = threading.Lock()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish_payload(self, payload: bytes, live: bool = True) -> None:
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if live:
                self.pub.send_multipart([TOPIC, wire.encode_seq(seq), payload])

    def publish(self, index: int, live: bool = True) -> None:
        events = batch_events(self.rank, index)
        for event in events:
            if isinstance(event, wire.BlockStored):
                event.block_size = BLOCK_SIZE
        self.publish_payload(msgspec.msgpack.encode(wire.EventBatch(ts=1.0, events=events, dp_rank=self.rank)), live)

    def restart(self) -> None:
        with self.lock:
            self.seq = 0
            self.buffer = []

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, start = frames[0], wire.decode_seq(frames[2])
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in items:
                self.router.send_multipart([identity, b"", TOPIC, wire.encode_seq(seq), payload])
            self.router.send_multipart([identity, b"", b"", wire.END_SEQ_BYTES, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def ordered_indices(sub: Sub, rank: int) -> list[int]:
    """Which batch_events index each rank batch is (by its first stored hash)."""
    out = []
    for batch in sub.rank_batches(rank):
        first = batch.events[0]
        if isinstance(first, wire.BlockStored):
            out.append((first.block_hashes[0] & 0xFFFFFFFF) - 1)
    return out


@pytest.mark.timeout(90)
def test_sidecar_fans_in_replays_gaps_detects_restarts(ctx: Any) -> None:
    dp_size = 3
    base = free_port_block(dp_size)
    replay_base = free_port_block(dp_size)
    ranks = [PlainRank(ctx, r, base + r, replay_base + r) for r in range(dp_size)]
    endpoint, instance_replay = free_tcp_endpoint(), free_tcp_endpoint()
    for rank in ranks:  # history from before the sidecar: fetched by replay on first contact
        rank.publish(0)
        rank.publish(1)
    cmd = [
        sys.executable, "-m", "sglang_kvpub.cli", "fanin",
        "--rank-base", f"tcp://127.0.0.1:{base}", "--dp-size", str(dp_size),
        "--rank-replay-base", f"tcp://127.0.0.1:{replay_base}",
        "--endpoint", endpoint.replace("127.0.0.1", "*"), "--replay-endpoint", instance_replay,
        "--topic", "kv", "--heartbeat-s", "0.2", "--status-interval", "0.5",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sub = Sub(ctx, endpoint, TOPIC)
        wait_for_heartbeat(sub)
        next_index = [2] * dp_size

        def probe_until_seen(rank: int, index_at_least: int) -> None:
            def seen() -> bool:
                if max(ordered_indices(sub, rank), default=-1) >= index_at_least:
                    return True
                ranks[rank].publish(next_index[rank])  # slow joiner: keep publishing live batches
                next_index[rank] += 1
                return False

            sub.pump_until(seen)

        for r in range(dp_size):
            probe_until_seen(r, 2)
        # gaps: two batches only in the replay buffer, then a live one
        for r in range(dp_size):
            ranks[r].publish(next_index[r], live=False)
            ranks[r].publish(next_index[r] + 1, live=False)
            ranks[r].publish(next_index[r] + 2)
            next_index[r] += 3
        ranks[2].publish_payload(b"\xc1garbage")  # malformed: counted and skipped
        ranks[2].publish(next_index[2])
        next_index[2] += 1
        sub.pump_until(lambda: all(max(ordered_indices(sub, r), default=-1) == next_index[r] - 1 for r in range(3)))
        for r in range(dp_size):
            indices = ordered_indices(sub, r)
            assert indices == list(range(next_index[r])), f"rank {r}"  # every batch once, in order
            for index, batch in enumerate(sub.rank_batches(r)):
                check_rank_batch(batch, r, index)  # enriched: medium GPU set by the fan-in

        mark = len(sub.msgs)
        ranks[1].restart()
        ranks[1].publish(0)
        sub.pump_until(lambda: len([b for _, b, _ in sub.msgs[mark:] if b.dp_rank == 1]) >= 2)
        after = [b for _, b, _ in sub.msgs[mark:] if b.dp_rank == 1]
        assert [type(e) for e in after[0].events] == [wire.AllBlocksCleared]
        check_rank_batch(after[1], 1, 0)
        seqs = [s for s, _, _ in sub.msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        replies = replay(ctx, instance_replay, 0)  # another epoch: a snapshot of every rank
        snapshot = [wire.BatchDecoder().decode(f[3]) for f in replies[:-1]]
        assert sorted({b.dp_rank for b in snapshot if b.events and isinstance(b.events[0], wire.AllBlocksCleared)}) == [
            0,
            1,
            2,
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        for rank in ranks:
            rank.close()
    assert proc.returncode == 0, err
    final = [line for line in err.splitlines() if "(stopped)" in line][-1]
    assert "malformed 1" in final and "restarts 1" in final
    assert "replayed" in final and " replayed 0 " not in final


@pytest.mark.timeout(30)
def test_sidecar_rejects_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "sglang_kvpub.cli", "fanin", "--rank-base", "ipc:///tmp/x", "--dp-size", "2"]
    result = subprocess.run([*cmd, "--endpoint", "tcp://*:1"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 2 and "ipc cannot be offset" in result.stderr
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-m", "sglang_kvpub.cli", "fanin", "--rank-base", "tcp://127.0.0.1:1", "--dp-size", "1",
         "--endpoint", "http://nope"],
        capture_output=True, text=True, timeout=20, env=env,
    )  # fmt: skip
    assert result.returncode == 2 and "'endpoint'" in result.stderr


def _sidecar_heartbeat(sub: zmq.Socket[bytes], args: list[str]) -> str:
    """Starts the sidecar with ``args``; returns its start line once ``sub`` got a heartbeat."""
    cmd = [sys.executable, "-m", "sglang_kvpub.cli", "fanin", "--rank-base", free_tcp_endpoint(), "--dp-size", "1"]
    proc = subprocess.Popen(
        [*cmd, "--heartbeat-s", "0.1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert sub.poll(20_000), "no heartbeat reached the subscriber"
        frames = sub.recv_multipart()
        assert wire.BatchDecoder().decode(wire.parse_live_frames(frames)[2]).events == []
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    return out.splitlines()[0]


@pytest.mark.timeout(60)
def test_sidecar_binds_a_concrete_host_and_connects_only_when_asked(ctx: Any) -> None:
    endpoint = free_tcp_endpoint()  # tcp://127.0.0.1:PORT: SGLang's rule would connect it
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    line = _sidecar_heartbeat(sub, ["--endpoint", endpoint])
    assert f"bound on {endpoint}" in line
    sub.close()

    endpoint = free_tcp_endpoint()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)  # --connect: the subscriber is the stable end
    line = _sidecar_heartbeat(sub, ["--endpoint", endpoint, "--connect"])
    assert f"CONNECTED to (a subscriber must bind there) {endpoint}" in line
    sub.close()
