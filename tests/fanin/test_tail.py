"""``sglang-kvpub tail`` against a real instance stream (fan-in + rank publishers) in a subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_tcp_endpoint

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher
from sglang_kvpub.tools import tail

BLOCK = 4


def _tail_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_kvpub.cli", "tail", *args]


def _stored(rank: int, index: int) -> wire.BlockStored:
    tokens = [rank * 100 + index * BLOCK + j for j in range(BLOCK)]
    return wire.BlockStored(
        block_hashes=[rank << 20 | index], parent_block_hash=None, token_ids=tokens, block_size=BLOCK
    )


@pytest.fixture
def instance(ipc_dir: Path) -> Iterator[tuple[FanIn, list[RankPublisher]]]:
    config = PluginConfig(
        endpoint=free_tcp_endpoint().replace("127.0.0.1", "*"),
        replay_endpoint=free_tcp_endpoint(),
        heartbeat_s=60.0,
        topic="kv",
    )
    channel = f"ipc://{ipc_dir}/channel"
    fanin = FanIn(config, 2, channel_endpoint=channel)
    fanin.start()
    ranks = [RankPublisher(config, rank, BLOCK, channel) for rank in range(2)]
    try:
        yield fanin, ranks
    finally:
        for rank_publisher in ranks:
            rank_publisher.shutdown()
        fanin.stop()


def _wait_for_batches(fanin: FanIn, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(r["batches"] for r in fanin.stats()["ranks"].values()) < count:
        assert time.monotonic() < deadline, "fan-in did not receive the batches"
        time.sleep(0.01)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_tail_json_replays_history_in_the_documented_shape(instance: tuple[FanIn, list[RankPublisher]]) -> None:
    fanin, ranks = instance
    for index in range(3):
        for rank, publisher in enumerate(ranks):
            publisher.publish(wire.EventBatch(ts=time.time(), events=[_stored(rank, index)]))
    _wait_for_batches(fanin, 6)
    config = fanin.config
    assert config.replay_endpoint is not None
    endpoint = config.endpoint.replace("*", "127.0.0.1")
    first_seq = wire.make_seq(fanin.epoch, 0)
    total = fanin.stats()["batches"]  # the data batches plus the fan-in's first heartbeat
    result = subprocess.run(
        _tail_cmd(
            *(endpoint, "--topic", "kv", "--replay-endpoint", config.replay_endpoint),
            *("--from-seq", str(first_seq), "--json", "--count", str(total)),
        ),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    data = [line for line in lines if line["events"]]
    assert len(data) == 6
    assert {line["dp_rank"] for line in data} == {0, 1}
    first = data[0]["events"][0]
    assert set(first) >= {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name"}
    assert first["type"] == "BlockStored" and first["medium"] == "GPU" and first["block_size"] == BLOCK
    seqs = [line["seq"] for line in lines]
    assert seqs == sorted(seqs) and all(isinstance(s, int) for s in seqs)
    for rank in (0, 1):
        hashes = [line["events"][0]["block_hashes"][0] for line in data if line["dp_rank"] == rank]
        assert hashes == [rank << 20 | i for i in range(3)]  # per-rank order kept


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_tail_snapshot_prints_each_ranks_resident_blocks(instance: tuple[FanIn, list[RankPublisher]]) -> None:
    fanin, ranks = instance
    for index in range(2):
        for rank, publisher in enumerate(ranks):
            publisher.publish(wire.EventBatch(ts=time.time(), events=[_stored(rank, index)]))
    ranks[0].publish(wire.EventBatch(ts=time.time(), events=[wire.BlockRemoved(block_hashes=[0 << 20 | 1])]))
    _wait_for_batches(fanin, 5)
    config = fanin.config
    assert config.replay_endpoint is not None
    result = subprocess.run(
        _tail_cmd(
            *(config.endpoint.replace("*", "127.0.0.1"), "--replay-endpoint", config.replay_endpoint),
            *("--snapshot", "--json", "--idle-exit", "0.5"),
        ),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    by_rank = {line["dp_rank"]: line for line in map(json.loads, result.stdout.splitlines()) if line["events"]}
    for rank, expected in ((0, [0]), (1, [1 << 20, 1 << 20 | 1])):
        events = by_rank[rank]["events"]
        assert events[0] == {"type": "AllBlocksCleared"}
        held = [h for event in events[1:] for h in event["block_hashes"]]
        assert held == expected


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_tail_follows_live_batches_and_exits_0_on_ctrl_c(instance: tuple[FanIn, list[RankPublisher]]) -> None:
    fanin, ranks = instance
    endpoint = fanin.config.endpoint.replace("*", "127.0.0.1")
    proc = subprocess.Popen(_tail_cmd(endpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        seen = ""
        deadline = time.monotonic() + 30
        index = 0
        while "dp_rank=1" not in seen:  # keep publishing until the late joiner has connected
            assert time.monotonic() < deadline, f"tail printed nothing useful: {seen!r}"
            ranks[1].publish(wire.EventBatch(ts=time.time(), events=[_stored(1, index)]))
            index += 1
            time.sleep(0.05)
            with contextlib.suppress(BlockingIOError):
                seen += os.read(proc.stdout.fileno(), 65536).decode()
        assert "BlockStored[GPU]=1" in seen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.unit
def test_seq_tracker_reports_gaps_and_restarts_on_stderr() -> None:
    err = io.StringIO()
    tracker = tail.SeqTracker(err)
    assert tracker.observe(wire.make_seq(5, 0))
    assert tracker.observe(wire.make_seq(5, 1))
    assert tracker.observe(wire.make_seq(5, 4))
    assert tracker.gaps == 1 and "2 batches missed" in err.getvalue()
    assert tracker.observe(wire.make_seq(9, 0))
    assert tracker.restarts == 1 and "restart" in err.getvalue()
    assert tracker.observe(3)  # a plain engine seq: epoch 0
    assert tracker.observe(0)  # went backwards: the engine restarted
    assert tracker.restarts == 3


@pytest.mark.unit
def test_seq_tracker_accepts_snapshot_repeats_and_replay_overlap() -> None:
    tracker = tail.SeqTracker(io.StringIO())
    for _ in range(3):
        tracker.observe_replayed(wire.make_seq(5, 10))  # a snapshot repeats its seq
    tracker.observe_replayed(wire.make_seq(5, 11))
    assert not tracker.observe(wire.make_seq(5, 11))  # already printed by the replay
    assert tracker.observe(wire.make_seq(5, 12))
    assert tracker.gaps == tracker.restarts == 0


@pytest.mark.unit
def test_describe_batch_counts_by_type_and_medium() -> None:
    batch = wire.EventBatch(
        ts=1.0,
        events=[_stored(0, 0), _stored(0, 1), wire.BlockRemoved(block_hashes=[1, 2], medium="CPU_PINNED")],
        dp_rank=3,
    )
    line = tail.describe_batch(wire.make_seq(2, 7), batch)
    assert line.startswith("seq=7 epoch=2 dp_rank=3 events=3 blocks=4 ")
    assert "BlockStored[GPU]=2" not in line  # medium unset by the engine: no tag
    assert "BlockStored=2" in line and "BlockRemoved[CPU_PINNED]=1" in line
    assert tail.describe_batch(0, wire.EventBatch(ts=1.0, events=[])).endswith("heartbeat")


@pytest.mark.unit
def test_from_seq_without_replay_endpoint_is_a_usage_error() -> None:
    from sglang_kvpub.tools.cli import build_parser

    args = build_parser().parse_args(["tail", "tcp://127.0.0.1:1", "--from-seq", "3"])
    err = io.StringIO()
    assert tail.run(args, out=io.StringIO(), err=err) == 2
    assert "--replay-endpoint" in err.getvalue()
