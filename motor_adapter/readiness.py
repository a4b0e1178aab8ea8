"""Readiness: whether this adapter's answers are worth routing on, and if not, why.

``GET /health`` is liveness (the process serves HTTP). ``GET /ready`` is readiness: 200 once the
registry has restored what it stored and every followed stream is connected and caught up;
503 with the reasons otherwise. An answer given before that is not wrong, but it may miss
hits an engine holds (its stream is still replaying or has not been heard), so a load balancer
or an orchestrator should send Motor's queries to a replica only while it is ready.

A plain engine stream (compatibility mode) without a replay endpoint sends no heartbeats and
nothing to sync at start: an idle one and a dead one look alike, so it never holds readiness up
(it is listed as unverifiable instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Readiness", "readiness"]


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reasons: list[str] = field(default_factory=list)  # why not ready; empty when ready
    streams: int = 0  # streams followed
    unverifiable: list[str] = field(default_factory=list)  # streams whose liveness cannot be proven

    def body(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "reasons": self.reasons,
            "streams": self.streams,
            "unverifiable_streams": self.unverifiable,
        }


def readiness(registry_status: Mapping[str, Any], restored: bool, health: Mapping[Any, Sequence[Any]]) -> Readiness:
    """``registry_status``: ``DurableRegistrations.status()``; ``restored``: its start-up restore
    has finished; ``health``: ``AdapterState.stream_health()`` (stream key -> ``StreamHealth``)."""
    reasons: list[str] = []
    unverifiable: list[str] = []
    if not restored:
        reasons.append(f"registry: restoring {registry_status.get('registrations', 0)} stored registration(s)")
    elif registry_status.get("restoring"):
        reasons.append(f"registry: restoring {registry_status['restoring']} registration(s)")
    streams = 0
    for healths in health.values():
        for h in healths:
            streams += 1
            name = f"stream {h.endpoint} ({h.instance_id}" + (
                ")" if h.dp_rank_override is None else f" rank {h.dp_rank_override})"
            )
            if not h.provable:
                unverifiable.append(name)
            elif not h.connected:
                reasons.append(f"{name}: not connected (nothing heard since the subscription opened)")
            elif h.syncing:
                reasons.append(f"{name}: catching up (a replay or snapshot is running)")
    return Readiness(not reasons, reasons, streams, unverifiable)
