"""L2 (CPU_PINNED) release truth on SGLang 0.5.23's real Python ``UnifiedTreeCore`` with a fake host pool.

HiCache's ``HybridCacheController`` (host pools, copy streams) does not run on this CPU
machine, but the tree core's host-side bookkeeping does: the tests play the controller's
part with integer "host indices" and call the core exactly as the controller would -
``mark_write_through_pending`` + ``commit_backup`` + ``finish_write_through`` (write-through
ack), ``evict_device_leaf`` / ``demote`` (device -> host), ``drive_host_eviction`` ->
``_evict_host_leaf`` (host release), ``commit_load_back`` + ``finish_load_back`` (host ->
device).  After every step the state rebuilt from the published events equals the tree per
medium.  A recorded event trace of such a run is also replayed into a fresh tracker.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from bench import rh_trees as rt
from sglang_kvpub.engine.reconcile import Reconciler, drift
from sglang_kvpub.engine.release_hooks import Tracker, tree_of
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PAGE = 4
ns = rt.setup  # cached: one real-SGLang setup per process


def _drain(result: Any) -> None:
    """The controller frees what an eviction step returns (SGLang asserts it was drained)."""
    result.device_frees.clear()
    result.host_frees.clear()
    result.cache_actions.clear()


class HostDriver:
    """Plays HybridCacheController's part against the real core (write-through mode)."""

    def __init__(self) -> None:
        self.tree = rt.unified_tree(ns(), PAGE)
        self.core = tree_of(self.tree)
        self.core.set_hicache_enabled()
        self.next_host = 1 << 20
        self.pending: dict[int, list[int]] = {}
        self.ack_ids = 0

    def nodes(self) -> list[Any]:
        out: list[Any] = []
        stack = list(self.core.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return sorted(out, key=lambda n: n.id)

    def _full(self, node: Any) -> Any:
        return node.component_data[ns().ct.FULL]

    def _on_device(self, node: Any) -> bool:
        return node is self.core.root_node or self._full(node).value is not None

    def backup_candidates(self) -> list[Any]:
        root = self.core.root_node
        return [
            n
            for n in self.nodes()
            if self._full(n).value is not None
            and self._full(n).host_value is None
            and n.write_through_pending_id is None
            and (n.parent is root or n.parent.backuped)
        ]

    def backup(self, node: Any, ack: bool) -> None:
        import torch

        self.ack_ids += 1
        self.core.mark_write_through_pending([node.id], self.ack_ids)
        host = torch.arange(self.next_host, self.next_host + len(node.key), dtype=torch.int64)
        self.next_host += len(node.key)
        self.core.commit_backup(node.id, host, {})
        self.pending[self.ack_ids] = [node.id]
        if ack:
            self.ack_all()

    def ack_all(self) -> None:
        for ack_id, ids in sorted(self.pending.items()):
            self.core.finish_write_through(ids, ack_id)
        self.pending.clear()

    def device_leaves(self) -> list[Any]:
        # SGLang's evictable set can still list a node whose child this driver just loaded
        # back (the real controller would not evict it in that window): ask the tree itself.
        leaves = [n for n in self.core.evictable_device_leaves if self.core._is_device_leaf(n)]
        return sorted(leaves, key=lambda n: n.id)

    def evict_device_leaf(self, node: Any) -> None:
        """Demote when backed up and acked, delete when unbacked (write-through policy)."""
        if node.write_through_pending_id is not None:
            return
        _drain(self.core.evict_device_leaf(node.id, False))

    def load_back_candidates(self) -> list[Any]:
        return [
            n
            for n in self.nodes()
            if self._full(n).value is None and self._full(n).host_value is not None and self._on_device(n.parent)
        ]

    def load_back(self, node: Any) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        host = self._full(node).host_value
        xfer = PoolTransfer(name=PoolName.KV, host_indices=host, nodes_to_load=[node.id])
        device = torch.arange(1 << 24, (1 << 24) + len(host), dtype=torch.int64)
        self.core.commit_load_back(node.id, device, xfer, {})
        self.core.finish_load_back(node.id)

    def host_evict(self, pages: int) -> None:
        _drain(self.core.drive_host_eviction(ns().ct.FULL, pages * PAGE))

    def silent_host_release(self, node: Any) -> None:
        """A host leaf released without SGLang's event (what SWA/Mamba host cascades do)."""
        from sglang.srt.mem_cache.unified_cache.unified_tree_core import EvictLayer

        core = self.core
        frees: Any = (defaultdict(list), defaultdict(list), [])
        tracker: Any = defaultdict(int)
        for comp in core.components:
            core._evict_component_and_detach_lru(
                node,
                comp,
                target=EvictLayer.ALL,
                tracker=None,
                device_frees=frees[0],
                host_frees=frees[1],
                cache_actions=frees[2],
            )
        core.evictable_host_leaves.discard(node)
        core._remove_leaf_from_parent(node)
        core._iteratively_delete_tombstone_leaf(node, tracker, *frees)


def _check(driver: HostDriver, sub: rt.Subscriber) -> None:
    sub.drain(driver.tree)
    got, want = sub.media(), rt.truth(driver.tree)
    assert got[MEDIUM_GPU] == want[MEDIUM_GPU]
    assert got[MEDIUM_CPU] == want[MEDIUM_CPU]
    assert drift(driver.tree) == 0


# --------------------------------------------------------------------------- state machine


class HostMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.driver = HostDriver()
        self.sub = rt.Subscriber()
        self.trace: list[Any] = []

    @rule(prefix=st.integers(0, 2), branch=st.integers(0, 3), length=st.integers(0, 3))
    def insert(self, prefix: int, branch: int, length: int) -> None:
        head = [prefix * 1000 + i for i in range(2 * PAGE)]
        tail = [branch * 100 + i for i in range(length * PAGE)]
        rt.insert(ns(), self.driver.tree, head + tail)

    @rule(pick=st.integers(0, 50), ack=st.booleans())
    def write_through(self, pick: int, ack: bool) -> None:
        nodes = self.driver.backup_candidates()
        if nodes:
            self.driver.backup(nodes[pick % len(nodes)], ack)

    @rule()
    def write_through_ack(self) -> None:
        self.driver.ack_all()

    @rule(pick=st.integers(0, 50))
    def evict_or_demote(self, pick: int) -> None:
        leaves = self.driver.device_leaves()
        if leaves:
            self.driver.evict_device_leaf(leaves[pick % len(leaves)])

    @rule(pick=st.integers(0, 50))
    def load_back(self, pick: int) -> None:
        nodes = self.driver.load_back_candidates()
        if nodes:
            self.driver.load_back(nodes[pick % len(nodes)])

    @rule(pages=st.integers(1, 4))
    def host_evict(self, pages: int) -> None:
        self.driver.host_evict(pages)

    @rule(pick=st.integers(0, 50))
    def silent_host_release(self, pick: int) -> None:
        leaves = sorted(self.driver.core.evictable_host_leaves, key=lambda n: n.id)
        if leaves:
            self.driver.silent_host_release(leaves[pick % len(leaves)])

    @invariant()
    def stream_equals_tree(self) -> None:
        _check(self.driver, self.sub)


TestHostMachine = HostMachine.TestCase
TestHostMachine.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --------------------------------------------------------------------------- focused cases


def _two_branches(driver: HostDriver) -> None:
    rt.insert(ns(), driver.tree, list(range(1, 17)))
    rt.insert(ns(), driver.tree, list(range(1, 9)) + [7] * 8)


def _backup_all(driver: HostDriver, ack: bool) -> None:
    """Back up every device node, parents first (a child needs its parent's host copy)."""
    while candidates := driver.backup_candidates():
        for node in candidates:
            driver.backup(node, ack)


def test_write_through_demote_load_back_host_evict_cycle() -> None:
    driver, sub = HostDriver(), rt.Subscriber()
    _two_branches(driver)
    _check(driver, sub)
    _backup_all(driver, ack=False)
    _check(driver, sub)
    assert sub.media()[MEDIUM_CPU] == set()  # not acked yet: nothing on host announced
    driver.ack_all()
    _check(driver, sub)
    assert len(sub.media()[MEDIUM_CPU]) == 6
    leaf = driver.device_leaves()[0]
    driver.evict_device_leaf(leaf)  # demote: GPU removal by SGLang, host copy stays
    _check(driver, sub)
    assert len(sub.media()[MEDIUM_GPU]) == 4 and len(sub.media()[MEDIUM_CPU]) == 6
    driver.load_back(leaf)
    _check(driver, sub)
    assert len(sub.media()[MEDIUM_GPU]) == 6
    driver.evict_device_leaf(leaf)
    driver.host_evict(2)
    _check(driver, sub)
    assert len(sub.media()[MEDIUM_CPU]) == 4
    assert rt.tracker(driver.tree).corrections["release_cpu"] == 0  # all native


def test_silent_host_release_gets_cpu_removal_once() -> None:
    driver, sub = HostDriver(), rt.Subscriber()
    _two_branches(driver)
    _backup_all(driver, ack=True)
    leaf = driver.device_leaves()[0]
    driver.evict_device_leaf(leaf)
    _check(driver, sub)
    driver.silent_host_release(leaf)
    events = driver.tree.take_events()
    removed = [
        h for e in events if type(e).__name__ == "BlockRemoved" and _medium(e) == MEDIUM_CPU for h in e.block_hashes
    ]
    assert len(removed) == len(set(removed)) == 2
    assert rt.tracker(driver.tree).corrections["release_cpu"] == 2
    for event in events:
        sub.state.apply(rt.to_wire(event))
    _check(driver, sub)


def test_reconcile_repairs_lost_host_store() -> None:
    driver, sub = HostDriver(), rt.Subscriber()
    _two_branches(driver)
    _backup_all(driver, ack=True)
    events = driver.tree.take_events()
    lost = [e for e in events if _medium(e) == MEDIUM_CPU][-1]
    for event in events:
        if event is not lost:
            sub.state.apply(rt.to_wire(event))
    marks = rt.tracker(driver.tree).announced[MEDIUM_CPU]
    for block_hash in lost.block_hashes:
        del marks[block_hash]
    marks[4242] = 0  # and a phantom host block
    Reconciler(driver.tree).run()
    _check(driver, sub)
    corrections = rt.tracker(driver.tree).corrections
    assert corrections["reconcile_missing_cpu"] == len(lost.block_hashes)
    assert corrections["reconcile_stale_cpu"] == 1


def test_recorded_trace_replayed_into_tracker() -> None:
    """The hooks' bookkeeping from a recorded trace alone, fed in arbitrary coalesced pieces."""
    rng = random.Random(3)
    driver, sub = HostDriver(), rt.Subscriber()
    trace: list[Any] = []
    for _step in range(120):
        op = rng.random()
        if op < 0.35:
            tokens = [rng.randrange(3) * 1000 + i for i in range(2 * PAGE)]
            rt.insert(ns(), driver.tree, tokens + [rng.randrange(4) * 100 + i for i in range(rng.randrange(4) * PAGE)])
        elif op < 0.55 and driver.backup_candidates():
            driver.backup(rng.choice(driver.backup_candidates()), ack=rng.random() < 0.7)
        elif op < 0.6:
            driver.ack_all()
        elif op < 0.75 and driver.device_leaves():
            driver.evict_device_leaf(rng.choice(driver.device_leaves()))
        elif op < 0.85 and driver.load_back_candidates():
            driver.load_back(rng.choice(driver.load_back_candidates()))
        else:
            driver.host_evict(rng.randrange(1, 3))
        trace.extend(driver.tree.take_events())
    for event in trace:
        sub.state.apply(rt.to_wire(event))
    truth = rt.truth(driver.tree)
    for medium in (MEDIUM_GPU, MEDIUM_CPU):
        assert sub.media()[medium] == truth[medium]
    assert any(_medium(e) == MEDIUM_CPU for e in trace)

    # Replay: the trace enqueued in random pieces (SGLang's coalescing enqueue), absorbed in between.
    recorder = tree_of(driver.tree).kv_events
    recorder_class: Any = type(recorder)
    queue_owner = recorder_class.__new__(recorder_class)
    queue_owner._queue = []
    tracker = Tracker()
    for event in trace:
        type(recorder).enqueue(queue_owner, _clone(event))
        if rng.random() < 0.3:
            tracker.absorb(queue_owner._queue)
        if rng.random() < 0.1:
            tracker.absorb(queue_owner._queue)
            queue_owner._queue = []  # a take()
    tracker.absorb(queue_owner._queue)
    for medium in (MEDIUM_GPU, MEDIUM_CPU):
        assert set(tracker.announced[medium]) == sub.media()[medium]
    assert tracker.corrections["unknown_removal"] == 0


def _medium(event: Any) -> str | None:
    medium = getattr(event, "medium", None)
    return None if medium is None else str(getattr(medium, "value", medium))


def _clone(event: Any) -> Any:
    import msgspec

    if not hasattr(event, "block_hashes"):
        return event
    fields = {"block_hashes": list(event.block_hashes)}
    if hasattr(event, "token_ids"):
        fields["token_ids"] = list(event.token_ids)
    return msgspec.structs.replace(event, **fields)
