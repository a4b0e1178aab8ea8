"""The fan-in's replay and snapshot server: the ROUTER side of SGLang 0.5.23's replay protocol.

A DEALER sends ``[b"", seq]`` (or ``[b"", seq, b"snapshot"]``); the reply is every buffered
batch from ``seq`` on, or - for a start older than the buffer, from another epoch, or on
request - a snapshot (each rank's residency as stores, all with one seq) and then the
buffered tail; an end marker closes it.  Replies are streamed a slice per loop turn so a
slow client never stalls the live stream.  See docs/wire.md.

:class:`ReplayServer` is the half of :class:`~sglang_kvpub.publish.fanin.FanIn` that
answers these requests; it reads the fan-in's buffer, residency and seq under its lock.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.wire import (
    AllBlocksCleared,
    BatchEncoder,
    Event,
    EventBatch,
    RankOrder,
    WireError,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    seq_epoch,
    tag_payload,
)

__all__ = ["Job", "ReplayServer"]

log = logging.getLogger(__name__)

_MAX_JOBS = 64
_JOB_STALL_S = 30.0  # a replay client that reads nothing for this long is dropped
_SLICE_MESSAGES = 32


class Job:
    """One replay/snapshot reply being streamed; ``pending`` is a message the ROUTER refused."""

    def __init__(self, identity: bytes, items: Iterator[tuple[int, bytes]]) -> None:
        self.identity = identity
        self.items = items
        self.pending: tuple[list[bytes], bool] | None = None
        self.done = False
        self.stalled_since: float | None = None  # when the client stopped reading


class ReplayServer:
    """Replay and snapshot replies, streamed from the fan-in's loop (a mixin of ``FanIn``)."""

    # The fan-in's state this half reads (set by FanIn.__init__).
    dp_size: int
    epoch: int
    snapshot_batch_blocks: int
    _lock: threading.Lock
    _buffer: collections.deque[tuple[int, bytes]]
    _last_seq: int
    _residency: dict[int, RankResidency]
    _orders: dict[int, list[int]]  # dp_rank -> [rank epoch, next seq on the stream]
    _rank_order: bool
    _jobs: list[Job]
    _router: zmq.Socket[bytes] | None
    _topic: bytes
    _encoder: BatchEncoder
    _counts: collections.Counter[str]
    _rlog: RateLimitedLog
    _apply_pending: Callable[[], None]

    def _drain_requests(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(16):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start_seq, snapshot = parse_replay_request(frames)
            except WireError as exc:
                self._counts["bad_requests"] += 1
                self._rlog.warning("malformed", "kvpub fan-in: bad replay request: %s", exc)
                continue
            if len(self._jobs) >= _MAX_JOBS:
                self._counts["replays_rejected"] += 1
                with contextlib.suppress(zmq.ZMQError):  # best effort: an empty reply, never queued
                    router.send_multipart(replay_end_frames(identity), flags=zmq.NOBLOCK)
                continue
            self._jobs.append(Job(identity, self._reply_items(start_seq, snapshot)))

    def _reply_items(self, start_seq: int, snapshot: bool) -> Iterator[tuple[int, bytes]]:
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else self._last_seq + 1
            use_snapshot = snapshot or seq_epoch(start_seq) != self.epoch or start_seq < oldest
            end_seq = self._last_seq
        if use_snapshot:
            self._counts["snapshots_served"] += 1
            return self._snapshot_items()
        self._counts["replays_served"] += 1
        return self._buffered_items(start_seq, end_seq)

    def _buffered_items(self, start_seq: int, end_seq: int) -> Iterator[tuple[int, bytes]]:
        seq = start_seq
        while seq <= end_seq:
            with self._lock:
                if not self._buffer:
                    return
                index = seq - self._buffer[0][0]
                if index < 0:  # rolled out while a slow client read
                    self._counts["replays_truncated"] += 1
                    return
                item = self._buffer[index]
            yield item
            seq += 1

    def _snapshot_items(self) -> Iterator[tuple[int, bytes]]:
        with self._lock:
            self._apply_pending()
            snapshot_seq = self._last_seq
            ranks = sorted(set(range(self.dp_size)) | set(self._residency))
            frozen = {rank: self._residency[rank].copy() for rank in ranks if rank in self._residency}
            # each rank's snapshot states its order: the next live batch of the rank is seq + 1
            orders = {rank: RankOrder(o[0], o[1] - 1, True) for rank, o in self._orders.items()}
        encode = self._encoder.encode

        def tagged(events: list[Event], rank: int) -> bytes:
            payload = encode(EventBatch(ts=time.time(), events=events, dp_rank=rank))
            order = orders.get(rank) if self._rank_order else None
            return payload if order is None else tag_payload(payload, order)

        for rank in ranks:
            residency = frozen.get(rank)
            events: list[Event] = [AllBlocksCleared()]
            blocks = 0
            stored = residency.iter_snapshot_events(max_blocks_per_event=64) if residency else iter(())
            for event in stored:
                events.append(event)
                blocks += len(event.block_hashes)
                if blocks >= self.snapshot_batch_blocks:
                    yield snapshot_seq, tagged(events, rank)
                    events, blocks = [], 0
            if events:
                yield snapshot_seq, tagged(events, rank)
        with self._lock:
            end_seq = self._last_seq
        yield from self._buffered_items(snapshot_seq + 1, end_seq)

    def _advance_jobs(self) -> None:
        router = self._router
        assert router is not None
        deadline = time.monotonic() + 0.001
        for job in self._jobs:
            for message, is_end in itertools.islice(self._job_messages(job), _SLICE_MESSAGES):
                try:
                    router.send_multipart(message, flags=zmq.NOBLOCK)
                except zmq.Again:
                    job.pending = (message, is_end)  # the client reads slowly: retry on a later turn
                    now = time.monotonic()
                    if job.stalled_since is None:
                        job.stalled_since = now
                    elif now - job.stalled_since > _JOB_STALL_S:  # it stopped reading: free the slot
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
                if time.monotonic() > deadline:
                    break
        self._jobs = [job for job in self._jobs if not job.done]

    def _job_messages(self, job: Job) -> Iterator[tuple[list[bytes], bool]]:
        if job.pending is not None:
            pending, job.pending = job.pending, None
            yield pending
            if pending[1]:
                return
        for seq, payload in job.items:
            yield replay_reply_frames(job.identity, self._topic, seq, payload), False
        yield replay_end_frames(job.identity), True
