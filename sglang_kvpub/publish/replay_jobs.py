"""Replay replies on one ROUTER, streamed a slice per loop turn: the job machinery both
replay servers share (the instance stream's, :mod:`sglang_kvpub.publish.replay_server`, and
the folded view's, :mod:`sglang_kvpub.publish.folded_view`).

A request ``[b"", start_seq]`` (optionally ``b"snapshot"``) becomes a job: the items of its
reply (``(seq, payload)`` pairs from the server's own source, a replay of the buffer or a
snapshot), framed by the server's reply shape, then the end marker.  Per loop turn each job
sends up to a slice of messages with ``ROUTER_MANDATORY`` and ``NOBLOCK``, so a slow reader
slows only its own reply, never the stream: a message the ROUTER refuses waits for a later
turn, and a reader that takes nothing for ``stall_s`` loses its job.  At most ``max_jobs``
replies run at once; a request beyond that gets the end marker alone (best effort).

Everything runs on the fan-in's thread; the item sources take the fan-in's lock themselves.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import zmq

from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.wire import WireError, parse_replay_request

__all__ = ["Job", "ReplayJobs"]

Items = Iterator[tuple[int, bytes]]
ItemSource = Callable[[int, bool], Items]  # (start_seq, snapshot asked) -> the reply's items
ReplyFrames = Callable[[bytes, int, bytes], list[bytes]]  # (identity, seq, payload) -> frames
EndFrames = Callable[[bytes], list[bytes]]  # identity -> the end marker's frames

MAX_JOBS = 64
STALL_S = 30.0  # a replay client that reads nothing for this long is dropped
SLICE_MESSAGES = 32
_REQUESTS_PER_TURN = 16


class Job:
    """One reply being streamed; ``pending`` is a message the ROUTER refused."""

    def __init__(self, identity: bytes, items: Items) -> None:
        self.identity = identity
        self.items = items
        self.pending: tuple[list[bytes], bool] | None = None
        self.done = False
        self.stalled_since: float | None = None  # when the client stopped reading


class ReplayJobs:
    """The replies in flight on one ROUTER.  ``source(start_seq, snapshot)`` gives a request's
    items; ``reply`` and ``end`` frame them for the server's protocol; ``turn_budget_s``, when
    set, also ends a turn's sending after that long (the instance stream's replies share the
    thread with its live batches)."""

    def __init__(
        self,
        name: str,
        source: ItemSource,
        reply: ReplyFrames,
        end: EndFrames,
        counts: collections.Counter[str],
        rlog: RateLimitedLog,
        *,
        turn_budget_s: float | None = None,
    ) -> None:
        self.name = name
        self.jobs: list[Job] = []
        self._source = source
        self._reply = reply
        self._end = end
        self._counts = counts
        self._rlog = rlog
        self._turn_budget_s = turn_budget_s

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    @property
    def runnable(self) -> bool:
        """A reply can go on now (not every job waits on a slow reader)."""
        return any(job.pending is None for job in self.jobs)

    def drain(self, router: zmq.Socket[bytes]) -> None:
        """Takes the waiting requests (a bounded number per turn) as new jobs."""
        for _ in range(_REQUESTS_PER_TURN):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start_seq, snapshot = parse_replay_request(frames)
            except WireError as exc:
                self._counts["bad_requests"] += 1
                self._rlog.warning("malformed", "kvpub %s: bad replay request: %s", self.name, exc)
                continue
            if len(self.jobs) >= MAX_JOBS:
                self._counts["replays_rejected"] += 1
                with contextlib.suppress(zmq.ZMQError):  # best effort: an empty reply, never queued
                    router.send_multipart(self._end(identity), flags=zmq.NOBLOCK)
                continue
            self.jobs.append(Job(identity, self._source(start_seq, snapshot)))

    def advance(self, router: zmq.Socket[bytes]) -> None:
        """One slice of every job's reply; finished and abandoned jobs leave."""
        budget = self._turn_budget_s
        deadline = None if budget is None else time.monotonic() + budget
        for job in self.jobs:
            for message, is_end in itertools.islice(self._messages(job), SLICE_MESSAGES):
                try:
                    router.send_multipart(message, flags=zmq.NOBLOCK)
                except zmq.Again:
                    job.pending = (message, is_end)  # the client reads slowly: retry on a later turn
                    now = time.monotonic()
                    if job.stalled_since is None:
                        job.stalled_since = now
                    elif now - job.stalled_since > STALL_S:  # it stopped reading: free the slot
                        job.done = True
                        self._counts["replays_abandoned"] += 1
                    break
                except zmq.ZMQError:  # EHOSTUNREACH: the client went away
                    job.done = True
                    break
                job.stalled_since = None
                if is_end:
                    job.done = True
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
        self.jobs = [job for job in self.jobs if not job.done]

    def _messages(self, job: Job) -> Iterator[tuple[list[bytes], bool]]:
        if job.pending is not None:
            pending, job.pending = job.pending, None
            yield pending
            if pending[1]:
                return
        for seq, payload in job.items:
            yield self._reply(job.identity, seq, payload), False
        yield self._end(job.identity), True
