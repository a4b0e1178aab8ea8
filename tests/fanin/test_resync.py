"""Fan-in restart while the ranks keep running: the rank detects the new fan-in and resyncs.

(a) RankPublisher + FanIn over real ZMQ: the resync request (flag, process flag, callback,
    stats) fires once per fan-in reconnection, never on the first connection.
(b) SGLang 0.5.23's real tree caches with the release hooks: announce through a real
    RankPublisher to fan-in A, replace A by fan-in B, run the idle hook as the scheduler
    would: B's live stream, and B's snapshot, end with exactly the tree's resident pages.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_tcp_endpoint

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher, take_resync_request

pytestmark = pytest.mark.integration

U64 = (1 << 64) - 1
PAGE = 4
INSTANCE = "inst"


def wait_for(
    done: Callable[[], bool], what: str, timeout_s: float = 15.0, step: Callable[[], None] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if step is not None:
            step()
        else:
            time.sleep(0.01)  # polling interval of a real condition, not a synchronisation


def make_config() -> PluginConfig:
    return PluginConfig(
        endpoint=free_tcp_endpoint(),
        replay_endpoint=free_tcp_endpoint(),
        bind=True,
        heartbeat_s=0.1,
        topic="kv",
    )


@pytest.fixture(params=["tcp", "ipc", "unixpkt"])
def channel(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return free_tcp_endpoint() if request.param == "tcp" else f"{request.param}://{tmp_path}/channel.sock"


# --------------------------------------------------------------------------- (a) detection


@pytest.mark.timeout(40)
def test_resync_requested_once_per_fanin_reconnection(channel: str) -> None:
    take_resync_request()  # whatever an earlier test in this process left
    config = make_config()
    calls: list[str] = []
    lock = threading.Lock()

    def on_resync() -> None:
        with lock:
            calls.append(threading.current_thread().name)

    fanins = [FanIn(config, 1, channel_endpoint=channel)]
    fanins[0].start()
    publisher = RankPublisher(config, 0, PAGE, channel, on_resync=on_resync)
    try:
        # First connection: normal, no resync.
        wait_for(lambda: publisher.stats["peer_connects"] == 1, "the first handshake")
        publisher.publish(wire.EventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))
        wait_for(lambda: fanins[0].stats()["ranks"].get(0, {}).get("batches", 0) >= 1, "fan-in A sees the rank")
        assert not publisher.resync_requested and not publisher.take_resync_request()
        assert not take_resync_request() and calls == []
        assert publisher.stats["resyncs_requested"] == 0

        for round_ in (1, 2):
            fanins[-1].stop()
            fanins.append(FanIn(config, 1, channel_endpoint=channel))  # same channel, new process state
            fanins[-1].start()
            wait_for(lambda: len(calls) == round_, f"the resync callback of reconnection {round_}")  # noqa: B023
            assert publisher.resync_requested
            assert publisher.take_resync_request() and not publisher.take_resync_request()
            assert take_resync_request() and not take_resync_request()
            stats = publisher.stats
            assert stats["peer_connects"] == round_ + 1 and stats["resyncs_requested"] == round_
            # The new fan-in sees the rank mid-stream (late join) and gets its batches.
            publisher.publish(wire.EventBatch(ts=2.0, events=[wire.AllBlocksCleared()]))
            wait_for(
                lambda: fanins[-1].stats()["ranks"].get(0, {}).get("batches", 0) >= 1, "the new fan-in sees the rank"
            )
            assert fanins[-1].stats()["ranks"][0]["late_join"] is True
        assert calls == ["kvpub-rank-sender"] * 2  # from the sender thread, once per reconnection
    finally:
        publisher.shutdown()
        fanins[-1].stop()


@pytest.mark.timeout(30)
def test_broken_callback_does_not_stop_the_sender(channel: str) -> None:
    take_resync_request()
    config = make_config()

    def boom() -> None:
        raise RuntimeError("callback bug")

    fanin = FanIn(config, 4, channel_endpoint=channel)
    fanin.start()
    publisher = RankPublisher(config, 3, PAGE, channel, on_resync=boom)
    try:
        wait_for(lambda: publisher.stats["peer_connects"] == 1, "the first handshake")
        fanin.stop()
        fanin = FanIn(config, 4, channel_endpoint=channel)
        fanin.start()
        wait_for(lambda: publisher.resync_requested, "the resync request")
        publisher.publish(wire.EventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))
        wait_for(lambda: fanin.stats()["ranks"].get(3, {}).get("batches", 0) >= 1, "batches after the failed callback")
    finally:
        publisher.shutdown()
        fanin.stop()
    take_resync_request()


# --------------------------------------------------------------------------- (b) real SGLang tree


def ns() -> Any:
    from bench import rh_trees  # the real SGLang tree code loads only for the tests that need it

    return rh_trees.setup()  # cached: one real-SGLang setup per process


class TickClock:
    """1 ms per reading: every resync chunk ends its slice (many slices, no timing)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


class StreamReader:
    """A plain SUB on the instance stream feeding a PrefixIndex and a RankResidency."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.socket.connect(endpoint)
        self.decoder = wire.BatchDecoder()
        self.index = PrefixIndex(PAGE)
        self.state = RankResidency()
        self.batches = 0

    def pump(self, timeout_ms: int = 10) -> None:
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            _, _, payload = wire.parse_live_frames(frames)
            batch = self.decoder.decode(payload)
            self.batches += 1
            if batch.dp_rank == 0:
                self.index.apply_batch(INSTANCE, batch)
                self.state.apply_all(batch.events)

    def resident(self, medium: str) -> set[int]:
        return self.index.resident(INSTANCE, 0, medium)


def snapshot_index(ctx: zmq.Context[Any], replay_endpoint: str) -> PrefixIndex:
    """Fan-in B's snapshot (AllBlocksCleared + stores per rank) applied to a fresh index."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    index = PrefixIndex(PAGE)
    decoder = wire.BatchDecoder()
    try:
        dealer.send_multipart(wire.replay_request_frames(0, snapshot=True))
        while True:
            assert dealer.poll(10_000), "no snapshot reply"
            frames = dealer.recv_multipart()
            if frames[-2:] == [wire.END_SEQ_BYTES, b""]:
                return index
            batch = decoder.decode(wire.parse_replay_reply(frames).payload)
            if batch.dp_rank == 0:
                index.apply_batch(INSTANCE, batch)
    finally:
        dealer.close(linger=0)


def tree_truth(tree: Any) -> dict[str, set[int]]:
    from bench import rh_trees

    return {medium: {h & U64 for h in hashes} for medium, hashes in rh_trees.truth(tree).items()}


def prompt(i: int, length: int = 24) -> list[int]:
    return [i % 4] * 8 + [1000 * (i + 1) + j for j in range(length - 8)]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["legacy", "unified"])
def test_new_fanin_converges_through_idle_resync_on_real_tree(kind: str, ctx: zmq.Context[Any]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sglang")
    import sglang_real

    from bench import rh_trees as rt
    from sglang_kvpub.engine.reconcile import RESYNC_FANIN, Reconciler, drift, reconcile_on_idle
    from sglang_kvpub.engine.release_hooks import tree_of

    space = ns()
    kv_events = sglang_real.load_kv_events()
    take_resync_request()
    tree = (rt.legacy_tree if kind == "legacy" else rt.unified_tree)(space, PAGE)
    config = make_config()
    channel = free_tcp_endpoint()
    fanin_a = FanIn(config, 1, channel_endpoint=channel)
    fanin_a.start()
    fanins = [fanin_a]
    publisher = RankPublisher(config, 0, PAGE, channel)

    def flush() -> None:  # the scheduler's publish_kv_events
        events = tree.take_events()
        if events:
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=events))

    def fanin_resident(fanin: FanIn) -> int:
        return int(sum(fanin.stats()["ranks"].get(0, {}).get("resident", {}).values()))

    try:
        # Announce a tree (shared prefixes, some evicted) to fan-in A.
        for i in range(30):
            rt.insert(space, tree, prompt(i))
            if i % 7 == 6:
                tree.evict(space.base.EvictParams(num_tokens=3 * PAGE))
            flush()
        truth = tree_truth(tree)
        assert len(truth[wire.MEDIUM_GPU]) > 50
        wait_for(lambda: fanin_resident(fanin_a) == len(truth[wire.MEDIUM_GPU]), "fan-in A holds the tree")

        # Fan-in A dies; fan-in B takes over the same channel and PUB/replay endpoints.
        fanin_a.stop()
        fanin_b = FanIn(config, 1, channel_endpoint=channel)
        fanin_b.start()
        fanins.append(fanin_b)
        reader = StreamReader(ctx, config.endpoint)
        wait_for(lambda: reader.batches > 0, "B's stream (heartbeats)", step=reader.pump)
        wait_for(lambda: publisher.resync_requested, "the rank seeing the new fan-in")
        # Meanwhile the engine keeps working: extend old prefixes (orphans at B) and evict.
        for i in range(30, 34):
            rt.insert(space, tree, prompt(i % 30, 24) + [7000 + i + j for j in range(8)])
        tree.evict(space.base.EvictParams(num_tokens=2 * PAGE))
        flush()
        # The new stores extend prefixes B never saw: the index skips them (orphans).
        wait_for(lambda: reader.index.stats().orphans >= 1, "B forwards the rank's stores", step=reader.pump)
        gap = tree_truth(tree)[wire.MEDIUM_GPU] - reader.resident(wire.MEDIUM_GPU)
        assert len(gap) > 50  # B knows nearly nothing of the tree before the resync
        assert fanin_b.stats()["ranks"][0]["late_join"] is True
        orphans = reader.index.stats().orphans

        # The scheduler goes idle: the idle hook takes the request and resyncs in slices,
        # while new requests still come in between slices.
        core = tree_of(tree)
        reconciler = Reconciler(core, budget_s=0.001, clock=TickClock())
        core.__dict__["_kvpub_reconciler"] = reconciler
        scheduler = types.SimpleNamespace(tree_cache=tree)
        idle = inserts = 0
        while reconciler.resyncs_done == 0:
            assert idle < 5000, "resync did not finish"
            reconcile_on_idle(scheduler)
            if reconciler.walking and idle % 5 == 2:
                rt.insert(space, tree, prompt(idle % 30, 24) + [90_000 + 10 * idle + j for j in range(8)])
                inserts += 1
            if reconciler.walking and idle % 11 == 5:
                tree.evict(space.base.EvictParams(num_tokens=PAGE))
            flush()
            reader.pump(0)
            idle += 1
        assert reconciler.slices > 5 and inserts >= 2  # really sliced, with traffic in between
        assert reconciler.resyncs == {RESYNC_FANIN: 1}
        assert rt.tracker(tree).corrections["resync_gpu"] >= len(truth[wire.MEDIUM_GPU]) // 2

        final = tree_truth(tree)
        wait_for(
            lambda: reader.resident(wire.MEDIUM_GPU) == final[wire.MEDIUM_GPU], "B's stream == tree", step=reader.pump
        )
        assert {h & U64 for h in reader.state.hashes(wire.MEDIUM_GPU)} == final[wire.MEDIUM_GPU]
        assert reader.resident(wire.MEDIUM_CPU) == final.get(wire.MEDIUM_CPU, set())
        assert drift(tree) == 0
        wait_for(lambda: fanin_resident(fanin_b) == len(final[wire.MEDIUM_GPU]), "B's residency == tree")
        snapshot = snapshot_index(ctx, config.replay_endpoint or "")
        assert snapshot.resident(INSTANCE, 0, wire.MEDIUM_GPU) == final[wire.MEDIUM_GPU]
        assert not take_resync_request() and reconciler.step() is False  # nothing more to do
        outcome = {
            "tree": kind,
            "gpu_pages_before_restart": len(truth[wire.MEDIUM_GPU]),
            "unknown_at_b_before_resync": len(gap),
            "orphans_at_b_before_resync": orphans,
            "resync_pages": rt.tracker(tree).corrections["resync_gpu"],
            "slices": reconciler.slices,
            "idle_iterations": idle,
            "inserts_during_resync": inserts,
            "gpu_pages_final": len(final[wire.MEDIUM_GPU]),
            "index_orphans_total": reader.index.stats().orphans,
        }
        print(json.dumps(outcome))
    finally:
        publisher.shutdown()
        fanins[-1].stop()


@pytest.mark.timeout(40)
def test_resync_reannounces_gpu_and_host_pages_of_real_unified_core() -> None:
    """HiCache L2 on the real Python UnifiedTreeCore (fake host pool, as in
    test_release_l2_trace): a subscriber that saw nothing before the resync ends with
    exactly the tree's GPU and CPU_PINNED pages, with demotions and load-backs between slices."""
    pytest.importorskip("torch")
    pytest.importorskip("sglang")
    pytest.importorskip("hypothesis")
    from engine.test_release_l2_trace import HostDriver, _backup_all

    from bench import rh_trees as rt
    from sglang_kvpub.engine.reconcile import Reconciler, drift

    ns()
    driver = HostDriver()
    for i in range(6):
        rt.insert(ns(), driver.tree, list(range(1, 9)) + [100 * (i + 1) + j for j in range(12)])
    _backup_all(driver, ack=True)
    for leaf in driver.device_leaves()[:3]:
        driver.evict_device_leaf(leaf)  # demoted: host only
    driver.tree.take_events()  # announced to the old fan-in; the new one never saw them
    before = rt.truth(driver.tree)
    assert before[wire.MEDIUM_GPU] and before[wire.MEDIUM_CPU] - before[wire.MEDIUM_GPU]

    fresh = rt.Subscriber()
    reconciler = Reconciler(driver.tree, clock=TickClock())
    assert reconciler.resync("test")
    slices = 0
    while not reconciler.step():
        slices += 1
        assert slices < 5000
        if slices == 3:
            driver.load_back(driver.load_back_candidates()[0])  # host -> device meanwhile
        if slices == 6:
            driver.evict_device_leaf(driver.device_leaves()[0])  # device -> host meanwhile
        fresh.drain(driver.tree)
    fresh.drain(driver.tree)
    assert slices > 6
    truth = rt.truth(driver.tree)
    assert fresh.media()[wire.MEDIUM_GPU] == truth[wire.MEDIUM_GPU]
    assert fresh.media()[wire.MEDIUM_CPU] == truth[wire.MEDIUM_CPU]
    corrections = rt.tracker(driver.tree).corrections
    assert corrections["resync_cpu"] >= len(before[wire.MEDIUM_CPU]) - 4 and corrections["resync_gpu"] > 0
    assert reconciler.resyncs == {"test": 1} and drift(driver.tree) == 0
