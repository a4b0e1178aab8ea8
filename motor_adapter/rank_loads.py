"""Each followed instance's rank loads, learned from its stream's rank-load messages.

The plugin's fan-in sends ``wire.LoadReport`` (docs/wire.md, "Rank loads") when the ranks'
figures change and at least every heartbeat; the stream subscriber hands each live one to
:meth:`RankLoadBook.apply`.  ``/query`` reads :meth:`RankLoadBook.get` to score an instance by
the rank that would serve the request.  An instance whose last report is older than
``stale_after_s`` (or that never sent one: an engine without the plugin, or an older plugin)
has no loads: it is scored by its longest hit, as before.

Writers are the subscriber threads, readers the HTTP loop: each instance's figures are one
immutable :class:`InstanceLoads`, replaced whole.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from array import array
from collections.abc import Mapping, Sequence

from sglang_kvpub import wire

__all__ = ["InstanceLoads", "LiveLoads", "RankLoadBook", "STALE_AFTER_S"]

STALE_AFTER_S = 5.0  # the fan-in repeats unchanged figures every heartbeat (1 s by default)
_COMMITTED_MAX = 65_536  # prompts committed between two reports of one instance (bounded)


@dataclasses.dataclass(frozen=True)
class InstanceLoads:
    """One instance's last report: per rank (indexed by rank, 0 where a rank sent nothing)."""

    received: float  # monotonic time of receipt
    sent: float  # the fan-in's wall time
    loads: tuple[float, ...]
    requests: tuple[int, ...]
    cached_tokens_total: tuple[int, ...]
    prefill_tokens_total: tuple[int, ...]
    dispatch: Mapping[str, int]
    period_s: float
    version: int  # increases with every report the book applies (any instance)

    @property
    def dp_size(self) -> int:
        return len(self.loads)


# One instance's loads as /query scores them, replaced whole on every report and commit (one
# dict read gives a consistent set): received (monotonic), the token (RankLoadBook.token), and
# packed, what the C renderer reads (RankLoadBook.packed_loads): native doubles - received,
# the loads' sum (left to right, as sum()), each rank's current load (RankLoadBook.current) -
# in a few cache lines, where a tuple's float objects lie all over the heap.
LiveLoads = tuple[float, tuple[int, int], bytes]


def _pack_loads(received: float, loads: Sequence[float]) -> bytes:
    packed = array("d", (received, sum(loads)))
    packed.extend(loads)
    return packed.tobytes()


class RankLoadBook:
    """The latest :class:`InstanceLoads` per instance id (the index's instance: the stream URL)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._by_instance: dict[str, InstanceLoads] = {}
        self._live: dict[str, LiveLoads] = {}
        self._packed: dict[str, bytes] = {}  # each live entry's packed part, for the C renderer
        # Writers: subscriber threads (apply) and the HTTP loop (commit, forget); readers take none.
        self._write = threading.Lock()
        # Tokens committed to a rank by /query answers since the instance's last report (the
        # rank the answer made Motor pick): Motor's own committed-tokens idea, so a burst of
        # requests between two reports does not all score the same idle rank.
        self._commits: dict[str, dict[int, float]] = {}
        self._committed: dict[str, set[int]] = {}  # prompts committed since the last report
        self._commit_count: dict[str, int] = {}  # effective commits since the last report
        self._version = 0
        self.reports = 0
        self.changes = 0  # every report, effective commit and forget: tokens read before it still hold

    def apply(self, instance: str, report: wire.LoadReport, now: float | None = None) -> None:
        """One live report of ``instance`` (already checked by ``wire.LoadReportCodec``)."""
        ranks = report.loads.ranks
        size = max((r.dp_rank for r in ranks), default=-1) + 1
        loads, requests, cached, prefill = [0.0] * size, [0] * size, [0] * size, [0] * size
        for r in ranks:
            loads[r.dp_rank] = max(0.0, float(r.load_tokens))
            requests[r.dp_rank] = r.requests
            cached[r.dp_rank] = r.cached_tokens_total
            prefill[r.dp_rank] = r.prefill_tokens_total
        received = time.monotonic() if now is None else now
        current = tuple(loads)
        with self._write:
            self._version += 1
            self.reports += 1
            self._commits.pop(instance, None)  # the new figures include what was committed before them
            self._committed.pop(instance, None)
            self._commit_count.pop(instance, None)
            self._by_instance[instance] = InstanceLoads(
                received,
                report.ts,
                current,
                tuple(requests),
                tuple(cached),
                tuple(prefill),
                dict(report.loads.dispatch),
                report.loads.period_s,
                self._version,
            )
            packed = _pack_loads(received, current)
            self._live[instance] = (received, (self._version, 0), packed)
            self._packed[instance] = packed
            self.changes += 1

    def get(self, instance: str, now: float | None = None) -> InstanceLoads | None:
        """The instance's figures, or None when it has none or they are stale."""
        found = self._by_instance.get(instance)
        if found is None:
            return None
        if (time.monotonic() if now is None else now) - found.received > self.stale_after_s:
            return None
        return found

    def has_figures(self) -> bool:
        """Whether any instance has figures (fresh or stale): without, ``/query`` asks none."""
        return bool(self._by_instance)

    def token(self, instance: str, now: float) -> tuple[int, int] | None:
        """What :meth:`get` and :meth:`current` say of ``instance`` at ``now``, as a key: None
        without fresh figures, else ``(report version, commits since that report)``.  Equal
        tokens mean equal loads: versions never repeat (every report gets a new one) and the
        commits since a report only grow, so a remembered answer keyed by it is never stale."""
        found = self._by_instance.get(instance)
        if found is None or now - found.received > self.stale_after_s:
            return None
        return found.version, self._commit_count.get(instance, 0)

    def tokens(self, instances: Sequence[str], now: float) -> tuple[tuple[tuple[int, int] | None, ...], float]:
        """:meth:`token` of each of ``instances`` at ``now``, and until when they hold while
        :attr:`changes` does not move (the first fresh one going stale)."""
        out: list[tuple[int, int] | None] = []
        until = math.inf
        stale_after = self.stale_after_s
        for instance in instances:
            found = self._live.get(instance)  # one read: the token and its figures in step
            if found is None or now - found[0] > stale_after:
                out.append(None)
                continue
            until = min(until, found[0] + stale_after)
            out.append(found[1])
        return tuple(out), until

    def packed_loads(self) -> Mapping[str, bytes]:
        """Every instance's packed live loads (read-only: the C renderer reads it in one call)."""
        return self._packed

    def current(self, figures: InstanceLoads, instance: str) -> tuple[float, ...]:
        """``figures.loads`` plus what was committed to each rank since that report."""
        extra = self._commits.get(instance)
        if not extra:
            return figures.loads
        loads = list(figures.loads)
        for rank, tokens in extra.items():
            if rank < len(loads):
                loads[rank] += tokens
        return tuple(loads)

    def commit(self, instance: str, rank: int, tokens: float, prompt: int) -> None:
        """``tokens`` (the prompt's uncached part) now head for ``rank`` of ``instance``.  A
        prompt asked again before the next report (a retry, a tool polling ``/query``) is
        committed once: Motor asks once per request."""
        if tokens <= 0:
            return
        with self._write:
            figures = self._by_instance.get(instance)
            if figures is None:
                return
            seen = self._committed.setdefault(instance, set())
            if prompt in seen or len(seen) >= _COMMITTED_MAX:
                return
            seen.add(prompt)
            extra = self._commits.setdefault(instance, {})
            extra[rank] = extra.get(rank, 0.0) + tokens
            count = self._commit_count[instance] = self._commit_count.get(instance, 0) + 1
            live = self._live.get(instance)
            if live is not None and live[1][0] == figures.version and rank < len(figures.loads):
                # Only this rank's figure moved: base + its commits, as current() computes it.
                packed = array("d")
                packed.frombytes(live[2])
                packed[2 + rank] = figures.loads[rank] + extra[rank]
                packed[1] = sum(packed[2:])
                fresh = packed.tobytes()
            else:
                fresh = _pack_loads(figures.received, self.current(figures, instance))
            self._live[instance] = (figures.received, (figures.version, count), fresh)
            self._packed[instance] = fresh
            self.changes += 1

    def forget(self, instance: str) -> None:
        with self._write:
            self._by_instance.pop(instance, None)
            self._live.pop(instance, None)
            self._packed.pop(instance, None)
            self._commits.pop(instance, None)
            self._committed.pop(instance, None)
            self._commit_count.pop(instance, None)
            self.changes += 1

    def items(self) -> list[tuple[str, InstanceLoads]]:
        """Every instance's last figures, stale ones included (metrics show what was last said)."""
        return list(self._by_instance.items())
