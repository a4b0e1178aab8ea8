"""Drift check and time-boxed reconciliation of the announced state against the real tree.

The check is O(1): blocks announced on GPU (the release-hook tracker's set) against the
tree's own device counters (``evictable + protected`` Full tokens / page size).  When
they differ, :class:`Reconciler` walks the tree in slices of at most ``budget_s`` of
scheduler time (called while the scheduler is idle), collecting the hashes truly
resident per medium.  Hashes changed by events while the walk runs are left alone (the
events already describe them).  At the end it emits corrective ``BlockRemoved`` /
``BlockStored`` events into SGLang's own queue, counted per cause on the tracker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sglang_kvpub.release_hooks import (
    Tracker,
    emit_removed,
    emit_stored,
    node_resident,
    tracker_of,
    tree_of,
)
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU

__all__ = ["device_pages", "drift", "Reconciler", "IDLE_TARGET", "install_reconcile_hook", "reconcile_on_idle"]

IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
_CHECK_EVERY = 1  # nodes between clock reads (a node is at most a few hundred pages)


def device_pages(tree: Any) -> int:
    """Pages of Full KV the tree holds on device, from SGLang's own O(1) counters."""
    tree = tree_of(tree)
    evictable = getattr(tree, "component_evictable_size_", None)
    if evictable is not None:
        tokens = evictable[0] + tree.component_protected_size_[0]  # ComponentType.FULL
    else:
        tokens = tree.evictable_size_ + tree.protected_size_
    return int(tokens) // int(tree.page_size)


def drift(tree: Any) -> int:
    """Announced GPU blocks minus device-resident pages (0 when consistent)."""
    tree = tree_of(tree)
    tracker = tracker_of(tree.kv_events)
    tracker.absorb(tree.kv_events._queue)
    return tracker.announced_count(MEDIUM_GPU) - device_pages(tree)


class Reconciler:
    """Bounded-slice walk of one tree; ``step()`` once per idle scheduler iteration."""

    def __init__(self, tree: Any, budget_s: float = 0.001, clock: Callable[[], float] = time.perf_counter) -> None:
        self.tree = tree_of(tree)
        self.budget_s = budget_s
        self.clock = clock
        self._stack: list[Any] | None = None
        self._visited: set[int] = set()
        self._truth: dict[str, dict[int, Any]] = {}
        # Stale phase: announced hashes checked so far (iterated in slices).
        self._stale: dict[str, list[int]] = {}
        self._missing: dict[str, dict[int, Any]] = {}
        # Big per-walk containers are emptied in later slices: freeing 1M entries at once
        # would cost milliseconds in one step.
        self._garbage: list[Any] = []
        self._checked: set[int] = set()
        self._media_left: list[str] = []
        self._iter: Any = None
        self.walks = 0
        self.slices = 0
        self.max_slice_s = 0.0

    @property
    def tracker(self) -> Tracker:
        return tracker_of(self.tree.kv_events)

    @property
    def walking(self) -> bool:
        return self._stack is not None

    def step(self, force: bool = False) -> bool:
        """One slice; returns True when a walk finished in this slice."""
        recorder = self.tree.kv_events
        if not recorder.enabled:
            return False
        start = self.clock()
        try:
            if self._garbage and not self._drain_garbage(start):
                return False
            if self._stack is None:
                if not force and drift(self.tree) == 0:
                    return False
                self._begin()
            return self._advance(start)
        finally:
            self.slices += 1
            self.max_slice_s = max(self.max_slice_s, self.clock() - start)

    def _drain_garbage(self, start: float) -> bool:
        while self._garbage:
            container = self._garbage[-1]
            pop = container.popitem if isinstance(container, dict) else container.pop
            for _ in range(min(len(container), 4096)):
                pop()
            if not container:
                self._garbage.pop()
            if self.clock() - start >= self.budget_s:
                return not self._garbage
        return True

    def run(self) -> None:
        """A whole walk at once (tests, bench)."""
        self.step(force=True)
        while self._stack is not None:
            self.step()

    def _begin(self) -> None:
        root = self.tree.root_node
        self._stack = list(root.children.values())
        self._visited = {id(root)}
        self._truth = {MEDIUM_GPU: {}, MEDIUM_CPU: {}}
        self.tracker.dirty = set()

    def _advance(self, start: float) -> bool:
        stack = self._stack
        assert stack is not None
        count = 0
        while stack:
            self._visit(stack.pop(), stack)
            count += 1
            if count % _CHECK_EVERY == 0 and self.clock() - start >= self.budget_s:
                return False
        if not self._scan_stale(start):
            return False
        self._finish()
        return True

    def _scan_stale(self, start: float) -> bool:
        """Announced-but-not-resident hashes, in slices; True when every medium is done.

        Iterates the live announced set; if events changed it between slices the
        iteration restarts, skipping what was already checked (rare: only idle slices run).
        """
        if not self._media_left and self._iter is None and not self._stale:
            self._media_left = list(self._truth)
        tracker = self.tracker
        tracker.absorb(self.tree.kv_events._queue)
        while self._media_left:
            medium = self._media_left[0]
            announced = tracker.announced.get(medium, set())
            truth = self._truth[medium]
            stale = self._stale.setdefault(medium, [])
            if self._iter is None:
                self._iter = iter(announced)
            count = 0
            try:
                for block_hash in self._iter:
                    if block_hash not in truth and block_hash not in self._checked:
                        stale.append(block_hash)
                    self._checked.add(block_hash)
                    count += 1
                    if count % 256 == 0 and self.clock() - start >= self.budget_s:
                        return False
            except RuntimeError:  # announced changed since the last slice
                self._iter = None
                continue
            self._iter = None
            self._checked = set()
            self._media_left.pop(0)
        return True

    def _visit(self, node: Any, stack: list[Any]) -> None:
        # A split may have inserted ancestors since the parent was visited: take them too.
        parent = node.parent
        while parent is not None and id(parent) not in self._visited:
            self._record(parent)
            parent = parent.parent
        if id(node) not in self._visited:
            self._record(node)
        stack.extend(node.children.values())

    def _record(self, node: Any) -> None:
        self._visited.add(id(node))
        if node.key is None or len(node.key) == 0:
            return
        device, host = node_resident(node)
        if not (device or host):
            return
        from sglang_kvpub.release_hooks import node_block_hashes

        hashes = node_block_hashes(self.tree.kv_events, node)
        for medium, resident in ((MEDIUM_GPU, device), (MEDIUM_CPU, host)):
            if resident:
                truth = self._truth[medium]
                announced = self.tracker.announced.get(medium, ())
                missing = self._missing.setdefault(medium, {})
                for block_hash in hashes:
                    truth[block_hash] = node
                    if block_hash not in announced:
                        missing[block_hash] = node

    def _finish(self) -> None:
        tracker = self.tracker
        recorder = self.tree.kv_events
        tracker.absorb(recorder._queue)
        dirty = tracker.dirty or set()
        for medium in self._truth:
            announced = tracker.announced.get(medium, set())
            stale = [h for h in self._stale.get(medium, ()) if h in announced and h not in dirty]
            suffix = "gpu" if medium == MEDIUM_GPU else "cpu"
            emit_removed(recorder, tracker, stale, medium, f"reconcile_stale_{suffix}")
            candidates = self._missing.get(medium, {})
            missing = {h: n for h, n in candidates.items() if h not in announced and h not in dirty}
            emit_stored(recorder, tracker, _stores_for(recorder, missing, medium), f"reconcile_missing_{suffix}")
        tracker.dirty = None
        self._stack = None
        self._garbage.extend([self._visited, *self._truth.values()])
        self._visited = set()
        self._truth = {}
        self._stale = {}
        self._missing = {}
        self.walks += 1


def _stores_for(recorder: Any, missing: dict[int, Any], medium: str) -> list[Any]:
    """Single-block ``BlockStored`` events (SGLang's struct) for the missing hashes, parents first."""
    if not missing:
        return []
    import msgspec

    from sglang_kvpub.release_hooks import _event_classes, _sglang_medium

    module = _event_classes(recorder)
    out: list[Any] = []
    done: set[int] = set()
    for node in _nodes_root_first(missing.values()):
        if id(node) in done:
            continue
        done.add(id(node))
        saved = recorder._queue
        recorder._queue = []
        try:
            recorder.record_store(node, medium=_sglang_medium(module, medium))
            scratch = recorder._queue
        finally:
            recorder._queue = saved
        for event in scratch:
            parent = event.parent_block_hash
            size = event.block_size
            for index, block_hash in enumerate(event.block_hashes):
                if block_hash in missing:
                    tokens = list(event.token_ids[index * size : (index + 1) * size])
                    out.append(
                        msgspec.structs.replace(
                            event, block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens
                        )
                    )
                parent = block_hash
    return out


def _nodes_root_first(nodes: Any) -> list[Any]:
    def depth(node: Any) -> int:
        d = 0
        while node.parent is not None:
            d += 1
            node = node.parent
        return d

    unique = {id(n): n for n in nodes}
    return sorted(unique.values(), key=depth)


# --------------------------------------------------------------------------- idle hook


def reconcile_on_idle(scheduler: Any, budget_s: float = 0.001) -> None:
    """One bounded reconciliation slice for the scheduler's tree (call only when idle)."""
    tree = getattr(scheduler, "tree_cache", None)
    if tree is None or getattr(tree, "disable", False):
        return
    core = tree_of(tree)
    recorder = getattr(core, "kv_events", None)
    if recorder is None or not recorder.enabled or not hasattr(core, "root_node"):
        return
    reconciler = core.__dict__.get("_kvpub_reconciler")
    if reconciler is None:
        reconciler = Reconciler(core, budget_s)
        core.__dict__["_kvpub_reconciler"] = reconciler
    reconciler.step()


def _idle_hook(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    reconcile_on_idle(scheduler)
    return result


def install_reconcile_hook(registry: Any) -> None:
    """AFTER hook on ``Scheduler.on_idle`` (corrections are published at the next flush)."""
    import sys

    hook_type = sys.modules[registry.__module__].HookType
    registry.register(IDLE_TARGET, _idle_hook, hook_type.AFTER)
