"""Drift check and bounded-slice reconciliation on SGLang 0.5.23's real tree caches (CPU)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")

from bench import rh_trees as rt
from sglang_kvpub.engine.reconcile import Reconciler, device_pages, drift
from sglang_kvpub.engine.release_hooks import tree_of
from sglang_kvpub.wire import MEDIUM_GPU

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ns = rt.setup  # cached: one real-SGLang setup per process


class TickClock:
    """Advances 1 ms per reading: a slice may read it only a bounded number of times."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += 0.001
        return self.now


def _filled(make: Any, prompts: int = 40) -> Any:
    tree = make(ns(), 4)
    for i in range(prompts):
        rt.insert(ns(), tree, [i % 5] * 8 + [i * 100 + j for j in range(12)])
    return tree


@pytest.mark.parametrize("make", [rt.unified_tree, rt.legacy_tree])
def test_no_drift_no_walk(make: Any) -> None:
    tree = _filled(make)
    tree.take_events()
    assert drift(tree) == 0
    rec = Reconciler(tree)
    assert rec.step() is False and not rec.walking


@pytest.mark.parametrize("make", [rt.unified_tree, rt.legacy_tree])
def test_lost_store_is_republished_in_slices(make: Any) -> None:
    tree = _filled(make)
    sub = rt.Subscriber()
    events = tree.take_events()
    lost = events[-1]  # a store the subscriber never got and the tracker forgets
    for event in events[:-1]:
        sub.state.apply(rt.to_wire(event))
    for block_hash in lost.block_hashes:
        del rt.tracker(tree).announced[MEDIUM_GPU][block_hash]
    assert drift(tree) == -len(lost.block_hashes)

    clock = TickClock()
    rec = Reconciler(tree, budget_s=0.001, clock=clock)
    slices = 0
    while not rec.step() and slices < 1000:
        slices += 1
    assert slices > 1  # the walk was split into slices
    sub.drain(tree)
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU]
    assert rt.tracker(tree).corrections["reconcile_missing_gpu"] == len(lost.block_hashes)
    assert drift(tree) == 0 and len(sub.media()[MEDIUM_GPU]) == device_pages(tree)


def test_changes_during_walk_are_left_to_events() -> None:
    tree = _filled(rt.unified_tree)
    sub = rt.Subscriber()
    sub.drain(tree)
    rt.tracker(tree).announced[MEDIUM_GPU][12345] = 0  # a phantom block: stale
    rec = Reconciler(tree, clock=TickClock())
    rec.step()
    assert rec.walking
    rt.insert(ns(), tree, [9] * 8 + list(range(500, 520)))  # mid-walk insert (announced by SGLang)
    tree.evict(ns().base.EvictParams(num_tokens=16))  # mid-walk eviction (announced by SGLang)
    while rec.walking:
        rec.step()
    sub.drain(tree)
    assert 12345 not in rt.tracker(tree).announced[MEDIUM_GPU]
    assert rt.tracker(tree).corrections["reconcile_stale_gpu"] == 1
    assert rt.tracker(tree).corrections["reconcile_missing_gpu"] == 0
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU]
    assert tree_of(tree).kv_events._queue == []


def test_scan_resumes_after_events_resize_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events between scan slices resize the announced dict: the scan restarts, skips what it
    checked, and still finds every stale hash (and nothing live)."""
    import sglang_kvpub.engine.reconcile as rc

    monkeypatch.setattr(rc, "_SCAN_PER_CHECK", 4)
    tree = _filled(rt.legacy_tree)
    sub = rt.Subscriber()
    sub.drain(tree)
    marks = rt.tracker(tree).announced[MEDIUM_GPU]
    phantoms = [-(i + 1) for i in range(12)]
    for phantom in phantoms:
        marks[phantom] = 0
    rec = Reconciler(tree, clock=TickClock())
    rec.step(force=True)
    while rec.phase != "scan":
        rec.step()
    rec.step()  # part of the scan done
    assert rec.phase == "scan"
    rt.insert(ns(), tree, [9] * 8 + list(range(700, 740)))  # resizes the announced dict
    tree.evict(ns().base.EvictParams(num_tokens=40))
    while rec.walking:
        rec.step()
    sub.drain(tree)
    assert rt.tracker(tree).corrections["reconcile_stale_gpu"] == len(phantoms)
    assert rt.tracker(tree).corrections["reconcile_missing_gpu"] == 0
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU]
    assert drift(tree) == 0


def _with_phantoms(make: Any, count: int) -> tuple[Any, Any, list[int]]:
    tree = _filled(make)
    sub = rt.Subscriber()
    sub.drain(tree)
    phantoms = [-(i + 10) for i in range(count)]
    for phantom in phantoms:
        rt.tracker(tree).announced[MEDIUM_GPU][phantom] = 0
    return tree, sub, phantoms


@pytest.mark.parametrize("make", [rt.unified_tree, rt.legacy_tree])
def test_walk_stack_never_reallocates_within_its_reserve(make: Any) -> None:
    """The DFS stack is a list with a bottom reserve: a repair moves it without one realloc
    (a realloc above pymalloc's 512 B goes to glibc, which may run its deferred free-chunk
    sorting inside the slice); it ends the repair back at the reserve."""
    import sys

    import sglang_kvpub.engine.reconcile as rc

    tree, sub, phantoms = _with_phantoms(make, 3)
    rec = Reconciler(tree, clock=TickClock())
    allocated = sys.getsizeof(rec._stack), sys.getsizeof(rec._parents)
    depth = 0
    rec.step(force=True)
    while rec.walking:
        depth = max(depth, len(rec._stack) - rc._STACK_RESERVE)
        assert (sys.getsizeof(rec._stack), sys.getsizeof(rec._parents)) == allocated
        rec.step()
    assert depth > 0  # the walk did use the stack
    assert len(rec._stack) == len(rec._parents) == rc._STACK_RESERVE
    sub.drain(tree)
    assert rt.tracker(tree).corrections["reconcile_stale_gpu"] == len(phantoms)
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU] and drift(tree) == 0


def test_walk_past_the_stack_reserve_still_repairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree wider than the reserve: the stack grows past it (a realloc, correct all the same)."""
    import sglang_kvpub.engine.reconcile as rc

    monkeypatch.setattr(rc, "_STACK_RESERVE", 1)
    tree, sub, phantoms = _with_phantoms(rt.legacy_tree, 5)
    missing = rt.tracker(tree).announced[MEDIUM_GPU]
    forgotten = next(iter(missing))
    del missing[forgotten]
    rec = Reconciler(tree, clock=TickClock())
    rec.run()
    assert len(rec._stack) == 1
    sub.drain(tree)
    corrections = rt.tracker(tree).corrections
    assert corrections["reconcile_stale_gpu"] == len(phantoms) and corrections["reconcile_missing_gpu"] == 1
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU] and drift(tree) == 0


def test_emit_removes_a_hash_listed_twice_once() -> None:
    """A restarted scan may list a stale hash twice, even within one emit chunk: one removal."""
    tree, sub, phantoms = _with_phantoms(rt.unified_tree, 2)
    rec = Reconciler(tree, clock=TickClock())
    rec.step(force=True)
    while rec.phase != "emit":
        rec.step()
    stale = rec._stale[MEDIUM_GPU]
    assert sorted(stale) == sorted(phantoms)
    stale.extend(list(stale))  # each hash twice in the same chunk
    while rec.walking:
        rec.step()
    sub.drain(tree)
    assert rt.tracker(tree).corrections["reconcile_stale_gpu"] == len(phantoms)
    assert sub.media()[MEDIUM_GPU] == rt.truth(tree)[MEDIUM_GPU] and drift(tree) == 0
