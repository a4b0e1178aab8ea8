"""Why each page left: ``BlockRemoved.reason`` on the events SGLang's recorder hands out.

SGLang 0.5.23's ``BlockRemoved`` has no reason (SGLang #39604 asks for one).  At ``take``
(the release hooks' take hook, once per scheduler step) every removal in the taken list is
given one, from what the rank's announced state says at that moment:

- ``CPU_PINNED``: the host copy went - ``host_eviction``;
- ``GPU`` with the block still announced on host: the page moved down a tier -
  ``demoted_to_host`` (HiCache's demotion keeps the host copy);
- ``GPU`` otherwise: ``capacity_eviction`` (the radix cache frees pages only to make room);
- any other medium: ``other``.

The Rust tree core's recorder (``_RustKVCacheEventRecorder``: its events never pass through
``KVCacheEventRecorder.take``) gets the same rule from its own hook, :func:`rust_take_hook`,
which follows the host copies announced in the events it hands out.

Removals the plugin makes itself carry theirs from the start (a reconciliation repair:
``other``).  A clear stays ``AllBlocksCleared`` (the folded view turns a rank's clear into
removals with reason ``cleared``).  The reasoned event is a subclass of SGLang's own struct
with the same tag and class name: SGLang's encoder writes the extra ``reason`` key, the
project's adopter reads it, older readers skip it.  Cost: one pass over the taken list and
one struct per removal event (a few per step), on the path that already absorbs them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Union

from sglang_kvpub.core.release_tracker import medium_of
from sglang_kvpub.engine import guard
from sglang_kvpub.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    REASON_CAPACITY,
    REASON_DEMOTED,
    REASON_HOST_EVICTED,
    REASON_OTHER,
)

__all__ = ["RUST_RECORDER_CLASS", "reasoned_removal", "give_reasons", "rust_take_hook"]

RUST_RECORDER_CLASS = "sglang.srt.mem_cache.rust_tree_core.adapter._RustKVCacheEventRecorder"

_CLASSES: dict[int, type] = {}  # id(SGLang's BlockRemoved) -> its reasoned subclass


def _reasoned_class(base: type) -> type:
    cls = _CLASSES.get(id(base))
    if cls is None:
        namespace = {"__annotations__": {"reason": Union[str, None]}, "reason": None, "__module__": base.__module__}
        cls = types.new_class("BlockRemoved", (base,), {"tag": "BlockRemoved"}, lambda ns: ns.update(namespace))
        _CLASSES[id(base)] = cls
    return cls


def reasoned_removal(event: Any, reason: str) -> Any:
    """``event`` (SGLang's ``BlockRemoved``) with ``reason``; a reasoned one is returned as is."""
    if getattr(event, "reason", None) is not None:
        return event
    base = type(event)
    if _CLASSES.get(id(base)) is base:  # already the subclass, reason None
        base = base.__mro__[1]
    return _reasoned_class(base)(block_hashes=event.block_hashes, medium=event.medium, reason=reason)


def give_reasons(events: list[Any], announced: dict[str, dict[int, Any]]) -> int:
    """Every removal in ``events`` (SGLang's taken list) gets its reason, in place; returns
    how many were given one.  ``announced``: the rank's announced hashes per medium, with
    the taken list already absorbed."""
    given = 0
    host = announced.get(MEDIUM_CPU)
    for index, event in enumerate(events):
        if type(event).__name__ != "BlockRemoved" or getattr(event, "reason", None) is not None:
            continue
        medium = medium_of(event.medium)
        hashes = event.block_hashes
        if medium == MEDIUM_CPU:
            reason = REASON_HOST_EVICTED
        elif medium == MEDIUM_GPU:
            reason = REASON_DEMOTED if host and hashes and hashes[0] in host else REASON_CAPACITY
        else:
            reason = REASON_OTHER
        events[index] = reasoned_removal(event, reason)
        given += 1
    return given


def rust_take_hook(original: Callable[..., Any], recorder: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_RustKVCacheEventRecorder.take``: the taken events with their reasons.  The
    host copies are followed from the events themselves (one dict per recorder)."""
    events = original(recorder, *args, **kwargs)
    if not events or type(events) is not list or guard.REASONS in guard._disabled:
        return events
    try:
        host: dict[int, None] | None = getattr(recorder, "_kvpub_host", None)
        if host is None:
            host = recorder._kvpub_host = {}
        for event in events:
            name = type(event).__name__
            if name == "AllBlocksCleared":
                host.clear()
            elif name == "BlockStored" and medium_of(event.medium) == MEDIUM_CPU:
                host.update(dict.fromkeys(event.block_hashes))
            elif name == "BlockRemoved" and medium_of(event.medium) == MEDIUM_CPU:
                for block_hash in event.block_hashes:
                    host.pop(block_hash, None)
        give_reasons(events, {MEDIUM_CPU: host})  # as of the end of the taken list, as at take
    except Exception as exc:  # reasons are an extra: the events go out whatever happens here
        guard.fail(guard.REASONS, exc)
    return events
