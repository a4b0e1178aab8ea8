"""Fault injection with real processes: after each fault and a bounded recovery the adapter's
index equals the engine's truth per (rank, medium, block), or - where the design cannot
recover on its own - exactly the documented subset of it (docs/reliability.md).

Truth: rank processes publish ``faults_procs.tree_events(rank, i)`` for commanded index
ranges, so what each rank holds is the fold of those batches (``faults_procs.truth``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_tcp_endpoint
from faults_procs import MEDIA, Truth, block_hash, run_adapter, run_ctl_rank, tree_events, truth
from kvpub_procs import BLOCK_SIZE, run_fanin, spawn_context

from motor_adapter.stream import StreamHealth, StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.transport.channel import channel_frames

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.timeout(90)]

FAST = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, backoff_max_s=0.5, poll_s=0.02)
RECOVERY_S = 20.0  # bound on every recovery; it normally takes well under a second


class Instance:
    """A fan-in process and controllable rank processes (the engine), killable one by one."""

    def __init__(self, config: PluginConfig, dp_size: int, channel: str) -> None:
        self.mp = spawn_context()
        self.config = config
        self.dp_size = dp_size
        self.channel = channel
        self.fanin: Any = None
        self.fanin_q: tuple[Any, Any] = (None, None)
        self.ranks: dict[int, tuple[Any, Any]] = {}
        self.answers = self.mp.Queue()
        self.stash: list[tuple[Any, ...]] = []
        self.published: dict[int, list[tuple[int, int]]] = {r: [] for r in range(dp_size)}

    def start_fanin(self) -> None:
        ready, commands, answers = self.mp.Event(), self.mp.Queue(), self.mp.Queue()
        self.fanin = self.mp.Process(
            target=run_fanin, args=(self.config, self.dp_size, self.channel, ready, commands, answers), daemon=True
        )
        self.fanin.start()
        self.fanin_q = (commands, answers)
        assert ready.wait(30.0), "fan-in did not start"

    def start_rank(self, rank: int) -> None:
        commands = self.mp.Queue()
        proc = self.mp.Process(
            target=run_ctl_rank, args=(self.config, rank, self.channel, commands, self.answers), daemon=True
        )
        proc.start()
        self.ranks[rank] = (proc, commands)
        self.published[rank] = []  # a new process: an empty cache
        assert self._answer("ready", rank)[1] == rank

    def _answer(self, kind: str, rank: int) -> tuple[Any, ...]:
        """The next ``(kind, rank, ...)`` answer; others are kept for their own waiters."""
        deadline = time.monotonic() + 30.0
        while True:
            for message in self.stash:
                if message[0] == kind and message[1] == rank:
                    self.stash.remove(message)
                    return message
            self.stash.append(tuple(self.answers.get(timeout=max(0.1, deadline - time.monotonic()))))

    def publish(self, rank: int, start: int, stop: int, interval_s: float = 0.0, wait: bool = True) -> None:
        self.ranks[rank][1].put(("publish", start, stop, interval_s))
        self.published[rank].append((start, stop))
        if wait:
            self._answer("published", rank)

    def wait_published(self, rank: int) -> None:
        self._answer("published", rank)

    def truth(self) -> Truth:
        return truth(self.published)

    def fanin_stats(self) -> dict[str, Any]:
        commands, answers = self.fanin_q
        commands.put("stats")
        stats: dict[str, Any] = answers.get(timeout=10.0)
        return stats

    def kill_rank(self, rank: int) -> None:
        proc, _ = self.ranks.pop(rank)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)

    def kill_fanin(self) -> None:
        os.kill(self.fanin.pid, signal.SIGKILL)
        self.fanin.join(10.0)

    def close(self) -> None:
        for proc, commands in self.ranks.values():
            commands.put("stop")
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if self.fanin is not None and self.fanin.is_alive():
            self.fanin_q[0].put("stop")
            self.fanin.join(10.0)
            if self.fanin.is_alive():
                self.fanin.kill()
                self.fanin.join(5.0)


@pytest.fixture
def make_instance(tmp_path: Path) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(dp_size: int, **overrides: Any) -> Instance:
        values: dict[str, Any] = {
            "endpoint": free_tcp_endpoint(),
            "replay_endpoint": free_tcp_endpoint(),
            "bind": True,
            "heartbeat_s": 0.2,
        }
        values.update(overrides)
        instance = Instance(PluginConfig(**values), dp_size, f"unixpkt://{tmp_path}/ch{len(made)}.sock")
        made.append(instance)
        instance.start_fanin()
        for rank in range(dp_size):
            instance.start_rank(rank)
        return instance

    yield make
    for instance in made:
        instance.close()


def subscribe(ctx: zmq.Context[Any], config: PluginConfig, index: PrefixIndex) -> StreamSubscriber:
    sub = StreamSubscriber(
        "inst", config.endpoint, index, replay_endpoint=config.replay_endpoint, context=ctx, options=FAST
    )
    sub.start()
    return sub


def resident(index: PrefixIndex, ranks: int) -> Truth:
    return {(r, m): index.resident("inst", r, m) for r in range(ranks) for m in MEDIA}


def wait_equal(sub: StreamSubscriber, index: PrefixIndex, want: Truth, what: str) -> StreamHealth:
    ranks = 1 + max(r for r, _ in want)
    ok = sub.wait_for(lambda _h: resident(index, ranks) == want, RECOVERY_S)
    got = resident(index, ranks)
    diff = {k: (sorted(got[k] - want[k])[:5], sorted(want[k] - got[k])[:5]) for k in want if got[k] != want[k]}
    assert ok, f"{what}: index != truth; (stale, missing) per (rank, medium): {diff}"
    health = sub.health()
    fields = ("gaps", "replays", "replayed_batches", "snapshots", "restarts", "reconnects", "decode_errors")
    print(json.dumps({"scenario": what, **{f: getattr(health, f) for f in fields}}))  # for docs/reliability.md
    return health


def rank_batch(rank: int, index: int) -> wire.EventBatch:
    """Batch ``index`` of ``rank`` as a rank publisher enriches it (block_size set)."""
    batch = wire.EventBatch(ts=time.time(), events=tree_events(rank, index))
    return wire.enrich_batch(batch, dp_rank=rank, block_size=BLOCK_SIZE)


# ----------------------------------------------------------------------------- scenarios


def test_kill9_rank_publisher_then_restart(make_instance: Callable[..., Instance], zctx: zmq.Context[Any]) -> None:
    inst = make_instance(3)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(zctx, inst.config, index)
    try:
        for rank in range(3):
            inst.publish(rank, 0, 40)
        # The initial snapshot is taken as the SUB connects: batches published before its
        # subscription reaches the PUB come back as one gap filled from the replay buffer
        # (reliability.md).  The fault is judged against the counters after that sync.
        before = wait_equal(sub, index, inst.truth(), "before the fault")

        inst.kill_rank(1)
        for rank in (0, 2):
            inst.publish(rank, 40, 60)
        # The dead rank's blocks stay in the index until the rank comes back (see reliability.md):
        # the fan-in only reports it dead (stats "dead", log) after rank_timeout_s.
        deadline = time.monotonic() + RECOVERY_S
        while 1 not in inst.fanin_stats()["dead"]:
            assert time.monotonic() < deadline, "rank 1 never reported dead"
            time.sleep(0.1)
        # inst.truth() still folds rank 1's batches 0..39: what the index keeps while it is dead.
        wait_equal(sub, index, inst.truth(), "while rank 1 is dead")

        inst.start_rank(1)  # a new process: new rank epoch, empty cache
        inst.publish(1, 0, 8)
        health = wait_equal(sub, index, inst.truth(), "after rank 1 restarted")
        assert block_hash(1, 39, 0) not in index.resident("inst", 1, wire.MEDIUM_GPU)  # stale blocks gone
        stats = inst.fanin_stats()
        assert stats["rank_restarts"] == 1 and stats["ranks"][1]["restarts"] == 1 and stats["dead"] == []
        added = [getattr(health, f) - getattr(before, f) for f in ("gaps", "restarts", "snapshots", "decode_errors")]
        assert added == [0, 0, 0, 0]  # the rank's death and restart are invisible to the stream's seq
        assert before.gaps == before.replays  # and anything the initial sync missed was replayed
        assert sum(s["gaps"] for s in stats["ranks"].values()) == 0
    finally:
        sub.stop()


def test_kill9_fanin_ranks_keep_running(make_instance: Callable[..., Instance], zctx: zmq.Context[Any]) -> None:
    inst = make_instance(2)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(zctx, inst.config, index)
    try:
        for rank in range(2):
            inst.publish(rank, 0, 30)
        wait_equal(sub, index, inst.truth(), "before the fault")
        before = sub.health()
        inst.kill_fanin()
        inst.start_fanin()  # same endpoints, new epoch; the ranks never noticed

        def joined() -> bool:
            ranks = inst.fanin_stats()["ranks"]
            return len(ranks) == 2 and all(state["late_join"] for state in ranks.values())

        deadline = time.monotonic() + RECOVERY_S
        while not joined():
            assert time.monotonic() < deadline, "the ranks never reached the new fan-in"
            time.sleep(0.1)
        for rank in range(2):
            inst.publish(rank, 30, 34)
        # What the new fan-in can know: announcements since it started (batches 30..33).
        # Nothing stale; requests prefilled before the restart and still resident are
        # missing (removals of them are unknown_removals) until the rank side re-announces
        # them (the rank-side reconciliation) or the cache turns over.
        seen = truth({r: [(30, 34)] for r in range(2)})
        health = wait_equal(sub, index, seen, "right after the fan-in restart")
        engine = inst.truth()
        assert all(seen[key] <= engine[key] for key in engine)  # a subset: nothing stale
        assert sum(len(engine[key] - seen[key]) for key in engine) > 0  # the documented loss
        for rank in range(2):  # the cache turns over: every pre-restart block evicted
            inst.publish(rank, 34, 30 + 2 * 8 + 3)
        health = wait_equal(sub, index, inst.truth(), "after the cache turned over")
        assert health.restarts > before.restarts  # new epoch seen
        assert health.snapshots > before.snapshots  # rebuilt from the new fan-in's snapshot
        assert health.epoch is not None and health.epoch == wire.seq_epoch(inst.fanin_stats()["seq"])
    finally:
        sub.stop()


def test_kill9_adapter_process_restart_converges(make_instance: Callable[..., Instance]) -> None:
    inst = make_instance(2)
    config = inst.config
    mp = inst.mp

    def start_adapter() -> tuple[Any, Any, Any]:
        commands, answers = mp.Queue(), mp.Queue()
        proc = mp.Process(
            target=run_adapter, args=(config.endpoint, config.replay_endpoint, 2, commands, answers), daemon=True
        )
        proc.start()
        assert answers.get(timeout=30.0) == "ready"
        return proc, commands, answers

    def poll(commands: Any, answers: Any, want: Truth) -> tuple[bool, dict[str, Any]]:
        deadline = time.monotonic() + RECOVERY_S
        while True:
            commands.put("resident")
            got, health = answers.get(timeout=10.0)
            if got == want or time.monotonic() > deadline:
                return got == want, health
            time.sleep(0.05)

    proc, commands, answers = start_adapter()
    try:
        for rank in range(2):
            inst.publish(rank, 0, 20)
        assert poll(commands, answers, inst.truth())[0]
        for rank in range(2):  # keep the engine busy while the adapter dies
            inst.publish(rank, 20, 120, interval_s=0.005, wait=False)
        time.sleep(0.1)  # pacing: let some of the batches flow before the kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        proc, commands, answers = start_adapter()
        for rank in range(2):
            inst.wait_published(rank)
        ok, health = poll(commands, answers, inst.truth())
        assert ok, "the restarted adapter did not converge"
        assert health["snapshots"] >= 1 and health["decode_errors"] == 0
    finally:
        commands.put("stop")
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()


def test_whole_instance_restart_new_epoch(make_instance: Callable[..., Instance], zctx: zmq.Context[Any]) -> None:
    inst = make_instance(2)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(zctx, inst.config, index)
    try:
        for rank in range(2):
            inst.publish(rank, 0, 25)
        wait_equal(sub, index, inst.truth(), "before the fault")
        old_epoch = sub.health().epoch
        for rank in list(inst.ranks):
            inst.kill_rank(rank)
        inst.kill_fanin()
        inst.start_fanin()
        for rank in range(2):
            inst.start_rank(rank)
            inst.publish(rank, 0, 6)
        health = wait_equal(sub, index, inst.truth(), "after the instance restart")
        assert block_hash(0, 20, 0) not in index.resident("inst", 0, wire.MEDIUM_GPU)  # nothing of the old epoch
        assert health.epoch != old_epoch and health.restarts >= 1 and health.snapshots >= 2
    finally:
        sub.stop()


class SlowIndex(PrefixIndex):
    """An index whose first ``slow`` batches take 3 ms each: a router that falls behind."""

    def __init__(self, block_size: int, slow: int) -> None:
        super().__init__(block_size)
        self.slow = slow

    def apply_batch(self, instance: str, batch: wire.EventBatch, dp_rank: int | None = None) -> Any:
        if self.slow > 0:
            self.slow -= 1
            time.sleep(0.003)  # simulated slowness, not synchronisation
        return super().apply_batch(instance, batch, dp_rank)


def test_slow_subscriber_overflows_pub_hwm_and_recovers(zctx: zmq.Context[Any]) -> None:
    config = PluginConfig(
        endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2, hwm=20
    )
    fanin = FanIn(config, 2, listen_channel=False)
    fanin.start()
    index = SlowIndex(BLOCK_SIZE, slow=300)
    options = StreamOptions(liveness_s=2.0, replay_timeout_s=1.0, poll_s=0.02, rcvhwm=20)
    sub = StreamSubscriber(
        "inst", config.endpoint, index, replay_endpoint=config.replay_endpoint, context=zctx, options=options
    )
    sub.start()
    try:
        assert sub.wait_for(lambda h: h.connected and h.snapshots >= 1, RECOVERY_S)
        count = 1500
        for i in range(count):
            for rank in range(2):
                fanin.ingest(rank, 1, i, rank_batch(rank, i))
        health = wait_equal(sub, index, truth({r: [(0, count)] for r in range(2)}), "after the overflow")
        assert health.gaps >= 1  # the PUB dropped for this subscriber...
        assert health.replays + health.snapshots - 1 >= 1  # ...and every gap was refilled
        stats = fanin.stats()
        assert stats["pub_dropped"] == 0  # PUB drops per subscriber silently: only the seq shows it
        assert stats["replays_served"] + stats["snapshots_served"] >= 2
    finally:
        sub.stop()
        fanin.stop()


def test_duplicated_and_reordered_channel_batches(zctx: zmq.Context[Any]) -> None:
    channel = free_tcp_endpoint()
    config = PluginConfig(endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2)
    fanin = FanIn(config, 2, channel_endpoint=channel)
    fanin.start()
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(zctx, config, index)
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(channel)
    encoder = wire.BatchEncoder()

    def frames(rank: int, seq: int) -> list[bytes]:
        batch = wire.enrich_batch(
            wire.EventBatch(ts=time.time(), events=tree_events(rank, seq)), dp_rank=rank, block_size=BLOCK_SIZE
        )
        return channel_frames(rank, 7, seq, encoder.encode(batch))

    try:
        assert sub.wait_for(lambda h: h.connected and h.snapshots >= 1, RECOVERY_S)
        for seq in [0, 1, 2, 1, 2, 2, 3, 4, 5, 6, 0]:  # rank 0: duplicates only
            push.send_multipart(frames(0, seq))
        for seq in [0, 1, 2, 3, 5, 4, 6, 7]:  # rank 1: 4 arrives after 5
            push.send_multipart(frames(1, seq))
        want = truth({0: [(0, 7)], 1: [(0, 4), (5, 8)]})  # rank 1's batch 4 is dropped as late
        health = wait_equal(sub, index, want, "after duplicates and a reorder")
        stats = fanin.stats()
        assert stats["ranks"][0]["duplicates"] == 4 and stats["ranks"][0]["gaps"] == 0
        assert stats["ranks"][1]["gaps"] == 1 and stats["ranks"][1]["duplicates"] == 1  # reported, not silent
        engine = truth({0: [(0, 7)], 1: [(0, 8)]})
        assert resident(index, 2)[(0, wire.MEDIUM_GPU)] == engine[(0, wire.MEDIUM_GPU)]  # dups: exact
        diff = engine[(1, wire.MEDIUM_GPU)] ^ want[(1, wire.MEDIUM_GPU)]
        assert diff == {block_hash(1, 4, 0), block_hash(1, 4, 1)}  # exactly batch 4's request
        assert (health.gaps, health.decode_errors) == (0, 0)  # the instance stream itself is intact
    finally:
        push.close(linger=0)
        sub.stop()
        fanin.stop()


def test_instance_stream_survives_a_storm_of_replay_requests(zctx: zmq.Context[Any]) -> None:
    """64+ concurrent snapshot requests (a router fleet restarting) never stall the live stream."""
    config = PluginConfig(endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2)
    fanin = FanIn(config, 1, listen_channel=False)
    fanin.start()
    for i in range(200):
        fanin.ingest(0, 1, i, rank_batch(0, i))
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(zctx, config, index)
    dealers = []
    try:
        for _ in range(80):
            dealer = zctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(config.replay_endpoint or "")
            dealer.send_multipart(wire.replay_request_frames(0, snapshot=True))
            dealers.append(dealer)  # never read: slow clients
        stop = threading.Event()

        def produce() -> None:
            i = 200
            while not stop.is_set() and i < 600:
                fanin.ingest(0, 1, i, rank_batch(0, i))
                i += 1
                time.sleep(0.001)  # pacing a producer

        thread = threading.Thread(target=produce)
        thread.start()
        thread.join(30.0)
        stop.set()
        wait_equal(sub, index, truth({0: [(0, 600)]}), "live stream during the storm")
        stats = fanin.stats()
        assert stats["jobs"] <= 64  # bounded; requests over the bound get an empty reply, counted
        assert stats["snapshots_served"] + stats["replays_rejected"] >= 81
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        sub.stop()
        fanin.stop()
