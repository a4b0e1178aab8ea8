"""The per-rank publisher: takes SGLang's batches and hands them to the fan-in.

One per scheduler rank process, a drop-in for SGLang's publisher interface
(``publish(batch)``, ``shutdown()``).  ``publish`` never blocks and does no I/O: it
stamps the batch with the next rank sequence number and appends it to a bounded queue
(a deque under a lock; a few hundred nanoseconds) and wakes the worker only if it sleeps
(one C-level ``SimpleQueue`` token, no Python condition variable).  A daemon thread converts foreign
batches (SGLang's own ``KVEventBatch`` structs) to :class:`wire.EventBatch`, enriches
(dp_rank, medium, block_size, hash form), encodes and PUSHes with ``NOBLOCK``.

When the queue is full the configured ``full_policy`` applies: ``drop_oldest`` (default:
the newest events describe the current cache best) or ``drop_newest``.  Either way the
drop is counted and, because the sequence number was already assigned, the fan-in sees a
gap in this rank's sequence.  A PUSH that would block (fan-in gone, HWM reached) is
dropped and counted the same way.  Each publisher picks a random 64-bit rank epoch at
start so the fan-in recognises a restarted rank.  When idle, the thread sends a rank
heartbeat (empty payload) every ``heartbeat_s`` so the fan-in can report dead ranks.
"""

from __future__ import annotations

import collections
import contextlib
import logging
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
        self._wake: SimpleQueue[None] = SimpleQueue()
        self._idle = False  # the worker waits for a token: the next publish() sends one
        self._stopping = False
        self._lock = threading.Lock()  # publish() callers; the worker only before it sleeps
        self._next_seq = 0
        self._published = 0
        self._queue_dropped = 0
        self._encode_errors = 0
        self._encoder = BatchEncoder(config.event_encoding)
        self._foreign_encoder = msgspec.msgpack.Encoder()
        self._decoder = BatchDecoder()
        self._pusher = ChannelPusher(channel_endpoint, config.hwm, context)
        self._thread = threading.Thread(target=self._run, name=f"kvpub-rank{dp_rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def publish(self, batch: Any) -> None:
        """Queue one batch; never blocks (see module doc for the full-queue policy)."""
        with self._lock:
            if self._stopping:
                return
            seq = self._next_seq
            self._next_seq += 1
            self._published += 1
            queue = self._queue
            wake, self._idle = self._idle, False
            if len(queue) >= self._limit:
                self._queue_dropped += 1
                if not self._drop_oldest:
                    if wake:
                        self._wake.put(None)
                    return
                queue.popleft()
            queue.append((seq, batch))
        if wake:
            self._wake.put(None)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded by ``timeout_s``), then close the socket."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake.put(None)
        self._thread.join(timeout_s)
        self._pusher.close(linger_ms=int(timeout_s * 1000))

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

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        heartbeat = self.config.heartbeat_s
        next_beat = time.monotonic() + heartbeat
        while True:
            sent_any = self._drain()
            now = time.monotonic()
            if sent_any:
                next_beat = now + heartbeat
            elif now >= next_beat:
                self._beat()
                next_beat = now + heartbeat
            with self._lock:
                if self._queue:  # published while we drained
                    continue
                if self._stopping:
                    return
                self._idle = True
            with contextlib.suppress(Empty):
                self._wake.get(timeout=max(0.0, next_beat - time.monotonic()))

    def _drain(self) -> bool:
        sent_any = False
        queue = self._queue
        while queue:
            try:
                seq, batch = queue.popleft()
            except IndexError:
                break
            payload = self._payload(batch)
            sent_any = True
            if payload is not None:
                self._pusher.send(self.dp_rank, self.rank_epoch, seq, payload)
        return sent_any

    def _beat(self) -> None:
        with self._lock:
            if self._queue:  # queued batches hold smaller seqs: send them first
                return
            seq = self._next_seq
            self._next_seq += 1
        self._pusher.send(self.dp_rank, self.rank_epoch, seq, b"")

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
