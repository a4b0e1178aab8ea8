"""What each rank is prefilling or has queued: the pages it will hold once those prefills finish.

A rank publishes a page (``BlockStored``) only when the prefill that computes it finishes, so
without this the requests that arrive while a prompt is being prefilled - the rest of a GRPO
group, an agent's fan-out - see no hit anywhere and each recomputes the prefix on another
rank.  The dispatcher that sent the prompt knows better: it records the prompt's block keys
(the index's chained keys, :func:`sglang_kvpub.core.hashing.sequence_keys`) against the rank
it chose, and a later prompt sharing them scores that rank as if it held them.  The wait
until they are done is already in the rank's load: the dispatcher commits the pending
prompt's uncached tokens to the rank when it sends it, and the engine's load counts it while
it is queued or running, so a request sent after it waits for it (docs/dispatch.md, "Pending
prefixes").

An entry leaves when its rank publishes the prompt's last block (the pages are then in the
index: :meth:`PendingPrefixes.settle`), when the engine says the request ended without
storing it (:meth:`PendingPrefixes.drop`: abort), or ``ttl_s`` after it was added (a request
retracted or lost where the dispatcher cannot see it).  Bounded: at most ``max_requests``
entries and ``max_keys`` keys in all; past either the oldest entry is dropped (counted).

Pure: no SGLang; thread safe (the controller loop adds, the fan-in thread settles).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

__all__ = ["DEFAULT_MAX_KEYS", "DEFAULT_MAX_REQUESTS", "DEFAULT_TTL_S", "DROP_REASONS", "PendingPrefixes"]

DEFAULT_MAX_REQUESTS = 8192  # a burst of this many prompts in flight per instance
DEFAULT_MAX_KEYS = 1_048_576  # ~100 MB of dict entries at worst, 128k-token prompts x 8 per rank
DEFAULT_TTL_S = 300.0  # longer than any queue wait worth routing to
# Why entries left: stored (the rank published it), aborted (engine hook), expired (ttl),
# capped (the bound), restarted (the rank's cache is gone).
DROP_REASONS = ("stored", "aborted", "expired", "capped", "restarted")


class _Entry(NamedTuple):
    rank: int
    keys: tuple[int, ...]
    deadline: float


class PendingPrefixes:
    """Per rank, the block keys of the prompts sent there whose pages it has not published yet."""

    def __init__(
        self,
        dp_size: int,
        *,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_keys: int = DEFAULT_MAX_KEYS,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        if dp_size <= 0 or max_requests <= 0 or max_keys <= 0 or ttl_s <= 0:
            raise ValueError("dp_size, max_requests, max_keys and ttl_s must be positive")
        self.dp_size = dp_size
        self.max_requests = max_requests
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self._held: list[dict[int, int]] = [{} for _ in range(dp_size)]  # per rank: key -> entries holding it
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()  # oldest first
        self._per_rank = [0] * dp_size
        # Per rank: tokens of requests sent to wait for an entry's prefill (riders), which the
        # engine's load counts as work the rank will not do; each entry holds its riders' part.
        self.credit = [0.0] * dp_size
        self._credit: dict[Hashable, float] = {}
        self.keys = 0
        self.added = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def empty(self, ranks: Iterable[int] | None = None) -> bool:
        """No entry (on any of ``ranks``): the dispatcher's one check per decision when idle."""
        if not self._entries:
            return True
        if ranks is None:
            return False
        per_rank = self._per_rank
        return not any(0 <= r < self.dp_size and per_rank[r] for r in ranks)

    def depths(self, keys: Sequence[int], ranks: Iterable[int]) -> dict[int, int]:
        """``rank -> leading keys of the prompt pending there``, for the ranks with at least one."""
        out: dict[int, int] = {}
        with self._lock:
            for rank in ranks:
                if not (0 <= rank < self.dp_size and self._per_rank[rank]):
                    continue
                held = self._held[rank]
                n = 0
                for key in keys:
                    if key not in held:
                        break
                    n += 1
                if n:
                    out[rank] = n
        return out

    def credited(self) -> bool:
        """Whether any rank has riders (then :meth:`waits` changes loads)."""
        return bool(self._credit)

    def keys_of(self, rank: int, limit: int) -> list[int]:
        """Up to ``limit`` of the block keys pending on ``rank``, oldest entries' first: what
        the rank-load message tells the router (``wire.RankLoad.pending``)."""
        out: list[int] = []
        if not 0 <= rank < self.dp_size or limit <= 0:
            return out
        with self._lock:
            if not self._per_rank[rank]:
                return out
            seen: set[int] = set()
            for entry in self._entries.values():
                if entry.rank != rank:
                    continue
                for key in entry.keys:
                    if key not in seen:
                        seen.add(key)
                        out.append(key)
                        if len(out) >= limit:
                            return out
        return out

    def waits(self, loads: Sequence[float]) -> list[float]:
        """``loads`` (indexed by rank) less each rank's riders: the wait of a request that
        joins a pending prefix is the prefill in front of it, not the riders beside it, which
        the cache serves once that prefill ends."""
        credit = self.credit
        return [max(0.0, load - credit[r]) if r < len(credit) and credit[r] else load for r, load in enumerate(loads)]

    def ride(self, rank: int, keys: Sequence[int], depth: int, tokens: float) -> bool:
        """A request waits on ``rank`` for the entry holding its first ``depth`` keys, which
        saves it ``tokens``: credited to the rank while that entry is pending."""
        if depth <= 0 or tokens <= 0 or not 0 <= rank < self.dp_size or depth > len(keys):
            return False
        last = keys[depth - 1]
        with self._lock:
            for rid, entry in self._entries.items():
                if entry.rank == rank and len(entry.keys) >= depth and entry.keys[depth - 1] == last:
                    self._credit[rid] = self._credit.get(rid, 0.0) + tokens
                    self.credit[rank] += tokens
                    return True
        return False

    def add(self, rid: Hashable, rank: int, keys: Sequence[int], now: float | None = None) -> None:
        """``keys`` (a prompt's leading block keys) will be on ``rank`` once request ``rid`` is prefilled."""
        if not keys or not 0 <= rank < self.dp_size:
            return
        now = time.monotonic() if now is None else now
        entry = _Entry(rank, tuple(keys), now + self.ttl_s)
        with self._lock:
            if rid in self._entries:
                self._remove(rid, "stored")  # the same id sent again: the newer one counts
                self.dropped["stored"] -= 1
            self._expire(now)
            while self._entries and (
                len(self._entries) >= self.max_requests or self.keys + len(entry.keys) > self.max_keys
            ):
                self._remove(next(iter(self._entries)), "capped")
            if len(entry.keys) > self.max_keys:
                self.dropped["capped"] += 1
                return
            held = self._held[rank]
            for key in entry.keys:
                held[key] = held.get(key, 0) + 1
            self.keys += len(entry.keys)
            self._per_rank[rank] += 1
            self._entries[rid] = entry
            self.added += 1

    def drop(self, rid: Hashable, reason: str = "aborted") -> bool:
        """Forget request ``rid`` (the engine ended it); False when it was not pending."""
        with self._lock:
            if rid not in self._entries:
                return False
            self._remove(rid, reason)
            return True

    def settle(self, rank: int, holds: Callable[[int], bool], now: float | None = None) -> int:
        """Drops ``rank``'s entries whose last key ``holds`` (the rank published it) and the
        expired ones; returns how many left.  Called after each of the rank's batches."""
        now = time.monotonic() if now is None else now
        with self._lock:
            before = len(self._entries)
            self._expire(now)
            if 0 <= rank < self.dp_size and self._per_rank[rank]:
                done = [rid for rid, e in self._entries.items() if e.rank == rank and holds(e.keys[-1])]
                for rid in done:
                    self._remove(rid, "stored")
            return before - len(self._entries)

    def clear(self, reason: str = "aborted") -> None:
        """Forget every entry (every request aborted)."""
        with self._lock:
            for rid in list(self._entries):
                self._remove(rid, reason)

    def clear_rank(self, rank: int) -> None:
        """The rank restarted: nothing it was prefilling will be published."""
        with self._lock:
            for rid in [rid for rid, e in self._entries.items() if e.rank == rank]:
                self._remove(rid, "restarted")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": len(self._entries),
                "keys": self.keys,
                "added": self.added,
                "dropped": dict(self.dropped),
                "max_requests": self.max_requests,
                "max_keys": self.max_keys,
            }

    # ------------------------------------------------------------------ internal (lock held)

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            rid, entry = next(iter(entries.items()))
            if entry.deadline > now:
                return
            self._remove(rid, "expired")

    def _remove(self, rid: Hashable, reason: str) -> None:
        entry = self._entries.pop(rid)
        held = self._held[entry.rank]
        for key in entry.keys:
            left = held.get(key, 0) - 1
            if left > 0:
                held[key] = left
            else:
                held.pop(key, None)
        self.keys -= len(entry.keys)
        self._per_rank[entry.rank] -= 1
        credit = self._credit.pop(rid, 0.0)
        if credit:
            rest = self.credit[entry.rank] - credit
            self.credit[entry.rank] = rest if rest > 1e-6 else 0.0
        self.dropped[reason] += 1
