"""A DP rank whose scheduler process died: nothing more sent to it, its requests ended.

SGLang 0.5.23's ``DataParallelController`` starts the scheduler processes and joins them
only after its event loop returns, which it never does while serving: a scheduler killed
(``kill -9``, the OOM killer, a crash below Python) leaves the instance up, the controller
sending to a socket nobody reads, and every request on that rank waiting until its client
gives up.

:class:`RankWatch` notices, in the controller process, without touching the hot path: a
thread blocks on the scheduler processes' sentinels (``multiprocessing.connection.wait``:
no polling, nothing runs while every scheduler lives).  When one ends:

- the rank is marked dead; the controller's own thread, at its next dispatch
  (:meth:`RankWatch.before_dispatch`), sets SGLang's ``controller.status[rank] = False``, which
  SGLang's round robin and the plugin's cache-aware choice both skip; a request naming the dead
  rank (``routed_dp_rank``) is ended at once instead of being sent into the void;
- every request the dispatch hook sent to that rank that may still be in flight (the last
  :data:`MAX_TRACKED` per rank) is ended through SGLang's own path: an ``AbortReq`` with
  HTTP status 503 and the cause, sent to the tokenizer manager's socket as a scheduler sends
  one (the tokenizer manager ignores the ids of requests that already finished); a PD
  prefill request's room is registered with the bootstrap server as failed
  (``pd_register.FAILED_RANK``), which ends its decode half if that still asks for the
  room's rank (a decode that already has the rank waits for the KV until SGLang's
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``);
- the rank's blocks are cleared on the instance stream (``AllBlocksCleared`` under a new rank
  epoch, as for a restarted rank): the router stops scoring a cache that is gone;
- logged once per rank (ERROR), counted (:meth:`RankWatch.stats`).

A scheduler that ends with its instance (a stop) is not a rank death: the watch reports one
only if the controller's parent still runs :data:`SHUTDOWN_GRACE_S` after the end.

SGLang's health checks still go to every rank it launched: ``/health`` then fails when it
probes the dead one, which is what tells a supervisor to restart the instance.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
from typing import Any, NamedTuple

from sglang_kvpub.engine import guard

__all__ = ["WATCH_ATTR", "MAX_TRACKED", "RankWatch", "active", "ended_here", "sent", "attach_rank_watch"]

log = logging.getLogger(__name__)

WATCH_ATTR = "kvpub_rank_watch"
MAX_TRACKED = 1024  # requests remembered per rank (their ids and return routes)
SHUTDOWN_GRACE_S = 2.0  # a scheduler's end is a rank death if the instance still runs after this
DPC_MODULE = "sglang.srt.managers.data_parallel_controller"


class RankWatch:
    """Scheduler liveness per DP rank, and what was sent to each."""

    def __init__(
        self,
        procs: dict[int, list[Any]],
        send_abort: Any,
        *,
        max_tracked: int = MAX_TRACKED,
        bootstrap_port: int | None = None,
        on_dead: Any = None,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ) -> None:
        self.shutdown_grace_s = shutdown_grace_s
        self._on_dead = on_dead  # (rank) -> None: the instance stream clears the rank
        self.procs = procs  # dp rank -> its scheduler processes (multiprocessing.Process)
        self.bootstrap_port = bootstrap_port  # a PD prefill's; None elsewhere
        self._send_abort = send_abort  # (rid, http_worker_ipc, message) -> None
        self._lock = threading.Lock()
        self._sent: dict[int, collections.OrderedDict[str, _Sent]] = {r: collections.OrderedDict() for r in procs}
        self.max_tracked = max_tracked
        self.dead: dict[int, str] = {}  # rank -> cause
        self._applied: set[int] = set()
        self.aborted_in_flight = 0
        self.refused = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the controller's thread

    def sent(self, rank: int, req: Any) -> None:
        """Remembers a request sent to ``rank`` (bounded: the oldest is forgotten)."""
        rid = getattr(req, "rid", None)
        if rid is None:
            return
        entry = _Sent(getattr(req, "http_worker_ipc", None), _pd_room(req, self.bootstrap_port))
        with self._lock:
            late = rank in self.dead  # died between this request's check and its send
            tracked = self._sent.get(rank)
            if tracked is not None and not late:
                tracked[rid] = entry
                if len(tracked) > self.max_tracked:
                    tracked.popitem(last=False)
        if late:
            self._end([(rid, entry)], self._message(rank))

    def before_dispatch(self, controller: Any, req: Any) -> bool:
        """On the controller's thread, before a request is routed: applies deaths to SGLang's
        ``status`` and ends a request that names a dead rank.  True: the request was ended."""
        if not self.dead:
            return False
        with self._lock:
            new = [r for r in self.dead if r not in self._applied]
            self._applied.update(new)
        for rank in new:
            if rank < len(controller.status):
                controller.status[rank] = False
        routed = getattr(req, "routed_dp_rank", None)
        if routed is None or routed not in self.dead:
            return False
        message = self._message(routed)
        self._send_abort(req.rid, getattr(req, "http_worker_ipc", None), message)
        with self._lock:
            self.refused += 1
        return True

    # ------------------------------------------------------------------ the watch thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpub-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        parent = os.getppid()
        by_sentinel = {p.sentinel: (rank, p) for rank, ps in self.procs.items() for p in ps}
        while by_sentinel:
            for sentinel in wait(list(by_sentinel)):
                rank, proc = by_sentinel.pop(sentinel)
                proc.join(5.0)  # its sentinel fired: the exit status follows at once
                # A whole instance stopping ends its schedulers too, this process and its
                # parent a moment later: no rank death to report then.
                threading.Event().wait(self.shutdown_grace_s)
                if os.getppid() != parent:
                    log.info("sglang_kvpub: DP rank %d's scheduler ended with the instance", rank)
                    return
                self.rank_died(rank, f"its scheduler process {proc.pid} exited with code {proc.exitcode}")

    def rank_died(self, rank: int, cause: str) -> None:
        with self._lock:
            if rank in self.dead:
                return
            self.dead[rank] = cause
            in_flight = list(self._sent.get(rank, {}).items())
            self._sent[rank] = collections.OrderedDict()
        ended = self._end(in_flight, self._message(rank))
        if self._on_dead is not None:
            try:
                self._on_dead(rank)
            except Exception as exc:
                log.warning("sglang_kvpub: clearing dead DP rank %d on the instance stream: %r", rank, exc)
        log.error(
            "sglang_kvpub: DP rank %d is dead (%s): no more requests are dispatched to it, and the "
            "%d requests sent to it that may still be in flight were ended with HTTP 503 (logged once "
            "per rank); restart the instance to serve on %d ranks again.  rank watch %s",
            rank,
            cause,
            ended,
            len(self.procs),
            json.dumps(self.stats(), sort_keys=True),
        )

    def _end(self, requests: list[tuple[str, _Sent]], message: str) -> int:
        """Ends each request (its client gets a 503 with ``message``) and, for a PD prefill
        request, registers its room with ``FAILED_RANK`` so that a decode still asking for
        the room's rank fails it too (pd_register.py)."""
        ended = 0
        for rid, sent in requests:
            try:
                self._send_abort(rid, sent.route, message)
                ended += 1
                if sent.room is not None:
                    from sglang_kvpub.engine.pd_register import FAILED_RANK, registrar

                    registrar().submit(sent.room[0], sent.room[1], FAILED_RANK, _ignore)
            except Exception as exc:  # never let the watch thread die on one request
                log.warning("sglang_kvpub: ending request %s of a dead DP rank: %r", rid, exc)
        with self._lock:
            self.aborted_in_flight += ended
        return ended

    def _message(self, rank: int) -> str:
        return (
            f"sglang_kvpub: DP rank {rank} of this instance is dead ({self.dead.get(rank, 'gone')}); "
            "the request was ended, send it again"
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ranks": len(self.procs),
                "dead": sorted(self.dead),
                "aborted_in_flight": self.aborted_in_flight,
                "refused": self.refused,
            }


class _Sent(NamedTuple):
    route: Any  # the request's http_worker_ipc (its tokenizer worker), if any
    room: tuple[str, int] | None  # PD: (bootstrap host:port, bootstrap room)


def _pd_room(req: Any, bootstrap_port: Any) -> tuple[str, int] | None:
    """A PD request's bootstrap address as the prefill's sender forms it (the request's host,
    this server's bootstrap port) and its room; None for any other request."""
    host, room = getattr(req, "bootstrap_host", None), getattr(req, "bootstrap_room", None)
    if host is None or bootstrap_port is None or not isinstance(room, int):
        return None
    return f"{host}:{bootstrap_port}", room


def _ignore(message: str) -> None:
    pass  # the request was ended already; the registrar counts and logs the failure


# --------------------------------------------------------------------------- the dispatch hook's calls
# Contained: a failure switches the watch off (guard feature ``rank_watch``); dispatch goes on.


def active(controller: Any) -> RankWatch | None:
    watch: RankWatch | None = getattr(controller, WATCH_ATTR, None)
    if watch is None or guard.disabled(guard.RANK_WATCH):
        return None
    return watch


def ended_here(watch: RankWatch, controller: Any, req: Any) -> bool:
    try:
        return watch.before_dispatch(controller, req)
    except Exception as exc:
        guard.fail(guard.RANK_WATCH, exc)
        return False


def sent(watch: RankWatch, rank: int, req: Any) -> None:
    try:
        watch.sent(rank, req)
    except Exception as exc:
        guard.fail(guard.RANK_WATCH, exc)


_TITLE = re.compile(rb"sglang::scheduler_DP(\d+)")


def _scheduler_procs(controller: Any) -> dict[int, list[Any]]:
    """dp rank -> its scheduler processes (``controller.scheduler_procs``, the
    ``multiprocessing.Process`` objects SGLang 0.5.23 starts).  The rank is read from the
    title each scheduler gives itself before it reports ready (``sglang::scheduler_DP<rank>``,
    with ``_TP<n>`` and others after it): the process objects keep no arguments once started."""
    procs: dict[int, list[Any]] = collections.defaultdict(list)
    for proc in getattr(controller, "scheduler_procs", None) or ():
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                title = _TITLE.search(f.read())
        except OSError:
            continue
        if title is not None and getattr(proc, "sentinel", None) is not None:
            procs[int(title.group(1))].append(proc)
    return dict(procs)


def _abort_sender(controller: Any) -> Any:
    """Sends SGLang's ``AbortReq`` to the tokenizer manager, as a scheduler does (its own
    socket: the watch thread and the controller's thread never share one)."""
    import zmq
    from sglang.srt.managers.io_struct import AbortReq, sock_send

    context: Any = zmq.Context.instance()
    lock = threading.Lock()
    socket: Any = None

    def send(rid: str, http_worker_ipc: Any, message: str) -> None:
        nonlocal socket
        abort = AbortReq(
            rid=rid,
            abort_message=message,
            finished_reason={"type": "abort", "status_code": 503, "message": message},
        )
        if http_worker_ipc is not None:
            abort.http_worker_ipc = http_worker_ipc
        with lock:
            if socket is None:
                socket = context.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 1000)
                socket.setsockopt(zmq.SNDTIMEO, 1000)  # the tokenizer gone too: drop, never block
                socket.connect(controller.port_args.tokenizer_ipc_name)
            sock_send(socket, abort)

    return send


def _stream_clear(fanin: Any) -> Any:
    """The dead rank's blocks cleared on the instance stream: its cache is gone with it.  Fed
    to the fan-in as a new rank epoch whose one batch is ``AllBlocksCleared`` - what the
    fan-in does for a restarted rank - so the router (and the cache-aware dispatch) drops
    the rank's blocks now, not when the instance restarts."""
    if fanin is None:
        return None

    def clear(rank: int) -> None:
        import secrets
        import time

        from sglang_kvpub.wire import AllBlocksCleared, EventBatch

        batch = EventBatch(ts=time.time(), events=[AllBlocksCleared()], dp_rank=rank)
        fanin.ingest(rank, secrets.randbits(64) or 1, 0, batch)

    return clear


def _prefill_bootstrap_port() -> int | None:
    """This server's bootstrap port if it is a PD prefill (SGLang 0.5.23's config bag)."""
    try:
        from sglang.srt.runtime_context import get_disagg

        disagg = get_disagg()
        if disagg.disaggregation_mode != "prefill":
            return None
        return int(disagg.disaggregation_bootstrap_port)
    except Exception:  # another SGLang: no PD notice, the rest of the watch works
        return None


def attach_rank_watch(controller: Any) -> RankWatch | None:
    """Starts the watch on a constructed controller's schedulers (None: nothing to watch,
    e.g. schedulers launched by another process)."""
    procs = _scheduler_procs(controller)
    if not procs:
        log.info("sglang_kvpub: no scheduler processes of this controller to watch; a dead rank goes unnoticed")
        return None
    watch = RankWatch(
        procs,
        _abort_sender(controller),
        bootstrap_port=_prefill_bootstrap_port(),
        on_dead=_stream_clear(getattr(controller, "kvpub_fanin", None)),
    )
    setattr(controller, WATCH_ATTR, watch)
    watch.start()
    log.info("sglang_kvpub: watching the schedulers of DP ranks %s", sorted(procs))
    return watch
