"""What one KV-event recorder has announced, per medium, and the release corrections made.

Engine-neutral half of the release hooks (:mod:`sglang_kvpub.engine.release_hooks` installs
them into SGLang): the tracker absorbs the recorder's queued events lazily, remembers the
touched tree nodes of the current operation, and counts what the plugin corrected.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any

from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU

__all__ = ["Tracker", "medium_of"]

_MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
# Cache for absorbing events: event type -> its name.
_KINDS: dict[type, str] = {}


def medium_of(value: Any) -> str:
    """SGLang's ``StorageMedium`` enum or a plain string -> the wire string."""
    if value is None:
        return MEDIUM_GPU
    return str(getattr(value, "value", value))


class Tracker:
    """Per-recorder announced state, touched nodes and correction counters."""

    __slots__ = (
        "announced",
        "armed",
        "corrections",
        "cpu",
        "depth",
        "epoch",
        "gpu",
        "lock",
        "media",
        "pending",
        "plugin_removed",
        "pos_hash",
        "queue_ref",
        "removals",
        "seen",
        "tree",
    )

    def __init__(self) -> None:
        # medium -> {hash: mark}.  The mark is the reconciliation epoch at which the hash
        # was last stored or seen resident (reconcile.py); a dict so marking is a value
        # update, never a resize or a new container.
        self.announced: dict[str, dict[int, int]] = {MEDIUM_GPU: {}, MEDIUM_CPU: {}}
        # The two media's dicts, for the hot path (never replaced: cleared in place).
        self.gpu = self.announced[MEDIUM_GPU]
        self.cpu = self.announced[MEDIUM_CPU]
        # Hashes the plugin removed that SGLang may still remove itself (dedupe).
        self.plugin_removed: dict[str, set[int]] = {MEDIUM_GPU: set(), MEDIUM_CPU: set()}
        # SGLang's medium value (enum, string or None) -> (announced, plugin_removed) of it.
        self.media: dict[Any, tuple[dict[int, int], set[int]]] = {}
        self.queue_ref: list[Any] | None = None
        self.seen = 0
        self.pos_hash = 0
        self.pending: list[Any] = []
        self.depth = 0
        self.tree: Any = None
        # cause -> blocks: release_gpu/release_cpu (hooks), deduped, unknown_removal,
        # reconcile_* (reconcile.py).
        self.corrections: collections.Counter[str] = collections.Counter()
        self.epoch = 0
        # Whether the tree's operations can free Full KV without SGLang's event (None: not
        # yet known; see :func:`tree_armed`).
        self.armed: bool | None = None
        # Hashes ever removed from ``announced`` (reconcile.py resumes its scan with it).
        self.removals = 0
        self.lock = threading.RLock()

    def announced_count(self, medium: str = MEDIUM_GPU) -> int:
        return len(self.announced.get(medium, ()))

    # ------------------------------------------------------------------ absorb

    def absorb(self, queue: list[Any]) -> None:
        """Apply the not-yet-seen part of the recorder's queue (coalescing-aware).

        ``seen`` events were seen, the last of them up to ``pos_hash`` hashes (SGLang may
        extend a queued event's hash list later).
        """
        if queue is not self.queue_ref:
            self.queue_ref = queue
            self.seen = 0
            self.pos_hash = 0
        size = len(queue)
        if size == self.seen and (size == 0 or self.pos_hash == len(getattr(queue[-1], "block_hashes", ()))):
            return  # nothing new: the common case, called around every tree operation
        index = self.seen - 1 if self.seen else 0
        while index < len(queue):
            event = queue[index]
            start = 0
            if index < self.seen:  # the seen tail: only hashes coalesced into it since
                start = self.pos_hash
                if start >= len(getattr(event, "block_hashes", ())):
                    index += 1
                    continue
            if self._absorb_event(event, start):
                del queue[index]  # fully deduplicated removal
                self.seen = min(self.seen, index)
                continue
            index += 1
        self.seen = len(queue)
        self.pos_hash = len(getattr(queue[-1], "block_hashes", ())) if queue else 0

    def _absorb_event(self, event: Any, start: int) -> bool:
        """Apply one event from hash ``start``; True when it is now empty and must go."""
        kind = _KINDS.get(type(event))
        if kind is None:
            kind = _KINDS[type(event)] = type(event).__name__
        if kind == "AllBlocksCleared":
            for marks in self.announced.values():
                self.removals += len(marks)
                marks.clear()
            for blocks in self.plugin_removed.values():
                blocks.clear()
            return False
        hashes = getattr(event, "block_hashes", None)
        if hashes is None:
            return False
        if start:
            if start >= len(hashes):
                return False
            fresh = hashes[start:]
        else:
            fresh = hashes
        raw = getattr(event, "medium", None)
        try:
            announced, removed = self.media[raw]
        except (KeyError, TypeError):  # a medium not seen yet, or unhashable
            announced, removed = self._medium_state(raw)
        if kind == "BlockStored":
            epoch = self.epoch
            for block_hash in fresh:  # a plain loop: cheaper than a temporary dict for a few pages
                announced[block_hash] = epoch
            if removed:
                removed.difference_update(fresh)
            return False
        if kind != "BlockRemoved":
            return False
        if removed and not removed.isdisjoint(fresh):
            duplicate = removed.intersection(fresh)
            removed.difference_update(duplicate)
            self.corrections["deduped"] += len(duplicate)
            hashes[start:] = [h for h in fresh if h not in duplicate]
            fresh = hashes[start:]
            if not hashes:
                return True
        unknown = 0  # not announced (a hash listed twice is removed once)
        for block_hash in fresh:
            try:
                del announced[block_hash]
            except KeyError:
                unknown += 1
        self.removals += len(fresh) - unknown
        if unknown:
            self.corrections["unknown_removal"] += unknown
        return False

    def _medium_state(self, raw: Any) -> tuple[dict[int, int], set[int]]:
        """(announced marks, plugin-removed hashes) of an SGLang medium value, cached by it."""
        medium = medium_of(raw)
        state = (self.announced.setdefault(medium, {}), self.plugin_removed.setdefault(medium, set()))
        with contextlib.suppress(TypeError):  # unhashable: not cached
            self.media[raw] = state
        return state

    def skip_to_end(self, queue: list[Any]) -> None:
        """Mark everything queued as absorbed (after the plugin enqueued its own event)."""
        self.queue_ref = queue
        self.seen = len(queue)
        self.pos_hash = len(getattr(queue[-1], "block_hashes", ())) if queue else 0
