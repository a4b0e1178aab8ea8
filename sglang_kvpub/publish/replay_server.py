"""The fan-in's replay and snapshot server: the ROUTER side of SGLang 0.5.23's replay protocol.

A DEALER sends ``[b"", seq]`` (or ``[b"", seq, b"snapshot"]``); the reply is every buffered
batch from ``seq`` on, or - for a start older than the buffer, from another epoch, or on
request - a snapshot (each rank's residency as stores, all with one seq) and then the
buffered tail; an end marker closes it.  Replies are streamed a slice per loop turn so a
slow client never stalls the live stream (:class:`~sglang_kvpub.publish.replay_jobs.ReplayJobs`,
shared with the folded view's replay).  See docs/wire.md.

:class:`ReplayServer` is the half of :class:`~sglang_kvpub.publish.fanin.FanIn` that
answers these requests: the items of each reply, read from the fan-in's buffer, residency
and seq under its lock, in the four-frame reply shape of SGLang 0.5.23.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.publish.replay_jobs import ReplayJobs
from sglang_kvpub.wire import (
    AllBlocksCleared,
    BatchEncoder,
    Event,
    EventBatch,
    RankOrder,
    replay_end_frames,
    replay_reply_frames,
    seq_epoch,
    tag_payload,
)

__all__ = ["ReplayServer"]

_TURN_BUDGET_S = 0.001  # replies share the fan-in's thread with the live batches


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
    _topic: bytes
    _encoder: BatchEncoder
    _counts: collections.Counter[str]
    _rlog: RateLimitedLog
    _apply_pending: Callable[[], None]

    def _replay_jobs(self) -> ReplayJobs:
        """The jobs of this server's ROUTER: replies of :meth:`_reply_items`, four frames each."""
        topic = self._topic

        def reply(identity: bytes, seq: int, payload: bytes) -> list[bytes]:
            return replay_reply_frames(identity, topic, seq, payload)

        return ReplayJobs(
            "fan-in",
            self._reply_items,
            reply,
            replay_end_frames,
            self._counts,
            self._rlog,
            turn_budget_s=_TURN_BUDGET_S,
        )

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
