"""Containment of the plugin's own failures inside SGLang's processes.

Every hook the plugin installs runs inside a scheduler, the DataParallelController or
the HTTP server.  A bug or an unexpected SGLang shape there must never take the engine
down, so each hook belongs to one *feature* and reports its failures here:

- the first failure of a feature is logged once, at ERROR, with its traceback;
- every failure is counted (``stats()``; the fan-in and ``/server_info`` show it);
- the feature is switched off for the rest of the process: its hooks fall back to
  SGLang's own behaviour (``disabled(feature)`` is one set lookup).

One mechanism for every hook, not one ``try`` per hook with its own logging: the hooks
call :func:`fail` in their ``except`` and check :func:`disabled` first.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "FEATURES",
    "STEP",
    "IDLE",
    "RELEASE",
    "RECONCILE",
    "DISPATCH",
    "DESCRIBE",
    "FACTORY",
    "FANIN",
    "PD_REGISTER",
    "RANK_WATCH",
    "disabled",
    "fail",
    "stats",
    "reset",
    "guarded",
]

log = logging.getLogger(__name__)

STEP = "step"  # the rank publisher's publish(), once per scheduler flush
IDLE = "idle"  # the Scheduler.on_idle hook around reconciliation
RELEASE = "release"  # HBM-release hooks on the tree classes and the event recorder
RECONCILE = "reconcile"  # drift check, repair and resync slices
DISPATCH = "dispatch"  # cache-aware dispatch in the DataParallelController
DESCRIBE = "describe"  # the /server_info kv_events block
FACTORY = "factory"  # EventPublisherFactory.create: the rank publisher instead of SGLang's
FANIN = "fanin"  # the fan-in started by the DataParallelController
REASONS = "reasons"  # BlockRemoved.reason given at the recorder's take
PD_REGISTER = "pd_register"  # a PD prefill request's rank registration, off the scheduler thread
RANK_WATCH = "rank_watch"  # the DP controller's watch on its schedulers' liveness
FEATURES = (STEP, IDLE, RELEASE, RECONCILE, DISPATCH, DESCRIBE, FACTORY, FANIN, REASONS, PD_REGISTER, RANK_WATCH)

# What SGLang does once the feature is off (the log line says it).
_FALLBACK = {
    STEP: "batches of this rank are dropped (counted); the engine keeps serving",
    IDLE: "idle-time work stops; the engine keeps serving",
    RELEASE: "SGLang's own release events only (no plugin BlockRemoved)",
    RECONCILE: "no drift repair or resync on this rank",
    DISPATCH: "SGLang's --load-balance-method dispatches every request",
    DESCRIBE: "/server_info shows SGLang's own kv_events block",
    FACTORY: "SGLang's own per-rank publisher (base port + rank) serves this rank",
    FANIN: "no instance stream from this process",
    REASONS: "removals are published without a reason",
    PD_REGISTER: "SGLang registers each PD prefill request's rank itself, on the scheduler thread",
    RANK_WATCH: "a dead DP rank goes unnoticed, as in SGLang: its requests wait until their clients give up",
}

_disabled: set[str] = set()
_failures: collections.Counter[str] = collections.Counter()
_causes: dict[str, str] = {}
_lock = threading.Lock()

T = TypeVar("T")


def disabled(feature: str) -> bool:
    """Whether ``feature`` was switched off by an earlier failure in this process."""
    return feature in _disabled


def fail(feature: str, exc: BaseException) -> None:
    """Records a failure of ``feature``: counted always, logged once, feature switched off."""
    with _lock:
        _failures[feature] += 1
        first = feature not in _disabled
        _disabled.add(feature)
        if first:
            _causes[feature] = f"{type(exc).__name__}: {exc}"
    if first:
        log.error(
            "sglang_kvpub: %s hook failed (%s: %s); %s disabled for this process: %s",
            feature,
            type(exc).__name__,
            exc,
            feature,
            _FALLBACK.get(feature, "SGLang's own behaviour"),
            exc_info=exc,
        )


def stats() -> dict[str, Any]:
    """``{"failures": {feature: n}, "disabled": [...], "causes": {feature: "Type: message"}}``."""
    with _lock:
        return {
            "failures": {feature: _failures.get(feature, 0) for feature in FEATURES},
            "disabled": sorted(_disabled),
            "causes": dict(_causes),
        }


def reset() -> None:
    """Re-enables every feature (tests)."""
    with _lock:
        _disabled.clear()
        _failures.clear()
        _causes.clear()


def guarded(feature: str, fallback: Callable[..., T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator for plugin code that has a safe fallback with the same arguments.

    Disabled or failing: ``fallback(*args, **kwargs)`` answers instead.  Only for code
    that has not yet called SGLang's original (AROUND hooks guard their own part and
    call the original once, outside the guarded part).
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        def guarded_fn(*args: Any, **kwargs: Any) -> T:
            if feature in _disabled:
                return fallback(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                fail(feature, exc)
                return fallback(*args, **kwargs)

        guarded_fn.__name__ = getattr(fn, "__name__", "guarded")
        guarded_fn.__qualname__ = getattr(fn, "__qualname__", "guarded")
        guarded_fn.__doc__ = fn.__doc__
        guarded_fn.__wrapped__ = fn  # type: ignore[attr-defined]
        return guarded_fn

    return wrap
