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
from typing import NamedTuple

from sglang_kvpub import wire

__all__ = ["Claim", "InstanceLoads", "LiveLoads", "RankLoadBook", "STALE_AFTER_S"]

STALE_AFTER_S = 5.0  # the fan-in repeats unchanged figures every heartbeat (1 s by default)
# Claims held at once, over every instance; cleared when full.  A claim is needed for one
# report period (load_report_s), and every new prompt misses one lookup here: small enough that
# the miss stays in cache (its index array is 16 KiB).
_CLAIMS_MAX = 8_192


class Claim(NamedTuple):
    """Where an answer committed a prompt: ``rank`` of ``instance`` (a stream URL), under the
    instance's loads of report ``version``.  A fresh claim means that rank will hold every
    block of the prompt once the prefill the commit counts is done (see
    :meth:`RankLoadBook.claim`)."""

    instance: str
    rank: int
    version: int


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
    # Per rank: the block keys it is prefilling or has queued (wire.RankLoad.pending).
    pending: tuple[frozenset[int], ...] = ()

    @property
    def dp_size(self) -> int:
        return len(self.loads)


class LiveLoads:
    """One instance's loads as ``/query`` scores them (:meth:`RankLoadBook.live`): the report's
    receipt time (monotonic), each rank's current load (the report's plus what was committed
    to it since: ``loads``, an ``array("d")`` the C renderer reads through the buffer protocol),
    the instance's load (``total``: the report's loads as ``sum()`` adds them, plus each
    commit since, added as it is made), the report's version, the commits since it, and each
    rank's :class:`Claim` under this report (made with it, so a commit allocates nothing).  A
    report replaces the object whole (one dict store); a commit (:meth:`RankLoadBook.commit`,
    on the HTTP loop) changes it in place, so a commit racing a report lands on the replaced
    one (lost, as the report's figures already count what was queued before them)."""

    __slots__ = ("claims", "commits", "loads", "received", "total", "version")

    def __init__(self, instance: str, received: float, version: int, loads: Sequence[float]) -> None:
        self.received = received
        self.version = version
        self.loads = array("d", loads)
        self.total = sum(self.loads)
        self.commits = 0
        self.claims = tuple(Claim(instance, rank, version) for rank in range(len(self.loads)))


class RankLoadBook:
    """The latest :class:`InstanceLoads` per instance id (the index's instance: the stream URL)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._by_instance: dict[str, InstanceLoads] = {}
        # Each instance's LiveLoads: /query reads it (the C renderer in one call), and commits
        # the tokens its answers send to a rank (Motor's own committed-tokens idea) until the
        # instance's next report, so a burst of requests between two reports does not all
        # score the same idle rank.
        self._live: dict[str, LiveLoads] = {}
        # Writers that replace entries: subscriber threads (apply) and forget.  Commits run on
        # the HTTP loop and change an entry in place, without it (see LiveLoads).
        self._write = threading.Lock()
        self._version = 0
        self.reports = 0
        # Counts every report, effective commit and forget: tokens read before it still hold
        # while it does not move (the /query hot path reads it once per query).
        self.changes = 0
        # Whether any instance has figures (fresh or stale), kept by the writers: without,
        # /query asks none.  An attribute: read once per query.
        self.figured = False
        # Each instance's pending block keys per rank, while its last report had some
        # (motor_adapter/pending_hits.py reads it per query: empty means nothing to merge).
        self.pending: dict[str, tuple[float, tuple[frozenset[int], ...]]] = {}
        # Prompt (its last block key) -> where an answer committed it (commit).  The report
        # naming that prefill as pending comes one period later, and the members of a burst of
        # one prompt (a GRPO group) are asked before it: /query reads this once per query.
        # A claim ends with its instance's next report (its version no longer the live one),
        # which carries the truth then; ended ones are left in place until overwritten or the
        # dict is cleared when full, so a report costs nothing here.
        self.claims: dict[int, Claim] = {}

    def apply(self, instance: str, report: wire.LoadReport, now: float | None = None) -> None:
        """One live report of ``instance`` (already checked by ``wire.LoadReportCodec``)."""
        ranks = report.loads.ranks
        size = max((r.dp_rank for r in ranks), default=-1) + 1
        loads, requests, cached, prefill = [0.0] * size, [0] * size, [0] * size, [0] * size
        pending: list[frozenset[int]] = [frozenset()] * size
        for r in ranks:
            loads[r.dp_rank] = max(0.0, float(r.load_tokens))
            if r.pending:
                pending[r.dp_rank] = frozenset(r.pending)
            requests[r.dp_rank] = r.requests
            cached[r.dp_rank] = r.cached_tokens_total
            prefill[r.dp_rank] = r.prefill_tokens_total
        received = time.monotonic() if now is None else now
        current = tuple(loads)
        with self._write:
            self._version += 1
            self.reports += 1
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
                tuple(pending),
            )
            if any(pending):
                self.pending[instance] = (received, tuple(pending))
            else:
                self.pending.pop(instance, None)
            # The new figures include what was committed before them: no commit carries over.
            self._live[instance] = LiveLoads(instance, received, self._version, current)
            self.figured = True
            self.changes += 1

    def get(self, instance: str, now: float | None = None) -> InstanceLoads | None:
        """The instance's figures, or None when it has none or they are stale."""
        found = self._by_instance.get(instance)
        if found is None:
            return None
        if (time.monotonic() if now is None else now) - found.received > self.stale_after_s:
            return None
        return found

    def token(self, instance: str, now: float) -> tuple[int, int] | None:
        """What :meth:`get` and :meth:`current` say of ``instance`` at ``now``, as a key: None
        without fresh figures, else ``(report version, commits since that report)``.  Equal
        tokens mean equal loads: versions never repeat (every report gets a new one) and the
        commits since a report only grow, so a remembered answer keyed by it is never stale."""
        return self.tokens((instance,), now)[0][0]

    def tokens(self, instances: Sequence[str], now: float) -> tuple[tuple[tuple[int, int] | None, ...], float]:
        """:meth:`token` of each of ``instances`` at ``now``, and until when they hold while
        :attr:`changes` does not move (the first fresh one going stale)."""
        out: list[tuple[int, int] | None] = []
        until = math.inf
        stale_after = self.stale_after_s
        for instance in instances:
            found = self._live.get(instance)
            if found is None or now - found.received > stale_after:
                out.append(None)
                continue
            until = min(until, found.received + stale_after)
            out.append((found.version, found.commits))
        return tuple(out), until

    def live(self) -> Mapping[str, LiveLoads]:
        """Every instance's :class:`LiveLoads` (the C renderer reads them in one call)."""
        return self._live

    def current(self, figures: InstanceLoads, instance: str) -> tuple[tuple[float, ...], float]:
        """``figures.loads`` plus what was committed to each rank since that report, and the
        instance's load (:class:`LiveLoads`' ``total``)."""
        found = self._live.get(instance)
        if found is None or found.version != figures.version:
            return figures.loads, sum(figures.loads)
        return tuple(found.loads), found.total

    def commit(self, instance: str, rank: int, tokens: float, prompt: int) -> None:
        """``tokens`` (the uncached part of the prompt whose last block key is ``prompt``) now
        head for ``rank`` of ``instance``, and the prompt is claimed there (:meth:`claim`).  A
        prompt asked again before the instance's next report (a member of the same group, a
        retry, a tool polling ``/query``) is committed once: its claim on this instance says
        so."""
        if tokens <= 0:
            return
        found = self._live.get(instance)
        if found is None:
            return
        loads = found.loads
        if not 0 <= rank < len(loads):
            return
        claims = self.claims
        if prompt in claims and claims[prompt].version == found.version:  # versions are never reused
            return
        if len(claims) >= _CLAIMS_MAX:
            claims.clear()
        claims[prompt] = found.claims[rank]
        loads[rank] += tokens
        found.total += tokens
        found.commits += 1
        self.changes += 1

    def claim(self, prompt: int, now: float) -> Claim | None:
        """Where the prompt whose last block key is ``prompt`` was committed, while that holds:
        its instance's loads are still the report it was made under, and fresh at ``now``.  The
        committed tokens are in that rank's load, so an answer counting the rank as holding
        every block of the prompt prices the wait for them by the one cost."""
        held = self.claims.get(prompt)
        if held is None:
            return None
        found = self._live.get(held.instance)
        if found is None or found.version != held.version or now - found.received > self.stale_after_s:
            return None
        return held

    def forget(self, instance: str) -> None:
        with self._write:
            self._by_instance.pop(instance, None)
            self._live.pop(instance, None)
            self.pending.pop(instance, None)
            self.figured = bool(self._by_instance)
            self.changes += 1

    def items(self) -> list[tuple[str, InstanceLoads]]:
        """Every instance's last figures, stale ones included (metrics show what was last said)."""
        return list(self._by_instance.items())
