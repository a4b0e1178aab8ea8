"""The epoch of a fan-in start: new per start, above the last start's, across processes.

Why the clock and not a random draw: a reader that checks the seq only for "last + 1"
(Dynamo's indexer) drops every batch whose seq is lower than the last one it applied, so a
restart drawing a lower epoch would be ignored by it for good; a higher one is a gap it
answers with a replay request, which a new epoch turns into a snapshot.

Why a record beside the clock: a restart can land in the same wall-clock second as the start
before it (a sidecar restarted by its supervisor, a test), in another process.  The last epoch
of each stream endpoint is kept in a small file in the plugin's private directory, so the next
start on that endpoint - in this process or another - goes above it.  Without the directory
(not writable) the record is kept in this process only, and the log says so once.

The count wraps every ``2**23 - 1`` seconds (97 days): the first restart after a wrap is
lower, once.

A record decides nothing once the clock has passed it, a few seconds after its start, so a
start also removes the directory's records untouched for a day (:data:`STALE_RECORD_S`):
endpoints that came and went (ephemeral ports, tests) leave no file behind for good.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path

__all__ = ["EPOCH_LIMIT", "STALE_RECORD_S", "EpochRecord", "start_epoch"]

log = logging.getLogger(__name__)

EPOCH_LIMIT = 1 << 23
_HALF = EPOCH_LIMIT >> 1
STALE_RECORD_S = 86_400.0  # a record older than this is below the clock: removed at a start


def _next_above(clock_epoch: int, last: int) -> int:
    """``clock_epoch``, or ``last + 1`` when ``last`` is not older than it (modulo the wrap)."""
    if clock_epoch <= last < clock_epoch + _HALF:
        return last % (EPOCH_LIMIT - 1) + 1
    return clock_epoch


class EpochRecord:
    """The last epoch drawn for one stream endpoint: a file ``<digest>.epoch`` in ``directory``
    (the file wins: it also holds other processes' starts), or this process's memory when
    ``directory`` is None or the file cannot be read."""

    _memory: dict[str, int] = {}  # per process, by file (or endpoint without a directory): the fallback
    _warned = False

    def __init__(self, endpoint: str, directory: Path | None) -> None:
        self.endpoint = endpoint
        digest = hashlib.sha256(endpoint.encode("utf-8")).hexdigest()[:20]
        self.path = directory / f"{digest}.epoch" if directory is not None else None
        self._key = str(self.path) if self.path is not None else endpoint

    def last(self) -> int:
        remembered = self._memory.get(self._key, 0)
        if self.path is None:
            return remembered
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return remembered
        except OSError as exc:
            self._warn(exc)
            return remembered
        stored = int(text) if text.isdigit() else 0
        if not 0 < stored < EPOCH_LIMIT:
            log.warning("epoch record %s holds %r, not an epoch: ignored", self.path, text[:40])
            return remembered
        return stored

    def store(self, epoch: int) -> None:
        self._memory[self._key] = epoch
        if self.path is None:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(f"{epoch}\n", encoding="ascii")
            os.replace(tmp, self.path)  # whole or not at all: a reader never sees half a number
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._warn(exc)
            return
        self._remove_stale(time.time() - STALE_RECORD_S)

    def _remove_stale(self, cutoff: float) -> None:
        """Removes the other ``*.epoch`` records of this directory last written before ``cutoff``."""
        assert self.path is not None
        try:
            entries = list(os.scandir(self.path.parent))
        except OSError:
            return
        for entry in entries:
            if not entry.name.endswith(".epoch") or entry.name == self.path.name:
                continue
            with contextlib.suppress(OSError):  # another start removing it first is fine
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)

    @classmethod
    def _warn(cls, exc: OSError) -> None:
        if not cls._warned:
            cls._warned = True
            log.warning(
                "epoch record not usable (%s): epochs are kept above the last start's in this process only; "
                "a restart within the same second in another process may reuse an epoch",
                exc,
            )


def start_epoch(record: EpochRecord, now: float | None = None) -> int:
    """The epoch of a fan-in start: the start's wall-clock second, modulo ``2**23 - 1``, plus
    one - and above the last epoch in ``record``."""
    seconds = int(time.time() if now is None else now)
    epoch = _next_above(seconds % (EPOCH_LIMIT - 1) + 1, record.last())
    record.store(epoch)
    return epoch
