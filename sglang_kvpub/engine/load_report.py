"""The ranks' loads for the instance stream's rank-load message (``wire.LoadReport``).

The DataParallelController already receives every rank's load snapshot (SGLang's
``LoadSnapshot``, in shared memory); the fan-in runs in the same process.  This module gives
the fan-in a load source (:meth:`~sglang_kvpub.publish.fanin.FanIn.set_load_source`) that,
on the fan-in thread every ``load_report_s``, reads the snapshots through its own shared-memory
reader (the controller's reader is the controller thread's) and reports per rank:

* ``load_tokens`` - what the cache-aware dispatcher costs the rank with: SGLang's
  ``num_total_tokens`` plus the dispatcher's commits made after that snapshot, decaying
  (``dispatch_hook._with_commits``' figure, read without touching the controller's state),
  less the requests waiting there for a pending prefix (``PendingPrefixes.waits``);
* ``pending`` - the block keys the rank is prefilling or has queued (``PendingPrefixes.keys_of``,
  at most ``wire.MAX_PENDING_KEYS``);
* ``requests`` - running plus waiting;
* ``prefill_tokens_total`` - SGLang's cumulative uncached prefill tokens;
* ``cached_tokens_total`` - prompt tokens served from the rank's cache, accumulated from
  the same snapshots: each new snapshot adds its uncached-token increase times
  ``h / (1 - h)``, ``h`` being the cache hit rate SGLang reports for its latest prefill
  (exact when one prefill batch ran between two snapshots, an estimate otherwise);

and the dispatcher's decisions per reason.  Nothing runs on a scheduler: the schedulers
write those snapshots anyway.  SGLang specifics stay here (lazy: only in the controller).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from sglang_kvpub.core.dispatch import CacheAwareDispatcher
from sglang_kvpub.wire import MAX_PENDING_KEYS, RankLoad, RankLoads

__all__ = ["ControllerLoads", "attach_load_reports"]

log = logging.getLogger(__name__)

_COMMIT_RATE = math.log(2.0) / 2.0  # the dispatcher's commits decay with a 2 s half-life (dispatch_hook)


class ControllerLoads:
    """The load source: ``self()`` -> the ranks' :class:`~sglang_kvpub.wire.RankLoads`, or None
    before any rank has sent a snapshot.  ``read_all``: a callable returning SGLang's
    ``LoadSnapshot`` list (the fan-in thread's own reader)."""

    def __init__(self, read_all: Any, dispatcher: CacheAwareDispatcher | None, period_s: float) -> None:
        self._read_all = read_all
        self._dispatcher = dispatcher
        self._period_s = period_s
        self._seen: dict[int, tuple[float, int]] = {}  # rank -> (snapshot time, uncached total) last counted
        self._cached: dict[int, float] = {}

    def __call__(self) -> RankLoads | None:
        snapshots = {int(s.dp_rank): s for s in self._read_all() if getattr(s, "timestamp", 0.0)}
        if not snapshots:
            return None
        dispatcher = self._dispatcher
        now = time.time()
        ranks = []
        pending = getattr(dispatcher, "pending", None)  # None: a dispatcher without pending prefixes
        for rank in sorted(snapshots):
            snap = snapshots[rank]
            load = float(snap.num_total_tokens)
            if dispatcher is not None and rank < len(dispatcher.commits):
                for at, tokens in list(dispatcher.commits[rank]):  # a copy: the controller thread appends
                    if at > snap.timestamp:
                        load += tokens * math.exp(-_COMMIT_RATE * (now - at))
            keys: list[int] = []
            if pending is not None and rank < pending.dp_size:
                load = max(0.0, load - pending.credit[rank])
                keys = pending.keys_of(rank, MAX_PENDING_KEYS)
            ranks.append(
                RankLoad(
                    rank,
                    round(load, 1),
                    int(snap.num_running_reqs + snap.num_waiting_reqs),
                    self._count_cached(rank, snap),
                    int(snap.total_prefill_uncached_tokens),
                    keys,
                )
            )
        decisions = dispatcher.decision_counts() if dispatcher is not None else {}
        return RankLoads(ranks, decisions, self._period_s)

    def _count_cached(self, rank: int, snap: Any) -> int:
        uncached = int(snap.total_prefill_uncached_tokens)
        last = self._seen.get(rank)
        self._seen[rank] = (snap.timestamp, uncached)
        if last is not None and snap.timestamp != last[0] and uncached > last[1]:
            rate = min(max(float(snap.cache_hit_rate), 0.0), 0.999)
            self._cached[rank] = self._cached.get(rank, 0.0) + (uncached - last[1]) * rate / (1.0 - rate)
        return int(self._cached.get(rank, 0.0))


def attach_load_reports(controller: Any, fanin: Any, dispatcher: CacheAwareDispatcher | None) -> bool:
    """Gives ``fanin`` the controller's rank loads as its load source; False (logged) when the
    controller has no shared-memory load snapshots to read."""
    reader: Any = getattr(controller, "load_snapshot_reader", None)
    shm: Any = getattr(reader, "_shm_reader", reader)  # the zmq reader writes into one of these
    path, dp_size = getattr(shm, "path", None), getattr(shm, "dp_size", None)
    if shm is None or path is None or dp_size is None:
        log.info("sglang_kvpub: no load snapshots in this controller: no rank-load messages on the stream")
        return False
    own = type(shm)(path, dp_size)  # the fan-in thread's own reader: mmap reads, no shared socket
    fanin.set_load_source(ControllerLoads(own.read_all, dispatcher, fanin.config.load_report_s))
    log.info(
        "sglang_kvpub: rank-load messages on the instance stream every %.3g s (wire.LoadReport)",
        fanin.config.load_report_s,
    )
    return True
