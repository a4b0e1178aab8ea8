"""A whole-instance restart as a seq-checking reader sees it.

Dynamo's indexer (``python -m dynamo.indexer`` 1.6.1) checks each batch's seq for "last + 1":
a lower seq is dropped, a higher one is a gap it answers with a replay request.  So a
restarted fan-in must start above the last one's seqs: the epoch comes from the start's
wall-clock second, kept above the last start's on that endpoint (``publish.epoch``), and a
new epoch's replay is a snapshot that clears first.  Here: the epoch's rules, then Dynamo
registered once on the folded view (with its replay endpoint) across a fan-in restart on the same ports - real rank
publishers, a real fan-in, loopback sockets.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_tcp_port

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.publish.epoch import EPOCH_LIMIT, STALE_RECORD_S, EpochRecord, start_epoch
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher

BS = 4
DP = 2
HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None and importlib.util.find_spec("dynamo.indexer") is not None


def test_epochs_follow_the_clock_rise_within_one_second_and_wrap(tmp_path: Path) -> None:
    record = EpochRecord("tcp://127.0.0.1:5557", tmp_path)
    assert start_epoch(record, now=1000.2) == 1001
    assert start_epoch(record, now=1000.9) == 1002  # a second start in the same second: above the last
    assert start_epoch(record, now=5000.0) == 5001  # a later start: the clock's
    top = EPOCH_LIMIT - 2
    assert start_epoch(record, now=float(top)) == EPOCH_LIMIT - 1
    assert start_epoch(record, now=float(top + 1)) == 1  # the count wraps (once every 97 days)
    other = EpochRecord("tcp://127.0.0.1:5558", tmp_path)
    assert start_epoch(other, now=1.0) == 2  # each endpoint has its own record
    now = start_epoch(EpochRecord("tcp://127.0.0.1:5559", tmp_path))
    assert 0 < now < EPOCH_LIMIT and start_epoch(EpochRecord("tcp://127.0.0.1:5559", tmp_path)) > now


def test_a_start_in_another_process_within_the_same_second_goes_above(tmp_path: Path) -> None:
    """A supervisor restarting the sidecar at once: the new process reads the last epoch."""
    endpoint = "tcp://127.0.0.1:5557"
    first = start_epoch(EpochRecord(endpoint, tmp_path), now=7000.1)
    code = (
        "import sys; from pathlib import Path; from sglang_kvpub.publish.epoch import EpochRecord, start_epoch; "
        "print(start_epoch(EpochRecord(sys.argv[1], Path(sys.argv[2])), now=7000.8))"
    )
    argv = [sys.executable, "-c", code, endpoint, str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert (first, int(out.stdout)) == (7001, 7002)


def test_an_unreadable_record_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = EpochRecord("tcp://127.0.0.1:5557", tmp_path)
    assert record.path is not None
    record.path.write_text("not a number\n", encoding="ascii")
    assert start_epoch(record, now=100.0) == 101
    assert "not an epoch" in caplog.text
    assert record.path.read_text(encoding="ascii") == "101\n"  # replaced by the start's


def test_a_start_removes_records_untouched_for_a_day(tmp_path: Path) -> None:
    """Records of endpoints that came and went do not pile up; a recent one is kept."""
    old, recent = EpochRecord("tcp://127.0.0.1:5001", tmp_path), EpochRecord("tcp://127.0.0.1:5002", tmp_path)
    start_epoch(old, now=100.0)
    start_epoch(recent, now=100.0)
    assert old.path is not None and recent.path is not None
    long_ago = time.time() - STALE_RECORD_S - 60.0
    os.utime(old.path, (long_ago, long_ago))
    unrelated = tmp_path / "channel.pkt"
    unrelated.write_text("")
    os.utime(unrelated, (long_ago, long_ago))
    starting = EpochRecord("tcp://127.0.0.1:5003", tmp_path)
    start_epoch(starting, now=100.0)
    assert starting.path is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["channel.pkt", recent.path.name, starting.path.name])


def store(tokens: list[int]) -> wire.BlockStored:
    keys = sequence_keys(tokens, BS)
    return wire.BlockStored(keys, None, tokens, BS, medium=wire.MEDIUM_GPU)


class Instance:
    """A fan-in with a folded view and its rank publishers; :meth:`restart` replaces them all
    on the same ports, as a restarted server does."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.config = PluginConfig(
            endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            folded_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            folded_replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            event_encoding="array",
            heartbeat_s=0.2,
        )
        self.starts = 0
        self._start()

    def _start(self) -> None:
        self.starts += 1
        channel = f"unixpkt://{self.tmp_path}/kvpub-channel-{self.starts}"
        self.fanin = FanIn(self.config, DP, channel_endpoint=channel)
        self.fanin.start()
        self.ranks = [RankPublisher(self.config, rank, BS, channel) for rank in range(DP)]

    def publish(self, rank: int, event: wire.Event) -> None:
        self.ranks[rank].publish(wire.EventBatch(ts=time.time(), events=[event]))

    def restart(self) -> None:
        self.stop()
        self._start()

    def stop(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        self.fanin.stop()


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[Instance]:
    made = Instance(tmp_path)
    yield made
    made.stop()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_DYNAMO, reason="NVIDIA Dynamo's indexer (ai-dynamo-runtime 1.6.1) is not installed")
def test_dynamo_on_the_folded_view_follows_a_whole_instance_restart(instance: Instance, tmp_path: Path) -> None:
    from interop_procs import DynamoIndexer

    a = [1000 + i for i in range(3 * BS)]
    b = [2000 + i for i in range(3 * BS)]
    c = [3000 + i for i in range(2 * BS)]
    indexer = DynamoIndexer(free_tcp_port(), BS, tmp_path / "indexer.log")
    try:
        indexer.wait_healthy()
        assert instance.config.folded_endpoint is not None
        indexer.register(7, instance.config.folded_endpoint, instance.config.folded_replay_endpoint)

        def until(check: object, what: str) -> None:
            deadline = time.monotonic() + 60
            while not check():  # type: ignore[operator]
                assert time.monotonic() < deadline, (what, indexer.log()[-3000:])
                time.sleep(0.05)  # polling another process's state

        instance.publish(0, store(a))  # before the subscription or after: the replay brings it
        until(lambda: indexer.scores(a) == {"7": {"0": len(a)}}, "A indexed")
        old_epoch = instance.fanin.epoch
        instance.restart()
        assert instance.fanin.epoch > old_epoch
        instance.publish(1, store(b))
        until(lambda: indexer.scores(b) == {"7": {"0": len(b)}}, "B, stored after the restart, indexed")
        until(lambda: indexer.scores(a) == {}, "A, held before the restart, gone")
        instance.publish(1, store(c))  # live batches after the replay are applied too
        until(lambda: indexer.scores(c) == {"7": {"0": len(c)}}, "C indexed")
        assert indexer.scores(a) == {}
    finally:
        indexer.close()
