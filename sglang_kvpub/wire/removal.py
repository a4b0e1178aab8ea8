"""Why blocks left a medium: the values of ``BlockRemoved.reason`` (docs/wire.md).

The vocabulary follows what is true of the content afterwards, as SGLang's removal call
sites sort themselves: gone for capacity, moved down a tier (still servable from host),
gone from host, cleared with the whole cache, or anything else (a repair, a restart's
bookkeeping).  None on the wire: the publisher did not know.
"""

from __future__ import annotations

from typing import Union

__all__ = [
    "REASON_CAPACITY",
    "REASON_DEMOTED",
    "REASON_HOST_EVICTED",
    "REASON_CLEARED",
    "REASON_OTHER",
    "REMOVAL_REASONS",
    "REASON_UNKNOWN",
    "reason_label",
]

REASON_CAPACITY = "capacity_eviction"  # freed for room: the content is gone
REASON_DEMOTED = "demoted_to_host"  # left the device, kept in host memory (HiCache)
REASON_HOST_EVICTED = "host_eviction"  # left host memory
REASON_CLEARED = "cleared"  # a cache clear (flush, reset, a rank's restart) removed it
REASON_OTHER = "other"  # e.g. a reconciliation repair of a block the engine no longer holds
REMOVAL_REASONS = (REASON_CAPACITY, REASON_DEMOTED, REASON_HOST_EVICTED, REASON_CLEARED, REASON_OTHER)
REASON_UNKNOWN = "unknown"  # a metric label for removals without a reason (never on the wire)


def reason_label(reason: Union[str, None]) -> str:
    """A bounded label for counting: a known reason, else ``unknown`` (never a peer's string)."""
    return reason if reason in REMOVAL_REASONS else REASON_UNKNOWN
