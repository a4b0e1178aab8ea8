"""Cache-aware dispatch inside SGLang's DataParallelController: the hooks and the fan-in feed.

The policy (:class:`~sglang_kvpub.core.dispatch.CacheAwareDispatcher`) is engine-neutral and
lives in :mod:`sglang_kvpub.core.dispatch`; this module is its SGLang edge (lazy imports, only in
the controller process).  :func:`install_dispatch_hook` registers HookRegistry AROUND hooks on
the controller's round-robin / total-requests / total-tokens methods; they stay inert until
:func:`attach_dispatcher` gives the controller a dispatcher.  Requests with ``routed_dp_rank``
(which also carries the ``X-Data-Parallel-Rank`` header and the deprecated
``data_parallel_rank``) go through SGLang's ``maybe_external_dp_rank_routing`` first,
unchanged.  See docs/dispatch.md.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from sglang_kvpub.core.dispatch import (
    REASON_ERROR,
    REASON_EXPLICIT,
    REASON_NO_TOKENS,
    CacheAwareDispatcher,
    DispatchDecision,
)
from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.engine import guard, rank_watch
from sglang_kvpub.wire import BatchDecoder, EventBatch, WireError

__all__ = [
    "DISPATCH_TARGETS",
    "CONTROLLER_ATTR",
    "LOG_ATTR",
    "DecisionLog",
    "install_dispatch_hook",
    "attach_dispatcher",
    "feed_from_fanin",
]

log = logging.getLogger(__name__)

_DPC = "sglang.srt.managers.data_parallel_controller.DataParallelController"
# The load-agnostic and load-aware policies; FOLLOW_BOOTSTRAP_ROOM is left alone (PD pairing).
DISPATCH_TARGETS = (
    f"{_DPC}.round_robin_scheduler",
    f"{_DPC}.total_requests_scheduler",
    f"{_DPC}.total_tokens_scheduler",
)
# Control messages (aborts among them) go to every rank through this method: an abort ends a
# pending prefix (core/pending.py).
ABORT_TARGET = f"{_DPC}.send_control_message"
CONTROLLER_ATTR = "kvpub_dispatcher"
LOG_ATTR = "kvpub_dispatch_log"
SNAPSHOT_STALE_S = 2.0  # SGLang load snapshots older than this: use our in-flight estimate


# --------------------------------------------------------------------------- fan-in feed


def feed_from_fanin(fanin: Any, dispatcher: CacheAwareDispatcher) -> str:
    """Feeds every rank batch the fan-in forwards to ``dispatcher``; returns how.

    ``"observer"``: the FanIn's :meth:`~sglang_kvpub.publish.fanin.FanIn.add_observer`, which is
    called from the one per-message step every path takes (internal channel of either
    kind, and ``ingest``).  Payloads are decoded once more here (the fan-in forwards them
    undecoded); a rank restart clears the rank.  A batch that does not decode is counted
    and logged; any other failure switches dispatch off (guard.py): SGLang's policy runs.
    """
    trusted = msgspec.msgpack.Decoder(EventBatch)
    decoder = BatchDecoder()
    rlog = RateLimitedLog(log, interval_s=None)

    def on_batch(dp_rank: int, batch_or_payload: EventBatch | bytes) -> None:
        if guard.DISPATCH in guard._disabled:
            return
        try:
            if isinstance(batch_or_payload, EventBatch):
                batch = batch_or_payload
            else:
                try:
                    batch = trusted.decode(batch_or_payload)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    batch = decoder.decode(batch_or_payload)
            dispatcher.observe(batch, dp_rank)
        except WireError as exc:
            rlog.warning("undecodable", "kvpub dispatch: rank %d batch not indexed (%s)", dp_rank, exc)
        except Exception as exc:
            guard.fail(guard.DISPATCH, exc)

    def on_restart(dp_rank: int) -> None:
        if guard.DISPATCH in guard._disabled:
            return
        try:
            dispatcher.rank_restarted(dp_rank)
        except Exception as exc:
            guard.fail(guard.DISPATCH, exc)

    fanin.add_observer(on_batch, on_restart)
    return "observer"


# --------------------------------------------------------------------------- decision log


class DecisionLog:
    """The controller's one line per decision (``DispatchDecision.log_line``), switched by the
    plugin keys ``dispatch_log`` (``debug``, the default: silent at SGLang's usual info level;
    ``info``; ``off``) and ``dispatch_log_every`` (every Nth decision).  Costs one counter and
    one level check per request when quiet."""

    _LEVELS = {"debug": logging.DEBUG, "info": logging.INFO}

    def __init__(self, level: str = "debug", every: int = 1) -> None:
        if level not in (*self._LEVELS, "off"):
            raise ValueError(f"dispatch_log {level!r}: use debug, info or off")
        if every < 1:
            raise ValueError(f"dispatch_log_every {every!r}: use an integer >= 1")
        self.level = self._LEVELS.get(level)
        self.every = every
        self.decisions = 0

    def __call__(self, decision: DispatchDecision, rid: Any) -> None:
        if self.level is None:
            return
        self.decisions += 1
        if (self.every == 1 or self.decisions % self.every == 1) and log.isEnabledFor(self.level):
            log.log(self.level, "%s rid=%s", decision.log_line(), rid)


_DEFAULT_LOG = DecisionLog()


# --------------------------------------------------------------------------- SGLang edge

_installed = False
_install_lock = threading.Lock()


def install_dispatch_hook(registry: Any = None, hook_type: Any = None, *, apply: bool = False) -> list[str]:
    """Registers the AROUND hooks on the controller's dispatch methods (idempotent).

    Call it in the DataParallelController process from the plugin's ``register()`` (it runs
    inside ``load_plugins()``, which applies hooks before the controller is built - the
    controller binds ``self.dispatching`` from a lookup table in ``__init__``).  ``apply``:
    also run ``HookRegistry.apply_hooks()`` (when called after ``load_plugins``).  The
    hooks do nothing until :func:`attach_dispatcher` gives the controller a dispatcher.
    """
    global _installed
    if registry is None or hook_type is None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        registry, hook_type = HookRegistry, HookType
    with _install_lock:
        if not _installed:
            for target in DISPATCH_TARGETS:
                registry.register(target, _dispatch_hook, hook_type.AROUND)
            registry.register(ABORT_TARGET, _control_hook, hook_type.AROUND)
            _installed = True
    if apply:
        registry.apply_hooks()
    return list(DISPATCH_TARGETS)


def attach_dispatcher(
    controller: Any,
    *,
    block_size: int,
    fanin: Any = None,
    decision_log: DecisionLog | None = None,
    **options: Any,
) -> CacheAwareDispatcher:
    """Gives a constructed controller its dispatcher (``options``: CacheAwareDispatcher's
    keywords, the plugin's cost keys among them) and, with ``fanin``, feeds it every rank
    batch.  Call after ``DataParallelController.__init__`` returned, before its event loop."""
    dp_size = max(len(getattr(controller, "workers", ()) or ()), 1)
    dispatcher = CacheAwareDispatcher(dp_size, block_size, **options)
    setattr(controller, LOG_ATTR, decision_log or _DEFAULT_LOG)
    if fanin is not None:
        how = feed_from_fanin(fanin, dispatcher)
    else:
        how = "none (no fan-in in this controller: no cache hits, load only)"
    setattr(controller, CONTROLLER_ATTR, dispatcher)
    p = dispatcher.params
    log.info(
        "sglang_kvpub: cache-aware DP dispatch over %d ranks, block_size %d, feed %s; cost w_npu=%g w_cpu=%g "
        "w_disk=%g prefill_load_scale=%g overlap_credit=%g load_weight=%g hotspot_spread=%s hotspot_relative=%s",
        dp_size,
        block_size,
        how,
        p.w_npu,
        p.w_cpu,
        p.w_disk,
        p.prefill_load_scale,
        p.overlap_credit,
        p.load_weight,
        p.hotspot_spread,
        p.hotspot_relative,
    )
    return dispatcher


def _dispatch_hook(original: Callable[..., Any], self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the controller's policy methods: explicit rank first, then ours.

    SGLang's own calls (explicit-rank routing, the socket send) stay outside the guarded
    part, so their errors are SGLang's as without the plugin; a failure of ours switches
    dispatch off for the process (guard.py) and SGLang's policy sends this request."""
    watch = rank_watch.active(self)  # a dead rank: skipped, and a request naming it ended here
    if watch is not None and rank_watch.ended_here(watch, self, req):
        return None
    dispatcher: CacheAwareDispatcher | None = getattr(self, CONTROLLER_ATTR, None)
    if dispatcher is None or guard.DISPATCH in guard._disabled:
        return original(self, req, *args, **kwargs)
    if self.maybe_external_dp_rank_routing(req):  # SGLang's order: an explicit rank wins
        dispatcher.count(REASON_EXPLICIT)
        if watch is not None:
            rank_watch.sent(watch, req.routed_dp_rank, req)
        return None
    try:
        if getattr(req, "data_parallel_rank", None) is not None:  # pre-migration alias (older structs)
            dispatcher.count(REASON_EXPLICIT)
            rank = None
        else:
            rank = _choose_rank(self, dispatcher, req)
        if rank is not None:
            send, worker = _sock_send(self), self.workers[rank]
    except Exception as exc:
        dispatcher.count(REASON_ERROR)
        guard.fail(guard.DISPATCH, exc)
        rank = None
    if rank is None:
        return original(self, req, *args, **kwargs)
    send(worker, req)
    if watch is not None:
        rank_watch.sent(watch, rank, req)
    return None


_abort_log = RateLimitedLog(log, interval_s=None)
abort_failures = 0  # aborts whose pending prefix could not be dropped (contained, logged once)


def _control_hook(original: Callable[..., Any], self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the controller's control-message broadcast: SGLang's send first, then an
    abort (``AbortReq``) drops the request's pending prefix.  Never raises into SGLang."""
    result = original(self, obj, *args, **kwargs)
    dispatcher: CacheAwareDispatcher | None = getattr(self, CONTROLLER_ATTR, None)
    if dispatcher is None or dispatcher.pending is None or type(obj).__name__ != "AbortReq":
        return result
    try:
        if getattr(obj, "abort_all", False):
            dispatcher.pending.clear("aborted")
        else:
            dispatcher.request_ended(obj.rid)
    except Exception as exc:  # contained: the entry expires (ttl) instead
        global abort_failures
        abort_failures += 1
        _abort_log.warning("abort", "kvpub dispatch: an abort's pending prefix not dropped (%r)", exc)
    return result


def _sock_send(controller: Any) -> Callable[[Any, Any], None]:
    # The controller module's own binding (patched copies included), looked up per call.
    send: Callable[[Any, Any], None] = sys.modules[type(controller).__module__].sock_send
    return send


def _choose_rank(controller: Any, dispatcher: CacheAwareDispatcher, req: Any) -> int | None:
    token_ids = getattr(req, "input_ids", None)
    if token_ids is None:
        dispatcher.count(REASON_NO_TOKENS)
        return None
    loads, budget = _controller_loads(controller, dispatcher)
    candidates = [r for r in controller._active_workers if controller.status[r] and controller.workers[r] is not None]
    lora, rid = getattr(req, "lora_name", None), getattr(req, "rid", None)
    decision = dispatcher.choose(token_ids, loads, candidates=candidates, lora_name=lora, rid=rid)
    # one line per request, in the controller process (not a scheduler), as the plugin config says
    getattr(controller, LOG_ATTR, _DEFAULT_LOG)(decision, getattr(req, "rid", None))
    rank = decision.rank
    if rank is not None:
        # Motor commits isl - matched; a request waiting for a prefill on the rank (pending
        # prefix) as the engine will count it: its pending part too, which the dispatcher's
        # rider credit takes off again (core/pending.py, PendingPrefixes.waits).
        committed = max(0, decision.isl - decision.matched_tokens + decision.pending_tokens)
        dispatcher.inflight.add(rank, committed)
        if rank < len(dispatcher.commits):
            dispatcher.commits[rank].append((time.time(), float(committed)))
        if budget is not None and rank < len(budget.total_requests):
            budget.total_requests[rank] += 1  # SGLang's own speculative +1 (DPBudget.dispatch)
    return rank


_COMMIT_RATE = math.log(2.0) / 2.0  # commits decay with a 2 s half-life, as InflightLoad


def _with_commits(dispatcher: CacheAwareDispatcher, budget: Any) -> list[float]:
    """SGLang's snapshot loads plus our commits made after each rank's snapshot, decaying.

    Not added into SGLang's ``DPBudget``: a commit stays there until the rank's next
    snapshot, and an idle rank may send none - then a cold request's whole prompt kept
    counting against the rank that now holds it, and a repeat went elsewhere."""
    now = time.time()
    loads = list(budget.total_tokens)
    for rank, commits in enumerate(dispatcher.commits):
        if not commits or rank >= len(loads):
            continue
        seen = budget.last_timestamp[rank]
        commits[:] = [c for c in commits if c[0] > seen]  # covered by the snapshot: dropped
        loads[rank] += sum(tokens * math.exp(-_COMMIT_RATE * (now - at)) for at, tokens in commits)
    return loads


def _controller_loads(controller: Any, dispatcher: CacheAwareDispatcher) -> tuple[list[float], Any]:
    """SGLang's token loads (``DPBudget.total_tokens``: KV tokens in use plus queued tokens,
    from the ranks' load snapshots, plus our decaying commits since) when its snapshots are fresh;
    else the dispatcher's decaying in-flight estimate.  Returns (loads, budget or None)."""
    budget = getattr(controller, "dp_budget", None)
    if budget is None:
        return dispatcher.inflight.values(), None
    if not getattr(controller, "refresh_load_budget_on_dispatch", False):
        # Round robin: SGLang does not read loads itself; its reader is throttled (20 ms) and
        # reads shared memory (or drains a non-blocking PULL), so it cannot stall the loop.
        controller.refresh_load_budget()
    newest = max(budget.last_timestamp, default=0.0)
    if newest > 0.0 and time.time() - newest < SNAPSHOT_STALE_S:
        return _with_commits(dispatcher, budget), budget
    return dispatcher.inflight.values(), None
