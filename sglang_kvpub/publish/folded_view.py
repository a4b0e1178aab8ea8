"""The folded view's stream: the instance as ONE cache, on its own PUB and replay ROUTER.

For routers that subscribe once per HTTP endpoint and credit every event to one rank
(docs/wire.md, "Which view"): the fan-in hands every rank batch it forwards to
:meth:`FoldedStream.take` (after the instance stream has it), which folds it
(:class:`~sglang_kvpub.core.instance_fold.InstanceFold`) and publishes what changed at
instance level as ``[ts, events, 0]`` - ``dp_rank`` 0, the rank such a router registers.
Heartbeats (``dp_rank`` nil) keep its seq contiguous; rank loads and per-rank order are
not sent here (a strict ``[ts, events, dp_rank]`` reader refuses longer batches).

Seq: ``wire.make_seq(epoch, n)`` with the fan-in's epoch and its own counter.  Replay:
``[b"", start_seq]`` (optionally ``b"snapshot"``) is answered with three-frame replies
``[b"", seq, payload]`` and the end ``[b"", 2**64-1, b""]`` - the vLLM / Motor 3.1 reply
shape (our replay client reads both shapes).  A start older than the buffer, of another
epoch (Motor asks from 0), or a snapshot request: the fold of every rank's residency,
``[AllBlocksCleared, BlockStored...]`` batches all with seq ``S`` (the view's last seq),
then the buffered tail after ``S``.

Everything runs on the fan-in's thread under the fan-in's lock (the caller's), except the
reply streaming (:attr:`FoldedStream.replies`, the job machinery of
:mod:`~sglang_kvpub.publish.replay_jobs` the instance stream's replay uses too, driven by the
fan-in's loop), which reads the buffer under that lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.instance_fold import InstanceFold
from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.publish.replay_jobs import ReplayJobs
from sglang_kvpub.publish.stream_sockets import bind_replay_router, open_pub
from sglang_kvpub.transport.zmq_io import MORE_NOBLOCK, NOBLOCK, send_frame
from sglang_kvpub.wire import (
    END_SEQ_BYTES,
    AllBlocksCleared,
    BatchEncoder,
    Event,
    EventBatch,
    encode_seq,
    make_seq,
    seq_epoch,
)

__all__ = ["FoldedStream", "FOLDED_DP_RANK"]

log = logging.getLogger(__name__)

FOLDED_DP_RANK = 0  # the rank a once-per-endpoint router registers (and reads) for the instance
Residencies = Callable[[], dict[int, RankResidency]]


def _reply_frames(identity: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three-frame reply of vLLM and Motor 3.1 (no topic frame)."""
    return [identity, b"", encode_seq(seq), payload]


def _end_frames(identity: bytes) -> list[bytes]:
    return [identity, b"", END_SEQ_BYTES, b""]


class FoldedStream:
    def __init__(self, config: PluginConfig, epoch: int, lock: threading.Lock, snapshot_batch_blocks: int) -> None:
        assert config.folded_endpoint is not None
        self.endpoint: str = config.folded_endpoint
        self.replay_endpoint = config.folded_replay_endpoint
        self.encoding = config.folded_event_encoding or config.event_encoding
        self.epoch = epoch
        self.fold = InstanceFold()
        self._config = config
        self._lock = lock
        self._snapshot_blocks = max(1, snapshot_batch_blocks)
        self._encoder = BatchEncoder(self.encoding)
        self._topic = config.topic.encode("utf-8")
        self._seq_base = make_seq(epoch, 0)
        self._counter = 0
        self.last_seq = -1
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._pub: zmq.Socket[bytes] | None = None
        self.router: zmq.Socket[bytes] | None = None
        self._residencies: Residencies = dict
        self._rlog = RateLimitedLog(log, interval_s=None)
        self.counts = collections.Counter[str]()
        self.replies = ReplayJobs("folded view", self._reply_items, _reply_frames, _end_frames, self.counts, self._rlog)

    # ------------------------------------------------------------------ sockets

    def open(self, context: zmq.Context[Any], curve: Any, residencies: Residencies) -> None:
        """Binds (or connects) the PUB and binds the ROUTER; ``residencies()`` gives every
        rank's residency, current, for a snapshot (called under the lock)."""
        self._residencies = residencies
        config = self._config
        pub, _ = open_pub(context, self.endpoint, bind=config.bind, hwm=config.hwm, curve=curve)
        try:
            if self.replay_endpoint:
                self.router = bind_replay_router(context, self.replay_endpoint, curve)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        log.info("kvpub folded view: PUB %s, replay %s, %s events", self.endpoint, self.replay_endpoint, self.encoding)

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self.router is not None:
            self.router.close(linger=0)
            self.router = None

    # ------------------------------------------------------------------ publishing (under the lock)

    def take(self, dp_rank: int, events: Iterable[Any]) -> None:
        """One rank batch, as the instance stream carried it: its instance-level effect."""
        self._publish(self.fold.fold(dp_rank, events))

    def drop_rank(self, dp_rank: int) -> None:
        """The rank restarted: what only it held leaves the instance."""
        self._publish(self.fold.drop_rank(dp_rank))

    def heartbeat(self) -> None:
        self._emit(self._encoder.encode(EventBatch(ts=time.time(), events=[], dp_rank=None)))

    def _publish(self, events: list[Event]) -> None:
        if events:
            self.counts["batches"] += 1
            self._emit(self._encoder.encode(EventBatch(ts=time.time(), events=events, dp_rank=FOLDED_DP_RANK)))

    def _emit(self, payload: bytes) -> None:
        pub = self._pub
        if pub is None:
            return
        seq = self._seq_base | self._counter
        self._counter += 1
        self.last_seq = seq
        self._buffer.append((seq, payload))
        try:
            send_frame(pub, self._topic, MORE_NOBLOCK)
            send_frame(pub, encode_seq(seq), MORE_NOBLOCK)
            send_frame(pub, payload, NOBLOCK)
        except zmq.Again:
            self.counts["pub_dropped"] += 1

    # ------------------------------------------------------------------ replay items (fan-in thread)

    def _reply_items(self, start_seq: int, snapshot: bool) -> Iterator[tuple[int, bytes]]:
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else self.last_seq + 1
            use_snapshot = snapshot or seq_epoch(start_seq) != self.epoch or start_seq < oldest
            if not use_snapshot:
                self.counts["replays_served"] += 1
                return self._buffered(start_seq, self.last_seq)
            self.counts["snapshots_served"] += 1
            residencies = self._residencies()
            frozen = {rank: residencies[rank].copy() for rank in sorted(residencies)}
            return self._snapshot(self.last_seq, frozen)

    def _snapshot(self, seq: int, frozen: dict[int, RankResidency]) -> Iterator[tuple[int, bytes]]:
        fold = InstanceFold()  # the union of the ranks, each block once, parents first
        events: list[Event] = [AllBlocksCleared()]
        blocks = 0
        for rank, residency in frozen.items():
            for stored in fold.fold(rank, residency.iter_snapshot_events(max_blocks_per_event=64)):
                events.append(stored)
                blocks += len(getattr(stored, "block_hashes", ()))
                if blocks >= self._snapshot_blocks:
                    yield seq, self._encode(events)
                    events, blocks = [], 0
        if events:
            yield seq, self._encode(events)
        with self._lock:
            end = self.last_seq
        yield from self._buffered(seq + 1, end)

    def _encode(self, events: list[Event]) -> bytes:
        return self._encoder.encode(EventBatch(ts=time.time(), events=events, dp_rank=FOLDED_DP_RANK))

    def _buffered(self, start_seq: int, end_seq: int) -> Iterator[tuple[int, bytes]]:
        seq = start_seq
        while seq <= end_seq:
            with self._lock:
                if not self._buffer:
                    return
                index = seq - self._buffer[0][0]
                if index < 0:
                    self.counts["replays_truncated"] += 1
                    return
                if index >= len(self._buffer):
                    return
                item = self._buffer[index]
            yield item
            seq += 1

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "event_encoding": self.encoding,
            "seq": self.last_seq,
            "blocks": self.fold.counts(),
            "unknown_removals": self.fold.unknown_removals,
            **{key: self.counts[key] for key in _COUNTERS},
        }


_COUNTERS = (
    "batches",
    "pub_dropped",
    "bad_requests",
    "replays_served",
    "snapshots_served",
    "replays_rejected",
    "replays_truncated",
    "replays_abandoned",
)
