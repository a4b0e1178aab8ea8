"""The per-rank publisher: takes SGLang's batches and hands them to the fan-in.

One per scheduler rank process, a drop-in for SGLang's publisher interface
(``publish(batch)``, ``shutdown()``).  ``publish`` never blocks and does no I/O: it
stamps the batch with the next rank sequence number, appends it to the rank's bounded
queue (a deque under a lock; well under a microsecond) and wakes the sender only if it
sleeps (one C-level ``SimpleQueue`` token, no Python condition variable).

ONE daemon sender thread per process serves every RankPublisher of that process (SGLang
runs one rank per process; tests and benches host several): per wake-up it drains all
queues, converts foreign batches (SGLang's own ``KVEventBatch`` structs) to
:class:`wire.EventBatch`, enriches (dp_rank, medium, block_size, hash form), encodes and
PUSHes with ``NOBLOCK`` on the rank's own channel socket.  One thread instead of one per
rank avoids GIL hand-offs between sender threads; a publish while the sender is busy
costs no wake-up at all.

When a queue is full the configured ``full_policy`` applies: ``drop_oldest`` (default:
the newest events describe the current cache best) or ``drop_newest``.  Either way the
drop is counted and, because the sequence number was already assigned, the fan-in sees a
gap in this rank's sequence.  A PUSH that would block (fan-in gone, HWM reached) is
dropped and counted the same way.  Each publisher picks a random 64-bit rank epoch at
start so the fan-in recognises a restarted rank.  When a rank is idle, the sender sends
a rank heartbeat (empty payload) every ``heartbeat_s`` so the fan-in can report dead ranks.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from queue import Empty, SimpleQueue
from typing import Any

import msgspec
import zmq

from sglang_kvpub.channel import ChannelPusher
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.wire import BatchDecoder, BatchEncoder, EventBatch, WireError, enrich_batch

__all__ = ["RankPublisher"]

log = logging.getLogger(__name__)

_Item = tuple[int, Any]  # (rank_seq, batch)


class RankPublisher:
    def __init__(
        self,
        config: PluginConfig,
        dp_rank: int,
        block_size: int,
        channel_endpoint: str,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.channel_endpoint = channel_endpoint
        self.rank_epoch = secrets.randbits(64) or 1
        self._queue: collections.deque[_Item] = collections.deque()
        self._limit = config.rank_queue_size
        self._drop_oldest = config.full_policy == "drop_oldest"
        self._stopping = False
        self._closed = threading.Event()  # set by the sender once the socket is closed
        self._abandoned = False  # shutdown() gave up waiting: the sender terms the context
        self._linger_ms = 500
        self._next_seq = 0
        self._published = 0
        self._queue_dropped = 0
        self._encode_errors = 0
        self._next_beat = time.monotonic() + config.heartbeat_s  # sender-owned
        self._encoder = BatchEncoder(config.event_encoding)
        self._foreign_encoder = msgspec.msgpack.Encoder()
        self._decoder = BatchDecoder()
        self._pusher = ChannelPusher(channel_endpoint, config.hwm, context)
        self._sender = _Sender.of_process()
        self._lock = self._sender.lock  # one lock: publish() callers and the sender
        self._sender.register(self)

    # ------------------------------------------------------------------ caller side

    def publish(self, batch: Any) -> None:
        """Queue one batch; never blocks (see module doc for the full-queue policy)."""
        sender = self._sender
        with self._lock:
            if self._stopping:
                return
            seq = self._next_seq
            self._next_seq = seq + 1
            self._published += 1
            queue = self._queue
            wake, sender.idle = sender.idle, False
            if len(queue) >= self._limit:
                self._queue_dropped += 1
                if self._drop_oldest:
                    queue.popleft()
                    queue.append((seq, batch))
            else:
                queue.append((seq, batch))
        if wake:
            sender.wake.put(None)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded by ``timeout_s``), then close the socket."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._linger_ms = int(timeout_s * 1000)
        self._sender.wake.put(None)
        if not self._closed.wait(timeout_s):
            with self._lock:
                if not self._closed.is_set():
                    # The sender is stuck (e.g. in a slow batch): it closes us when it comes
                    # back, dropping (and counting) what is still queued, with no linger.
                    self._abandoned = True
                    log.warning("kvpub rank %d: shutdown flush timed out after %.1f s", self.dp_rank, timeout_s)
                    return
        self._pusher.close_context()

    @property
    def stats(self) -> dict[str, int]:
        return {
            "published": self._published,
            "dropped": self._queue_dropped + self._pusher.dropped + self._encode_errors,
            "queue_dropped": self._queue_dropped,
            "send_dropped": self._pusher.dropped,
            "encode_errors": self._encode_errors,
            "sent": self._pusher.sent,
            "queue_depth": len(self._queue),
            "rank_seq": self._next_seq - 1,
            "rank_epoch": self.rank_epoch,
        }

    # ------------------------------------------------------------------ sender side

    def _drain(self, now: float) -> None:
        """Sends what is queued now (one item at a time: the bound applies until sent;
        later arrivals wait for the next round, so no rank starves the others)."""
        queue = self._queue
        if not queue:
            return
        pusher, rank, epoch = self._pusher, self.dp_rank, self.rank_epoch
        for _ in range(len(queue)):
            try:
                seq, batch = queue.popleft()
            except IndexError:  # dropped by drop_oldest meanwhile
                break
            payload = self._payload(batch)
            if payload is not None:
                pusher.send(rank, epoch, seq, payload)
        self._next_beat = now + self.config.heartbeat_s

    def _beat(self, now: float) -> None:
        """Under the lock, queue empty: an idle rank's heartbeat takes the next seq."""
        seq = self._next_seq
        self._next_seq = seq + 1
        self._pusher.send(self.dp_rank, self.rank_epoch, seq, b"")
        self._next_beat = now + self.config.heartbeat_s

    def _close(self) -> None:
        """Under the lock, sender thread only (it owns the socket); the caller of shutdown()
        terms the context unless it has given up waiting."""
        self._queue_dropped += len(self._queue)
        self._queue.clear()
        if self._abandoned:
            self._pusher.close_socket(0)
            self._pusher.close_context()
        else:
            self._pusher.close_socket(self._linger_ms)
        self._closed.set()

    def _payload(self, batch: Any) -> bytes | None:
        try:
            if not isinstance(batch, EventBatch):
                batch = self._decoder.decode(self._foreign_encoder.encode(batch))
            enrich_batch(batch, dp_rank=self.dp_rank, block_size=self.block_size, hash_form=self.config.hash_form)
            return self._encoder.encode(batch)
        except (WireError, TypeError, ValueError) as exc:
            # The seq stays unused: the fan-in counts a gap for this rank.
            self._encode_errors += 1
            log.warning("kvpub rank %d: dropping a batch that cannot be encoded: %s", self.dp_rank, exc)
            return None


class _Sender:
    """The process's sender thread; it exits when its last publisher is shut down."""

    _current: _Sender | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake: SimpleQueue[None] = SimpleQueue()
        self.idle = False  # the thread waits for a token: the next publish() sends one
        self._publishers: list[RankPublisher] = []
        self._thread: threading.Thread | None = None

    @classmethod
    def of_process(cls) -> _Sender:
        with cls._guard:
            if cls._current is None:
                cls._current = cls()
            return cls._current

    @classmethod
    def _forget(cls) -> None:
        """After fork: the parent's thread does not exist in the child."""
        cls._current = None
        cls._guard = threading.Lock()

    def register(self, publisher: RankPublisher) -> None:
        with self.lock:
            self._publishers.append(publisher)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpub-rank-sender", daemon=True)
                self._thread.start()
            else:
                self.idle = False
                self.wake.put(None)  # recompute the heartbeat deadline

    def _run(self) -> None:
        while True:
            for publisher in list(self._publishers):  # snapshot: register() may append
                publisher._drain(time.monotonic())
            with self.lock:
                deadline = self._housekeep(time.monotonic())
                if deadline is None:
                    continue  # published while we drained
                if not self._publishers:
                    self._thread = None
                    return
                self.idle = True
            with contextlib.suppress(Empty):
                self.wake.get(timeout=max(0.0, deadline - time.monotonic()))
            self.idle = False

    def _housekeep(self, now: float) -> float | None:
        """Under the lock: heartbeats, closes; the next deadline, or None when work is queued."""
        deadline = now + 3600.0
        busy = False
        for publisher in list(self._publishers):
            if publisher._queue:
                busy = True
            elif publisher._stopping:
                self._publishers.remove(publisher)
                publisher._close()
            else:
                if now >= publisher._next_beat:
                    publisher._beat(now)
                deadline = min(deadline, publisher._next_beat)
        return None if busy else deadline


os.register_at_fork(after_in_child=_Sender._forget)
