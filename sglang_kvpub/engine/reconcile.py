"""Drift check and time-boxed reconciliation of the announced state against the real tree.

The check is O(1): blocks announced on GPU (the release-hook tracker) against the tree's
own device counters (``evictable + protected`` Full tokens / page size).  When they
differ, :class:`Reconciler` repairs the announced state in slices of at most
``budget_s`` of scheduler time (called while the scheduler is idle).

No slice does O(n) work and the walk builds no container proportional to the tree
(a dict or set resize, copy or free of a million entries alone costs milliseconds, and
many new container objects drive Python's cyclic GC):

1. *Walk*: a DFS over the tree, a few pages at a time (a cursor inside the current
   node).  Every resident page's hash still announced gets the walk's *epoch* written
   into the tracker's announced dict (a value update: no resize, no allocation);
   resident pages never announced put their node on a short "missing" list.
   Stores absorbed during the walk carry the epoch too, removals delete the entry.
2. *Scan*: announced entries whose mark is not the epoch were announced before the
   walk, not removed since, and not found resident: stale.  The dict is iterated in
   place across slices; when events resized it between slices the iteration restarts
   and skips, in chunks, the entries certainly checked already.
3. *Emit*: stale hashes as ``BlockRemoved``, missing nodes as single-block
   ``BlockStored`` (token ids, parent), in chunks, each re-checked first.
   Corrections are counted per cause on the tracker.

*Resync* (:meth:`Reconciler.resync`, e.g. after the rank publisher saw a new fan-in):
``AllBlocksCleared`` is enqueued into SGLang's queue (the tracker forgets everything
announced), then every resident page is re-announced as single-page ``BlockStored``
(GPU and CPU_PINNED), parents first, in the same bounded slices.  A node's children are
taken only once the node itself is re-announced, so a store SGLang records meanwhile
for a new child always follows its parent's re-announcement (no orphan downstream);
each chunk re-checks that the node is still attached, unsplit and resident first.

Allocation: a slice allocates only through pymalloc (requests <= 512 B).  Python hands
larger requests to glibc's malloc, and glibc defers the sorting of freed chunks (its
unsorted bin, up to 10,000 chunks per call) and the merging of its fast bins
(``malloc_consolidate``) to the next such request - a request of the reconciler would pay
for every chunk the scheduler process freed since (a tree's torch tensors, key arrays and
children tables).  Measured: 0.5-2.3 ms inside one unit of work (a 768 B stack realloc in
the walk, a 1 KB ``dict.fromkeys`` at the start of the emit), perf samples in
``_int_malloc``, ``malloc_consolidate`` and ``unlink_chunk``.  So the DFS stack is a list
with a fixed bottom reserve (no realloc while it moves), the FIFOs are pre-warmed deques,
and the emit dedupes a chunk in a list.

Why one module over 450 lines: :class:`Reconciler` is one resumable state machine (walk,
scan, emit, resync) whose cursors live between time-boxed slices; its phases share that
state and the tracker's epoch marks, so they stay together.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from sglang_kvpub.engine import guard, tree_cores
from sglang_kvpub.engine.release_hooks import (
    Tracker,
    _event_classes,
    _sglang_medium,
    device_pages,
    emit_removed,
    emit_stored,
    node_block_hashes,
    node_resident,
    tracker_of,
    tree_of,
)
from sglang_kvpub.publish.rank_publisher import take_resync_request
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU

__all__ = [
    "device_pages",
    "drift",
    "Reconciler",
    "IDLE_TARGET",
    "RESYNC_FANIN",
    "install_reconcile_hook",
    "reconcile_on_idle",
    "SLICE_BUDGET_S",
    "EventDriftWatch",
    "IDLE_CHECK_INTERVAL_S",
]

log = logging.getLogger(__name__)

IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
# Per-slice budget (wall clock): half of the 1 ms of scheduler time a step may lose, so a
# slice that is preempted once or runs on cold caches still stays under 1 ms.
SLICE_BUDGET_S = 0.0005
_PAGES_PER_CHECK = 16  # pages hashed between clock reads (~2-3 us each)
_SCAN_PER_CHECK = 512  # announced entries examined between clock reads
_SKIP_PER_CHECK = 1 << 14  # entries skipped (C speed) between clock reads (~0.05 ms)
_EMIT_PER_CHECK = 32  # stale hashes emitted between clock reads (a chunk of 256 takes ~0.25 ms)
_MARGIN = 0.8  # stop at this fraction of the budget: one unit of work (<= ~0.05 ms) may follow
# No slice asks glibc's malloc for memory on the common path (see "Allocation" in the module
# docstring): the walk's DFS stack keeps this many bottom entries, so it never shrinks to, or
# grows from, a small allocation while pages are marked; the FIFOs of missing nodes and stale
# hashes are deques whose block free list (CPython keeps up to 16 blocks of 64 entries per
# deque) is filled once, at construction.
_STACK_RESERVE = 2048
_DEQUE_RESERVE = 16 * 64
_MEDIA = (MEDIUM_GPU, MEDIUM_CPU)

_IDLE, _WALK, _SCAN, _EMIT, _RESYNC = "idle", "walk", "scan", "emit", "resync"
RESYNC_FANIN = "fanin_reconnect"  # resync cause: the rank publisher saw a new fan-in
# (device, host) residency -> media to mark (constants: no allocation per node).
_MEDIA_OF: dict[tuple[bool, bool], tuple[str, ...]] = {
    (False, False): (),
    (True, False): (MEDIUM_GPU,),
    (False, True): (MEDIUM_CPU,),
    (True, True): _MEDIA,
}


def drift(tree: Any) -> int:
    """Announced GPU blocks minus device-resident pages (0 when consistent)."""
    tree = tree_of(tree)
    tracker = tracker_of(tree.kv_events)
    tracker.absorb(tree.kv_events._queue)
    return tracker.announced_count(MEDIUM_GPU) - device_pages(tree)


class _PageHasher:
    """Event hashes of a node's pages [start, stop), with SGLang's own helper functions.

    Falls back to the whole node at once (``record_remove`` into a scratch queue) when
    this SGLang lacks the helpers.
    """

    def __init__(self, recorder: Any) -> None:
        module = _event_classes(recorder)
        self.recorder = recorder
        self.to_int = getattr(module, "hash_str_to_int64", None)
        self.namespaced = getattr(module, "namespaced_block_hash", None)
        self.fast = (
            self.to_int is not None
            and self.namespaced is not None
            and hasattr(recorder, "_node_event_hash_values")
            and hasattr(recorder, "_namespace_seed")
        )

    def pages(self, node: Any) -> int:
        page = int(self.recorder.page_size)
        return (len(node.key) + page - 1) // page

    def open(self, node: Any) -> tuple[Any, Any]:
        """Per-node context: (hash strings, namespace seed) or (hashes, None) on fallback."""
        if self.fast:
            return self.recorder._node_event_hash_values(node), self.recorder._namespace_seed(node)
        return node_block_hashes(self.recorder, node), _FALLBACK

    def hash_at(self, context: tuple[Any, Any], index: int) -> int:
        values, seed = context
        if seed is _FALLBACK:
            return int(values[index])
        assert self.to_int is not None and self.namespaced is not None
        return int(self.namespaced(self.to_int(values[index]), namespace_seed=seed))


_FALLBACK: Any = object()


class Reconciler:
    """Bounded-slice repair of one tree; ``step()`` once per idle scheduler iteration."""

    def __init__(
        self, tree: Any, budget_s: float = SLICE_BUDGET_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.tree = tree_of(tree)
        self.budget_s = budget_s
        self.clock = clock
        self.phase = _IDLE
        self.epoch = 0
        # Walk: DFS stack of nodes and, in parallel, the parent each was pushed under
        # (a split since then put a new node between them: visit it too).
        # Both lists start with ``_STACK_RESERVE`` placeholders that stay below the DFS
        # entries: the stack is empty at that length (see "Allocation" above).
        self._stack: list[Any] = _reserved_list()
        self._parents: list[Any] = _reserved_list()
        self._node: Any = None
        self._media: tuple[str, ...] = ()
        self._context: Any = None
        self._page = 0
        self._pages = 0
        # Deques: pre-order (parents first) kept, freed block by block as they drain.
        self._hasher: _PageHasher | None = None
        self._store: _StoreCursor | None = None
        self._missing: dict[str, collections.deque[Any]] = {m: _warm_deque() for m in _MEDIA}
        # Scan / emit.
        self._medium_index = 0
        self._iter: Iterator[tuple[int, int]] | None = None
        self._consumed = 0
        self._skip = 0
        self._removals_base = 0
        self._stale: dict[str, collections.deque[int]] = {m: _warm_deque() for m in _MEDIA}
        self._resync: _Resync | None = None
        self.walks = 0
        self.slices = 0
        self.max_slice_s = 0.0
        self.resyncs: collections.Counter[str] = collections.Counter()  # cause -> resyncs started
        self.resyncs_done = 0

    @property
    def tracker(self) -> Tracker:
        return tracker_of(self.tree.kv_events)

    @property
    def walking(self) -> bool:
        return self.phase != _IDLE

    def run(self) -> None:
        """A whole repair at once, still in slices (tests, bench)."""
        self.step(force=True)
        while self.walking:
            self.step()

    def resync(self, cause: str = RESYNC_FANIN) -> bool:
        """Starts a full re-announcement (a repair in progress is dropped); False if disabled.

        The ``AllBlocksCleared`` is enqueued now; the stores follow in :meth:`step` slices."""
        recorder = self.tree.kv_events
        if not recorder.enabled:
            return False
        self._reset_walk()
        tracker = self.tracker
        tracker.absorb(recorder._queue)
        clear = getattr(recorder, "record_all_cleared", None)
        if clear is not None:
            clear()
        else:
            recorder.enqueue(_event_classes(recorder).AllBlocksCleared())
        tracker.absorb(recorder._queue)  # forgets every announced hash
        self.resyncs[cause] += 1
        self._resync = _Resync(self.tree, _PageHasher(recorder))
        self.phase = _RESYNC
        return True

    def _reset_walk(self) -> None:
        del self._stack[_STACK_RESERVE:]
        del self._parents[_STACK_RESERVE:]
        self._node = self._context = self._iter = self._store = self._resync = None
        self._skip = 0
        for queue in (*self._missing.values(), *self._stale.values()):
            queue.clear()
        self.phase = _IDLE

    def step(self, force: bool = False) -> bool:
        """One slice; returns True when a repair (or resync) finished in this slice."""
        recorder = self.tree.kv_events
        if not recorder.enabled:
            return False
        start = self.clock()
        deadline = start + self.budget_s * _MARGIN
        try:
            if self.phase == _RESYNC:
                assert self._resync is not None
                if not self._resync.step(self.clock, deadline):
                    return False
                self._resync = None
                self.phase = _IDLE
                self.resyncs_done += 1
                return True
            if self.phase == _IDLE:
                if not force and drift(self.tree) == 0:
                    return False
                self._begin()
            if self.phase == _WALK and (not self._walk(deadline) or self.clock() >= deadline):
                return False
            if self.phase == _SCAN and (not self._scan(deadline) or self.clock() >= deadline):
                return False
            if self.phase == _EMIT and not self._emit(deadline):
                return False
            self.phase = _IDLE
            self.walks += 1
            return True
        finally:
            self.slices += 1
            self.max_slice_s = max(self.max_slice_s, self.clock() - start)

    # ------------------------------------------------------------------ walk

    def _begin(self) -> None:
        tracker = self.tracker
        tracker.absorb(self.tree.kv_events._queue)
        tracker.epoch += 1
        self.epoch = tracker.epoch
        root = self.tree.root_node
        self._stack.extend(root.children.values())
        self._parents.extend(itertools.repeat(root, len(self._stack) - len(self._parents)))
        self._hasher = _PageHasher(self.tree.kv_events)
        self._node = None
        self.phase = _WALK

    def _walk(self, deadline: float) -> bool:
        clock = self.clock
        while True:
            if self._node is not None:
                self._mark_pages()
            elif len(self._stack) > _STACK_RESERVE:
                self._open_next()
            else:
                self.phase = _SCAN
                self._medium_index = 0
                self._iter = None
                return True
            if clock() >= deadline:
                return False

    def _open_next(self) -> None:
        node = self._stack.pop()
        expected = self._parents.pop()
        parent = node.parent
        if parent is not expected and parent is not None and _is_child(self.tree, parent, node):
            # A split since the push put ``parent`` between them: visit it (and so its
            # children, this node among them) instead.
            self._stack.append(parent)
            self._parents.append(expected)
            return
        if not _is_child(self.tree, parent, node):
            return  # detached since the push (evicted): nothing resident below
        self._stack.extend(node.children.values())
        self._parents.extend(itertools.repeat(node, len(node.children)))
        if node.key is None or len(node.key) == 0:
            return
        media = _MEDIA_OF[node_resident(node)]
        if media:
            self._node = node
            self._media = media
            self._context = None
            self._page = 0
            assert self._hasher is not None
            self._pages = self._hasher.pages(node)

    def _mark_pages(self) -> None:
        """Mark one chunk of the current node's pages."""
        node = self._node
        hasher = self._hasher
        assert hasher is not None
        if self._context is None:
            self._context = hasher.open(node)
        announced = self.tracker.announced
        epoch = self.epoch
        stop = min(self._page + _PAGES_PER_CHECK, self._pages)
        for index in range(self._page, stop):
            block_hash = hasher.hash_at(self._context, index)
            for medium in self._media:
                marks = announced[medium]
                mark = marks.get(block_hash)
                if mark is None:
                    missing = self._missing[medium]
                    if not missing or missing[-1] is not node:
                        missing.append(node)
                elif mark != epoch:
                    marks[block_hash] = epoch
        self._page = stop
        if stop >= self._pages:
            self._node = None
            self._context = None

    # ------------------------------------------------------------------ scan

    def _scan(self, deadline: float) -> bool:
        tracker = self.tracker
        tracker.absorb(self.tree.kv_events._queue)
        epoch = self.epoch
        while self._medium_index < len(_MEDIA):
            medium = _MEDIA[self._medium_index]
            marks = tracker.announced[medium]
            stale = self._stale[medium]
            if self._iter is None:
                self._iter = iter(marks.items())
                self._consumed = 0
                self._removals_base = tracker.removals
            try:
                if self._skip and not self._skip_checked(deadline):
                    return False
                while True:
                    chunk = 0
                    for block_hash, mark in self._iter:
                        if mark != epoch:
                            stale.append(block_hash)
                        chunk += 1
                        if chunk == _SCAN_PER_CHECK:
                            break
                    self._consumed += chunk
                    if chunk < _SCAN_PER_CHECK:
                        break
                    if self.clock() >= deadline:
                        return False
            except RuntimeError:  # resized by events since the last slice: restart, skip the checked
                self._restart(tracker)
                continue
            self._iter = None
            self._medium_index += 1
        self.phase = _EMIT
        self._medium_index = 0
        return True

    def _restart(self, tracker: Tracker) -> None:
        # The first (consumed - removals since) entries are all checked: dicts keep order,
        # removals only close gaps and insertions append.
        removed = tracker.removals - self._removals_base
        self._skip = max(0, self._consumed - removed)
        self._iter = None

    def _skip_checked(self, deadline: float) -> bool:
        tracker = self.tracker
        marks = tracker.announced[_MEDIA[self._medium_index]]
        if self._iter is None:
            self._iter = iter(marks.items())
            self._consumed = 0
            self._removals_base = tracker.removals
        while self._skip:
            count = min(self._skip, _SKIP_PER_CHECK)
            next(itertools.islice(self._iter, count - 1, count), None)
            self._skip -= count
            self._consumed += count
            if self._skip and self.clock() >= deadline:
                return False
        return True

    # ------------------------------------------------------------------ emit

    def _emit(self, deadline: float) -> bool:
        tracker = self.tracker
        recorder = self.tree.kv_events
        epoch = self.epoch
        for medium in _MEDIA:
            suffix = "gpu" if medium == MEDIUM_GPU else "cpu"
            marks = tracker.announced[medium]
            stale = self._stale[medium]
            while stale:
                still: list[int] = []  # <= _EMIT_PER_CHECK entries: no allocation above 512 B
                for _ in range(min(len(stale), _EMIT_PER_CHECK)):
                    block_hash = stale.popleft()
                    # A restarted scan may list a hash twice: dedupe (later chunks re-check marks).
                    if marks.get(block_hash, epoch) != epoch and block_hash not in still:
                        still.append(block_hash)
                emit_removed(recorder, tracker, still, medium, f"reconcile_stale_{suffix}")
                if self.clock() >= deadline:
                    return False
            missing = self._missing[medium]
            while missing or self._store is not None:
                self._emit_missing_chunk(missing, medium, f"reconcile_missing_{suffix}")
                if self.clock() >= deadline:
                    return False
        return True

    def _emit_missing_chunk(self, missing: collections.deque[Any], medium: str, cause: str) -> None:
        """Single-page ``BlockStored`` for a few of a missing node's unannounced pages."""
        recorder = self.tree.kv_events
        hasher = self._hasher
        assert hasher is not None
        store = self._store
        if store is None:
            node = missing.popleft()
            if not self._still_resident(node, medium):
                return
            if not hasher.fast:  # whole node at once, SGLang's own record_store
                events = _stores_for(recorder, node, self.tracker.announced[medium], medium)
                emit_stored(recorder, self.tracker, events, cause)
                return
            store = self._store = _StoreCursor(recorder, hasher, node, medium)
        events = store.next_chunk(self.tracker.announced[medium], _PAGES_PER_CHECK)
        if store.done:
            self._store = None
        emit_stored(recorder, self.tracker, events, cause)

    def _still_resident(self, node: Any, medium: str) -> bool:
        if not _is_child(self.tree, node.parent, node):
            return False
        device, host = node_resident(node)
        return device if medium == MEDIUM_GPU else host


class _StoreCursor:
    """Builds SGLang ``BlockStored`` structs page by page, as its recorder's ``record_store`` does.

    Hashes, namespace seed, parent link and LoRA name come from the recorder's own helpers.
    """

    def __init__(self, recorder: Any, hasher: _PageHasher, node: Any, medium: str) -> None:
        module = _event_classes(recorder)
        self.module = module
        self.hasher = hasher
        self.node = node
        self.context = hasher.open(node)
        self.page = 0
        self.pages = hasher.pages(node)
        self.page_size = int(recorder.page_size)
        seed = self.context[1]
        parent = recorder._parent_block_hash(node)
        self.parent = None if parent is None else hasher.namespaced(parent, namespace_seed=seed)  # type: ignore[misc]
        extra = node.key.extra_key
        names = getattr(recorder, "lora_names", None)
        lora_name = None
        if names is not None:
            lora_name = names.resolve(extra) if getattr(recorder, "dynamo_format", False) else names.get(extra)
        fields = set(getattr(module.BlockStored, "__struct_fields__", ()))
        optional = {"cache_salt": node.key.cache_salt, "session_id": None, "lora_name": lora_name}
        self.extra = {k: v for k, v in optional.items() if k in fields}
        self.medium = _sglang_medium(module, medium)
        self.medium_name = medium
        self.done = self.pages == 0

    def next_chunk(self, announced: dict[int, int], count: int) -> list[Any]:
        key = self.node.key
        raw = key.token_ids
        bigram = getattr(key, "is_bigram", False)
        length = len(key)
        out: list[Any] = []
        stop = min(self.page + count, self.pages)
        for index in range(self.page, stop):
            block_hash = self.hasher.hash_at(self.context, index)
            if block_hash not in announced:
                first, last = index * self.page_size, min((index + 1) * self.page_size, length)
                tokens = [(raw[j], raw[j + 1]) for j in range(first, last)] if bigram else list(raw[first:last])
                out.append(
                    self.module.BlockStored(
                        block_hashes=[block_hash],
                        parent_block_hash=self.parent,
                        token_ids=tokens,
                        block_size=len(tokens),
                        lora_id=None,
                        medium=self.medium,
                        **self.extra,
                    )
                )
            self.parent = block_hash
        self.page = stop
        self.done = stop >= self.pages
        return out


def _reserved_list() -> list[Any]:
    """``_STACK_RESERVE`` placeholders in an allocation of twice that: pushes up to the same
    number again and pops back to the placeholders never reallocate (CPython shrinks a list
    only below half its allocation)."""
    entries: list[Any] = [None] * (2 * _STACK_RESERVE)
    del entries[_STACK_RESERVE:]
    return entries


def _warm_deque() -> collections.deque[Any]:
    """An empty deque whose block free list is full: its first ``_DEQUE_RESERVE`` entries
    reuse those blocks instead of asking malloc (a block is 528 B, above pymalloc's limit)."""
    queue: collections.deque[Any] = collections.deque(itertools.repeat(None, _DEQUE_RESERVE))
    queue.clear()
    return queue


def _is_child(tree: Any, parent: Any, node: Any) -> bool:
    """One-level attachment check (O(1)): ``node`` is still ``parent``'s child."""
    if parent is None or node.key is None or len(node.key) == 0:
        return False
    try:
        return parent.children.get(node.key.child_key(tree.page_size)) is node
    except (IndexError, ValueError, AttributeError):
        return any(child is node for child in parent.children.values())


def _stores_for(recorder: Any, node: Any, announced: dict[int, int], medium: str) -> list[Any]:
    """Fallback: SGLang's ``record_store`` into a scratch queue, split into single pages."""
    import msgspec

    module = _event_classes(recorder)
    saved = recorder._queue
    recorder._queue = []
    try:
        recorder.record_store(node, medium=_sglang_medium(module, medium))
        scratch = recorder._queue
    finally:
        recorder._queue = saved
    out: list[Any] = []
    for event in scratch:
        parent = event.parent_block_hash
        size = event.block_size
        for index, block_hash in enumerate(event.block_hashes):
            if block_hash not in announced:
                tokens = list(event.token_ids[index * size : (index + 1) * size])
                out.append(
                    msgspec.structs.replace(
                        event, block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens
                    )
                )
            parent = block_hash
    return out


class _Resync:
    """Re-announces every resident page of the tree, pre-order, in bounded chunks."""

    def __init__(self, tree: Any, hasher: _PageHasher) -> None:
        self.tree = tree
        self.hasher = hasher
        root = tree.root_node
        self.stack: list[tuple[Any, Any]] = [(child, root) for child in root.children.values()]
        self.node: Any = None
        self.parent: Any = None
        self.length = 0
        self.cursors: list[_StoreCursor] = []

    def step(self, clock: Callable[[], float], deadline: float) -> bool:
        """Works until ``deadline``; True once every page is re-announced."""
        while True:
            if self.node is not None:
                self._emit_chunk()
            elif self.stack:
                self._open(*self.stack.pop())
            else:
                return True
            if clock() >= deadline:
                return False

    def _open(self, node: Any, expected: Any) -> None:
        parent = node.parent
        if not _is_child(self.tree, parent, node):
            return  # evicted since the push
        if parent is not expected:  # split since the push: the new parent first
            self.stack.append((parent, expected))
            return
        self.node, self.parent, self.length = node, parent, len(node.key)
        recorder = self.tree.kv_events
        if self.hasher.fast:
            self.cursors = [_StoreCursor(recorder, self.hasher, node, m) for m in _MEDIA_OF[node_resident(node)]]
        else:  # whole node at once, with SGLang's own record_store
            for medium in _MEDIA_OF[node_resident(node)]:
                events = _stores_for(recorder, node, {}, medium)
                emit_stored(recorder, tracker_of(recorder), events, _resync_cause(medium))
            self.cursors = []

    def _emit_chunk(self) -> None:
        node = self.node
        if not self._unchanged(node):
            self._reopen(node)
            return
        cursors = [c for c in self.cursors if not c.done]
        if not cursors:  # re-announced on every medium: now its children
            self.stack.extend((child, node) for child in node.children.values())
            self.node, self.cursors = None, []
            return
        cursor = cursors[0]
        device, host = node_resident(node)
        if not (device if cursor.medium_name == MEDIUM_GPU else host):
            cursor.done = True  # left this medium meanwhile (SGLang announced it)
            return
        recorder = self.tree.kv_events
        tracker = tracker_of(recorder)
        events = cursor.next_chunk({}, _PAGES_PER_CHECK)
        emit_stored(recorder, tracker, events, _resync_cause(cursor.medium_name))

    def _unchanged(self, node: Any) -> bool:
        return node.parent is self.parent and len(node.key) == self.length and _is_child(self.tree, self.parent, node)

    def _reopen(self, node: Any) -> None:
        """Split or evicted mid-node: redo from the node now at its place (a duplicate
        store is harmless), or drop it when it is gone."""
        self.node, self.cursors = None, []
        if _is_child(self.tree, node.parent, node):
            parent = node.parent
            if parent is self.parent or _is_child(self.tree, self.parent, parent):
                self.stack.append((parent if parent is not self.parent else node, self.parent))


def _resync_cause(medium: str) -> str:
    return "resync_gpu" if medium == MEDIUM_GPU else "resync_cpu"


# --------------------------------------------------------------------------- idle hook


def reconcile_on_idle(scheduler: Any, budget_s: float = SLICE_BUDGET_S) -> bool:
    """One bounded reconciliation slice for the scheduler's tree (call only when idle);
    True while a repair or resync is under way (the next idle call should continue it).

    On a core without a walkable tree (the Rust core) the drift is checked from the
    core's events and counters instead; resync requests are consumed and reported."""
    tree = getattr(scheduler, "tree_cache", None)
    if tree is None or getattr(tree, "disable", False):
        return False
    core = tree_of(tree)
    if guard.disabled(guard.RECONCILE):
        return False
    try:
        work = core.__dict__.get(_IDLE_WORK)
        if work is None:
            work = core.__dict__[_IDLE_WORK] = _idle_work(core, budget_s)
        if work is _NOTHING:
            return False
        resync = take_resync_request()
        if isinstance(work, Reconciler):
            if resync:
                work.resync(RESYNC_FANIN)
            work.step()
            return work.walking
        work.step(resync)
    except Exception as exc:
        guard.fail(guard.RECONCILE, exc)
    return False


_IDLE_WORK = "_kvpub_reconciler"  # a Reconciler or an EventDriftWatch
_NOTHING: Any = object()


def _idle_work(core: Any, budget_s: float) -> Any:
    """The per-tree idle worker, decided once: a Reconciler on walkable trees, an
    :class:`EventDriftWatch` on the Rust core; the tree core is named in one start line."""
    recorder = getattr(core, "kv_events", None)
    if recorder is None or not recorder.enabled:
        return _NOTHING
    kind = tree_cores.core_kind(core)
    line = tree_cores.limit_line(kind, f"{type(core).__name__} in this scheduler")
    if line is not None:
        log.warning("%s", line)
    else:
        log.info("sglang_kvpub: %s tree core (%s): every guarantee holds", kind, type(core).__name__)
    if kind == tree_cores.RUST:
        return EventDriftWatch(core)
    return Reconciler(core, budget_s)


class EventDriftWatch:
    """HBM truth on a core without a walkable tree: the announced GPU blocks followed from
    the core's own events (its recorder's ``take`` is wrapped on the instance), compared
    with its Full device counters when idle.  A difference is counted (``drift_checks``,
    ``drift_seen``, ``last_drift``) and logged when it changes; it cannot be repaired.
    A resync request (fan-in restart) cannot re-announce anything: counted and logged."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.tracker = Tracker()
        self.page_size = max(1, int(getattr(core, "page_size", 1) or 1))
        self.drift_checks = 0
        self.drift_seen = 0
        self.last_drift = 0
        self.resyncs_impossible = 0
        # Blocks stored before the wrap were never seen: no baseline, no check.
        self.baseline_ok = self.device_pages() == 0
        recorder = core.kv_events
        original = recorder.take
        tracker = self.tracker

        def take(*args: Any, **kwargs: Any) -> Any:
            events = original(*args, **kwargs)
            if events and not guard.disabled(guard.RECONCILE):
                try:
                    tracker.absorb(events)
                    tracker.queue_ref = None  # do not keep the taken list alive
                except Exception as exc:
                    guard.fail(guard.RECONCILE, exc)
            return events

        recorder.take = take

    def device_pages(self) -> int:
        core = self.core
        return int(core.full_evictable_size() + core.full_protected_size()) // self.page_size

    def drift(self) -> int:
        return len(self.tracker.gpu) - self.device_pages()

    def step(self, resync: bool = False) -> None:
        if resync:
            self.resyncs_impossible += 1
            log.warning(
                "sglang_kvpub: fan-in restarted but the %s tree core exposes no walkable tree: "
                "this rank's cached blocks are not re-announced (they reappear as they are stored again)",
                tree_cores.RUST,
            )
        if not self.baseline_ok:
            return
        self.drift_checks += 1
        value = self.drift()
        if value != self.last_drift:
            self.last_drift = value
            if value:
                self.drift_seen += 1
                log.warning(
                    "sglang_kvpub: announced GPU blocks differ from the %s core's device pages by %d; "
                    "no walkable tree to repair it (occurrence %d)",
                    tree_cores.RUST,
                    value,
                    self.drift_seen,
                )


# An idle scheduler spins through on_idle tens of thousands of times a second: between
# repairs the O(1) drift check (and the resync poll) runs at most this often, so an idle
# call costs one clock read.  A repair under way gets every idle call.
IDLE_CHECK_INTERVAL_S = 0.005
_idle_due = [0.0]  # per process: SGLang runs one scheduler per process


def _idle_hook(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    if guard.IDLE in guard._disabled:
        return result
    now = time.monotonic()
    if now < _idle_due[0]:
        return result
    try:
        under_way = reconcile_on_idle(scheduler)
    except Exception as exc:
        guard.fail(guard.IDLE, exc)
        return result
    _idle_due[0] = now if under_way else now + IDLE_CHECK_INTERVAL_S
    return result


def install_reconcile_hook(registry: Any) -> None:
    """AFTER hook on ``Scheduler.on_idle`` (corrections are published at the next flush)."""
    hook_type = sys.modules[registry.__module__].HookType
    registry.register(IDLE_TARGET, _idle_hook, hook_type.AFTER)
