"""Release hooks: ``BlockRemoved`` for every page that leaves HBM (or host memory), exactly once.

SGLang 0.5.23 records most releases itself (docs/hbm-release.md lists every path), but
some free a tree node's Full KV without an event - e.g. SWA/Mamba-triggered cascades
that take the Full layer with them, or paths added by later versions.  These hooks,
installed through SGLang's ``HookRegistry`` (no SGLang edit), close the gap generically:

- *Announced state* per recorder (``KVCacheEventRecorder``): the block hashes announced
  per medium, absorbed lazily from the recorder's own queue (nothing runs per page on
  the hot path).  ``take()`` absorbs before SGLang drains the queue.
- *Touch* hooks on the low-level node-free helpers note which nodes were touched.
- *Settle* after the outermost tree operation returns (and before ``take``): for each
  touched node that no longer holds its Full KV on a medium, the hashes still announced
  there are removed with one ``BlockRemoved`` enqueued into SGLang's own queue, so it is
  published in order with SGLang's events.
- *Dedupe*: if SGLang later records a removal the plugin already emitted, those hashes
  are stripped from SGLang's event while it is still queued: never twice.
- *Armed* trees only (:func:`tree_armed`): a unified core with the Full component alone
  cannot free Full KV without SGLang's event inside its operations (only SWA/Mamba
  cascades do), so there the outer operations only count depth; touches outside any
  operation are settled on every tree, and the idle drift check covers the rest.

Nothing here imports SGLang at module level; event classes come from the recorder's
module when first needed.

Why one module over 450 lines: the touch, outer-operation, reset and take hooks share one
protocol per tree operation (depth, touched nodes, settle on the way out); the engine-neutral
tracker they write into is :mod:`sglang_kvpub.core.release_tracker`.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from sglang_kvpub.core.release_tracker import Tracker, medium_of
from sglang_kvpub.engine import guard
from sglang_kvpub.engine.removal_reasons import RUST_RECORDER_CLASS, give_reasons, reasoned_removal, rust_take_hook
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU, REASON_OTHER

__all__ = [
    "RECORDER_CLASS",
    "LEGACY_TREE_CLASS",
    "UNIFIED_CORE_CLASS",
    "Tracker",
    "install_release_hooks",
    "hook_targets",
    "tracker_of",
    "tree_of",
    "tree_armed",
    "node_resident",
    "node_attached",
    "node_block_hashes",
    "settle",
    "device_pages",
    "gpu_drift",
]

log = logging.getLogger(__name__)

RECORDER_CLASS = "sglang.srt.mem_cache.events.KVCacheEventRecorder"
LEGACY_TREE_CLASS = "sglang.srt.mem_cache.radix_cache.RadixCache"
UNIFIED_CORE_CLASS = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"

# Low-level helpers that free (part of) a node: the node is their first argument.
# ``_remove_leaf_from_parent`` is not one: in 0.5.23 every caller first frees the node's
# Full layers through ``_evict_component_and_detach_lru`` (touched) in the same operation,
# or the node holds no Full KV (tombstone); settle sees the detachment either way.
_TOUCH = {
    LEGACY_TREE_CLASS: ("_delete_leaf",),
    UNIFIED_CORE_CLASS: ("_cascade_evict", "_evict_component_and_detach_lru"),
}
# Public tree operations that may reach them: settle when the outermost one returns.
_OUTER = {
    LEGACY_TREE_CLASS: ("evict",),
    UNIFIED_CORE_CLASS: (
        "finish_mamba_state_eviction",
        "finish_swa_state_eviction",
        "evict_device_leaf",
        "demote",
        "drop_subtree_no_host",
        "drive_host_eviction",
        "evict_excess_path_states",
        "dec_lock_ref",
        "dec_window_lock_only",
        "dec_swa_lock_only",
    ),
}
# ``UnifiedTreeCore.evict_device_next_node`` mutates the tree only through the SWA and
# Mamba components' step (the Full one just picks the next leaf; the core then calls
# ``evict_device_leaf``): their step is the outer operation, on the component, whose
# ``tree_core`` is the tree.  A Full-only tree pays nothing for selecting victims.
SWA_COMPONENT_CLASS = "sglang.srt.mem_cache.unified_cache.components.swa.SWAComponent"
MAMBA_COMPONENT_CLASS = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent"
_COMPONENT_OUTER = {
    SWA_COMPONENT_CLASS: ("_evict_device_next_node",),
    MAMBA_COMPONENT_CLASS: ("_evict_device_next_node",),
}
_RESET = {LEGACY_TREE_CLASS: ("reset",), UNIFIED_CORE_CLASS: ("reset",)}


def tracker_of(recorder: Any) -> Tracker:
    tracker = recorder.__dict__.get("_kvpub_tracker")
    if tracker is None:
        tracker = Tracker()
        recorder.__dict__["_kvpub_tracker"] = tracker  # an instance attribute: hooks read it directly
    return tracker


def tree_of(obj: Any) -> Any:
    """The object holding ``root_node`` and ``kv_events`` (UnifiedRadixCache -> its core)."""
    core = getattr(obj, "tree_core", None)
    return core if core is not None else obj


# --------------------------------------------------------------------------- node facts


def node_resident(node: Any) -> tuple[bool, bool]:
    """(Full KV on device, Full KV on host and acknowledged) for a legacy or unified node."""
    data = getattr(node, "component_data", None)
    if data is None:
        return node.value is not None, False
    full = data[0]  # ComponentType.FULL == 0
    host = full.host_value is not None and getattr(node, "write_through_pending_id", None) is None
    return full.value is not None, host


def node_attached(tree: Any, node: Any) -> bool:
    """Whether ``node`` is still reachable from ``tree.root_node``."""
    root = tree.root_node
    page = tree.page_size
    while node is not root:
        parent = node.parent
        if parent is None or node.key is None or len(node.key) == 0:
            return False
        try:
            if parent.children.get(node.key.child_key(page)) is not node:
                return False
        except (IndexError, ValueError):
            return False
        node = parent
    return True


def node_block_hashes(recorder: Any, node: Any) -> list[int]:
    """The event hashes of ``node``'s pages, computed by SGLang's own recorder code."""
    saved = recorder._queue
    recorder._queue = []
    try:
        recorder.record_remove(node)
        scratch = recorder._queue
    finally:
        recorder._queue = saved
    return [h for event in scratch for h in event.block_hashes]


def _event_classes(recorder: Any) -> Any:
    return sys.modules[type(recorder).__module__]


def emit_removed(recorder: Any, tracker: Tracker, hashes: list[int], medium: str, cause: str) -> None:
    """Enqueue one plugin ``BlockRemoved`` into SGLang's queue (announced state updated)."""
    if not hashes:
        return
    module = _event_classes(recorder)
    tracker.absorb(recorder._queue)
    event = module.BlockRemoved(block_hashes=list(hashes), medium=_sglang_medium(module, medium))
    if cause.startswith("reconcile"):  # a repair: the engine freed it unannounced, why is not known
        event = reasoned_removal(event, REASON_OTHER)
    KVCacheEventRecorderEnqueue(recorder, event)
    tracker.skip_to_end(recorder._queue)
    announced = tracker.announced.setdefault(medium, {})
    for block_hash in hashes:
        if announced.pop(block_hash, None) is not None:
            tracker.removals += 1
    tracker.plugin_removed.setdefault(medium, set()).update(hashes)
    tracker.corrections[cause] += len(hashes)


def emit_stored(recorder: Any, tracker: Tracker, events: list[Any], cause: str) -> None:
    """Enqueue plugin ``BlockStored`` events (already in SGLang's struct type)."""
    if not events:
        return
    tracker.absorb(recorder._queue)
    for event in events:
        KVCacheEventRecorderEnqueue(recorder, event)
        medium = medium_of(event.medium)
        tracker.announced.setdefault(medium, {}).update(dict.fromkeys(event.block_hashes, tracker.epoch))
        tracker.plugin_removed.setdefault(medium, set()).difference_update(event.block_hashes)
        tracker.corrections[cause] += len(event.block_hashes)
    tracker.skip_to_end(recorder._queue)


def _sglang_medium(module: Any, medium: str) -> Any:
    enum = getattr(module, "StorageMedium", None)
    if enum is None:
        return medium
    try:
        return enum(medium)
    except ValueError:
        return medium


def KVCacheEventRecorderEnqueue(recorder: Any, event: Any) -> None:
    recorder.enqueue(event)


# --------------------------------------------------------------------------- settle


def settle(tree: Any) -> int:
    """Emit removals for touched nodes no longer resident; returns blocks removed."""
    recorder = tree.kv_events
    if not recorder.enabled:
        return 0
    tracker = tracker_of(recorder)
    if not tracker.pending:
        return 0
    with tracker.lock:
        pending, tracker.pending = tracker.pending, []
        tracker.absorb(recorder._queue)
        removed = 0
        seen: set[int] = set()
        for node in pending:
            if id(node) in seen:
                continue
            seen.add(id(node))
            removed += _settle_node(tree, recorder, tracker, node)
        return removed


def _settle_node(tree: Any, recorder: Any, tracker: Tracker, node: Any) -> int:
    if node is tree.root_node or node.key is None or len(node.key) == 0:
        return 0
    device, host = node_resident(node)
    if (device or host) and not node_attached(tree, node):
        device = host = False
    ends: tuple[int, int] | tuple[()] | None = None
    hashes: list[int] | None = None
    removed = 0
    for medium, resident in ((MEDIUM_GPU, device), (MEDIUM_CPU, host)):
        announced = tracker.announced.get(medium)
        if resident or not announced:
            continue
        # Usually SGLang already removed the node (whole nodes at a time): two page
        # hashes tell, instead of hashing every page.
        if ends is None:
            ends = node_end_hashes(recorder, node)
        if ends and ends[0] not in announced and ends[1] not in announced:
            continue
        if hashes is None:
            hashes = node_block_hashes(recorder, node)
        stale = [h for h in hashes if h in announced]
        if stale:
            emit_removed(recorder, tracker, stale, medium, "release_gpu" if medium == MEDIUM_GPU else "release_cpu")
            removed += len(stale)
    return removed


def node_end_hashes(recorder: Any, node: Any) -> tuple[int, int] | tuple[()]:
    """Event hashes of the node's first and last page (SGLang's helpers); () if unavailable."""
    module = _event_classes(recorder)
    to_int = getattr(module, "hash_str_to_int64", None)
    namespaced = getattr(module, "namespaced_block_hash", None)
    if to_int is None or namespaced is None or not hasattr(recorder, "_node_event_hash_values"):
        return ()
    values = recorder._node_event_hash_values(node)
    if not values:
        return ()
    seed = recorder._namespace_seed(node)
    return (
        int(namespaced(to_int(values[0]), namespace_seed=seed)),
        int(namespaced(to_int(values[-1]), namespace_seed=seed)),
    )


# --------------------------------------------------------------------------- hooks
#
# Hot path: every hooked call pays the hook's frame, so the hooks below do the least
# possible per call: the tracker is an instance attribute of the recorder (read with
# plain attribute access; the AttributeError path sets it up once), the device counters
# are read by a per-class function (no missing-attribute lookups), the queue is absorbed
# only when it changed, nested outer operations only count depth, and the
# end-of-operation check is inline.


# Containment (guard.py): each hook calls SGLang's original exactly once, outside the
# guarded part; a failure of the plugin's part switches the release feature off.
_OFF = guard.RELEASE


def _touch_hook(original: Callable[..., Any], self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, node, *args, **kwargs)
    if _OFF in guard._disabled:
        return result
    try:
        _touched(self, node)
    except Exception as exc:
        guard.fail(_OFF, exc)
    return result


def _touched(tree: Any, node: Any) -> None:
    try:
        recorder = tree.kv_events
        tracker = recorder._kvpub_tracker
    except AttributeError:
        recorder = getattr(tree, "kv_events", None)
        if recorder is None:
            return
        tracker = tracker_of(recorder)
    if recorder.enabled:
        tracker.pending.append(node)
        if not tracker.depth:
            tracker.tree = tree
            settle(tree)


def _unified_tokens(tree: Any) -> int:
    """Full device tokens of a ``UnifiedTreeCore`` (ComponentType.FULL == 0)."""
    return tree.component_evictable_size_[0] + tree.component_protected_size_[0]


def _legacy_tokens(tree: Any) -> int:
    return tree.evictable_size_ + tree.protected_size_


_COUNT_ERRORS = (AttributeError, KeyError, TypeError, ZeroDivisionError)


def _make_outer_hook(unified: bool, component: bool = False) -> Callable[..., Any]:
    """AROUND hook for a public tree operation; settles when the outermost one returns.

    Entry (outermost only): the queue is absorbed (only if it changed) and the *balance*
    announced GPU blocks minus SGLang's device pages is noted.  Exit with touched nodes:
    if the balance did not move, SGLang announced every device release itself (see
    :func:`_end_operation`).  ``unified``: the tree is a ``UnifiedTreeCore`` (Full
    counters per component) rather than a legacy ``RadixCache``.  ``component``: the
    method belongs to a tree component; its ``tree_core`` is the tree.
    """

    def outer_hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        if _OFF in guard._disabled:
            return original(self, *args, **kwargs)
        try:
            tree: Any = getattr(self, "tree_core", None) if component else self
            try:
                recorder = tree.kv_events
                tracker = recorder._kvpub_tracker
            except AttributeError:
                recorder = getattr(tree, "kv_events", None)
                tracker = None if recorder is None else tracker_of(recorder)
            enabled = recorder is not None and recorder.enabled
        except Exception as exc:
            guard.fail(_OFF, exc)
            enabled = False
        if not enabled:  # SGLang's original is called outside every guarded part
            return original(self, *args, **kwargs)
        assert tracker is not None
        depth = tracker.depth
        if depth:  # nested: the outermost operation settles
            tracker.depth = depth + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                tracker.depth = depth
        armed = tracker.armed
        if armed is None:
            armed = tracker.armed = tree_armed(tree)
        if not armed:
            # Full-only tree: every Full release of the operation is SGLang's own event
            # (tree_armed); anything else would show as drift and be reconciled.
            tracker.depth = 1
            try:
                return original(self, *args, **kwargs)
            finally:
                tracker.depth = 0
                if tracker.pending:
                    tracker.pending.clear()
        balance: int | None = None
        try:
            tracker.absorb(recorder._queue)
            try:
                tokens = _unified_tokens(tree) if unified else _legacy_tokens(tree)
                balance = len(tracker.gpu) - tokens // tree.page_size
            except _COUNT_ERRORS:
                balance = None
        except Exception as exc:
            guard.fail(_OFF, exc)
            return original(self, *args, **kwargs)
        tracker.depth = 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.depth = 0
            if tracker.pending and _OFF not in guard._disabled:
                try:
                    _end_operation(tree, recorder, tracker, balance, unified)
                except Exception as exc:
                    guard.fail(_OFF, exc)

    return outer_hook


def tree_armed(tree: Any) -> bool:
    """Whether ``tree``'s operations may free Full KV without SGLang's own event.

    In SGLang 0.5.23 only a non-Full component (SWA, Mamba, ...) cascading into the Full
    layer does (docs/hbm-release.md).  A unified core with the Full component alone
    records every Full release itself, so its operations are not checked.  The legacy
    tree (and anything unknown) stays checked.
    """
    types = getattr(tree, "component_types", None)
    if types is None:
        return True
    try:
        return any(int(component) != 0 for component in types)  # ComponentType.FULL == 0
    except (TypeError, ValueError):
        return True


def _end_operation(tree: Any, recorder: Any, tracker: Tracker, balance: int | None, unified: bool) -> None:
    """End of the outermost operation that touched nodes.

    Fast path: nothing announced on host (no counter there) and announced GPU blocks
    minus SGLang's device page counter did not move during the operation: every page
    that left HBM was removed by SGLang's own events, so the touched nodes are dropped
    unchecked.  Otherwise each touched node is checked (:func:`settle`).
    """
    tracker.tree = tree
    if balance is not None:
        tracker.absorb(recorder._queue)
        if not tracker.cpu:
            try:
                tokens = _unified_tokens(tree) if unified else _legacy_tokens(tree)
                unchanged = len(tracker.gpu) - tokens // tree.page_size == balance
            except _COUNT_ERRORS:
                unchanged = False
            if unchanged:
                tracker.pending.clear()
                return
    settle(tree)


def device_pages(tree: Any) -> int:
    """Pages of Full KV the tree holds on device, from SGLang's own O(1) counters."""
    tree = tree_of(tree)
    evictable = getattr(tree, "component_evictable_size_", None)
    if evictable is not None:
        tokens = evictable[0] + tree.component_protected_size_[0]  # ComponentType.FULL
    else:
        tokens = tree.evictable_size_ + tree.protected_size_
    return int(tokens) // int(tree.page_size)


def gpu_drift(tree: Any, tracker: Tracker) -> int | None:
    """Announced GPU blocks minus device pages (queue absorbed first); None if not countable."""
    try:
        pages = device_pages(tree)
    except (AttributeError, IndexError, TypeError):
        return None
    tracker.absorb(tree.kv_events._queue)
    return len(tracker.announced.get(MEDIUM_GPU, ())) - pages


def _reset_hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    if _OFF not in guard._disabled:
        try:
            recorder = getattr(self, "kv_events", None)
            if recorder is not None:
                tracker_of(recorder).pending.clear()  # old nodes: the reset's clear covers them
        except Exception as exc:
            guard.fail(_OFF, exc)
    return original(self, *args, **kwargs)


def _take_hook(original: Callable[..., Any], recorder: Any, *args: Any, **kwargs: Any) -> Any:
    if _OFF in guard._disabled or not recorder.enabled:
        return original(recorder, *args, **kwargs)
    try:
        try:
            tracker = recorder._kvpub_tracker
        except AttributeError:
            tracker = tracker_of(recorder)
        if tracker.pending and tracker.tree is not None and not tracker.depth:
            settle(tracker.tree)  # takes the tracker's lock
        # Tree operations, their hooks and ``take`` run on the scheduler thread: no lock here.
        tracker.absorb(recorder._queue)
    except Exception as exc:
        guard.fail(_OFF, exc)
        return original(recorder, *args, **kwargs)
    events = original(recorder, *args, **kwargs)
    try:
        if events and type(events) is list and guard.REASONS not in guard._disabled:
            give_reasons(events, tracker.announced)
    except Exception as exc:
        guard.fail(guard.REASONS, exc)
    try:
        # Follow the fresh queue now: holding the drained list would delay freeing the
        # taken batch into whatever absorbs next (an idle reconciliation slice).
        queue = recorder._queue
        if queue:
            tracker.skip_to_end(queue)
        else:
            tracker.queue_ref = queue
            tracker.seen = tracker.pos_hash = 0
    except Exception as exc:
        guard.fail(_OFF, exc)
    return events


# One outer hook per tree class, reading that class's device counters.
_OUTER_HOOKS = {
    LEGACY_TREE_CLASS: _make_outer_hook(unified=False),
    UNIFIED_CORE_CLASS: _make_outer_hook(unified=True),
}
_COMPONENT_OUTER_HOOK = _make_outer_hook(unified=True, component=True)


def hook_targets() -> list[tuple[str, Callable[..., Any]]]:
    """Every (dotted target, AROUND hook) the release hooks install."""
    targets: list[tuple[str, Callable[..., Any]]] = [
        (f"{RECORDER_CLASS}.take", _take_hook),
        (f"{RUST_RECORDER_CLASS}.take", rust_take_hook),
    ]
    for cls, methods in _TOUCH.items():
        targets.extend((f"{cls}.{method}", _touch_hook) for method in methods)
    for cls, methods in _OUTER.items():
        outer = _OUTER_HOOKS[cls]
        targets.extend((f"{cls}.{method}", outer) for method in methods)
    for cls, methods in _COMPONENT_OUTER.items():
        targets.extend((f"{cls}.{method}", _COMPONENT_OUTER_HOOK) for method in methods)
    for cls, methods in _RESET.items():
        targets.extend((f"{cls}.{method}", _reset_hook) for method in methods)
    return targets


_installed: set[str] = set()
_install_lock = threading.Lock()


def install_release_hooks(registry: Any | None = None, *, classes: Iterable[str] | None = None) -> list[str]:
    """Install the release hooks; returns the targets newly hooked.

    ``registry``: SGLang's ``HookRegistry`` (its hooks are applied by ``load_plugins``
    or the caller's ``apply_hooks()``).  ``None``: wrap the methods directly now (tests,
    SGLang without a plugin system).  Targets whose class or method does not exist in
    this SGLang are skipped.  Idempotent per process.
    """
    wanted = set(classes) if classes is not None else None
    done: list[str] = []
    with _install_lock:
        for target, hook in hook_targets():
            owner, method = target.rsplit(".", 1)
            recorder = owner in (RECORDER_CLASS, RUST_RECORDER_CLASS)
            if wanted is not None and _class_of_target(owner) not in wanted and not recorder:
                continue
            if target in _installed or not _exists(owner, method):
                continue
            if registry is None:
                _wrap_now(owner, method, hook)
            else:
                registry.register(target, hook, _around(registry))
            _installed.add(target)
            done.append(target)
    return done


def _class_of_target(owner: str) -> str:
    """The tree class a target belongs to (the unified core's components go with it)."""
    return UNIFIED_CORE_CLASS if owner in _COMPONENT_OUTER else owner


def _around(registry: Any) -> Any:
    module = sys.modules[type(registry).__module__ if not isinstance(registry, type) else registry.__module__]
    return module.HookType.AROUND


def _resolve(owner: str) -> Any | None:
    import pkgutil

    try:
        return pkgutil.resolve_name(owner)
    except (ImportError, AttributeError, ValueError):
        return None


def _exists(owner: str, method: str) -> bool:
    cls = _resolve(owner)
    return cls is not None and callable(getattr(cls, method, None))


def _wrap_now(owner: str, method: str, hook: Callable[..., Any]) -> None:
    cls = _resolve(owner)
    original = getattr(cls, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__name__ = method
    wrapper.__qualname__ = f"{getattr(cls, '__qualname__', owner)}.{method}"
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, method, wrapper)
