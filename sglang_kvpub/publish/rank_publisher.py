"""The per-rank publisher: takes SGLang's batches and hands them to the fan-in.

One per scheduler rank process, a drop-in for SGLang's publisher interface
(``publish(batch)``, ``shutdown()``).  ``publish`` never blocks on I/O.

With ``rank_send = "inline"`` (default) and nothing queued, ``publish`` itself stamps the
batch with the next rank sequence number, enriches (dp_rank, medium, block_size, hash
form), encodes and sends it without blocking - one system call on the default packet
channel, a copy into ZMQ's pipe on a ZMQ channel; tens of microseconds for a scheduler
step's batch.  No thread hand-off: a sender thread would have to win the GIL
from the scheduler's Python loop (up to the 5 ms switch interval) and costs a thread
wake-up per batch.  A batch of more than ``INLINE_MAX_EVENTS`` events (a reconciliation
or resync slice) is queued for the sender thread instead, as is every batch while the
sender thread works through a backlog, and every batch with ``rank_send = "thread"``:
then ``publish`` only appends to the rank's bounded queue (a deque under a lock; well
under a microsecond) and wakes the sender if it sleeps (one C-level ``SimpleQueue``
token).  A ``_sending`` flag, set under the lock, gives the socket to one thread at a
time, and sequence numbers are sent in order: a publish never overtakes queued batches.

ONE daemon sender thread per process serves every RankPublisher of that process (SGLang
runs one rank per process; tests and benches host several): per wake-up it drains the
queues, converts foreign batches (SGLang's own ``KVEventBatch`` structs) to
:class:`wire.EventBatch`, enriches, encodes and PUSHes.  It also sends rank heartbeats,
watches the fan-in connection and closes sockets.  One thread instead of one per rank
avoids GIL hand-offs between sender threads; a publish while the sender is busy costs no
wake-up at all.

When a queue is full the configured ``full_policy`` applies: ``drop_oldest`` (default:
the newest events describe the current cache best) or ``drop_newest``.  Either way the
drop is counted and, because the sequence number was already assigned, the fan-in sees a
gap in this rank's sequence.  A PUSH that would block (fan-in gone, HWM reached) is
dropped and counted the same way.  Each publisher picks a random 64-bit rank epoch at
start so the fan-in recognises a restarted rank.  When a rank is idle, the sender sends
a rank heartbeat (empty payload) every ``heartbeat_s`` so the fan-in can report dead ranks.
On the default single-node channel (``unixpkt://``, :mod:`sglang_kvpub.transport.packet_channel`)
there is no ZMQ at all: the send is one non-blocking system call, and what the socket
cannot take waits in the pusher's ordered backlog (bounded by ``hwm``), which the sender
thread moves on.

Fan-in restarts.  On the packet channel the pusher itself sees the fan-in's end of file
and reconnects; a connection that needs a resync (see :mod:`sglang_kvpub.transport.packet_channel`)
counts in :meth:`PacketPusher.reconnections`.  On ZMQ channels a socket monitor on the
PUSH socket reports each completed connection handshake with the fan-in's PULL: the first
is the normal start; any later one means a new fan-in process (or a broken connection
re-made) that never saw the blocks announced before it.  Either way the publisher then
requests a *resync* - a thread-safe flag (:meth:`RankPublisher.take_resync_request`, and
for the scheduler process :func:`take_resync_request`, which the idle-time reconciliation
reads), a counter in ``stats`` and the optional ``on_resync`` callback.  The sender thread
checks without blocking after each drain and at least every ``_WATCH_S`` while idle.

Why one module over 450 lines: ``publish`` runs in the scheduler on every step; the inline
send, the shared sender thread and the queue it drains are one hand-off protocol (the
``_sending`` flag, sequence order), kept in one module so its invariants are read together.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.transport.channel import PACKET_SCHEME, ChannelPusher
from sglang_kvpub.transport.packet_channel import RETRY_S, PacketPusher
from sglang_kvpub.wire import BatchDecoder, BatchEncoder, EventBatch, WireError, adopt_batch, enrich_batch

__all__ = ["INLINE_MAX_EVENTS", "RankPublisher", "take_resync_request"]

log = logging.getLogger(__name__)

_Item = tuple[int, Any]  # (rank_seq, batch)
# A completed ZMTP handshake: the peer is a live ZMQ socket (libzmq >= 4.3), else a TCP/ipc connect.
_PEER_EVENT = int(getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED))
_WATCH_S = 1.0  # an idle sender reads the monitor at least this often
_BACKLOG_S = 0.001  # how often the sender moves a packet channel's backlog on
# Bigger batches (a reconciliation or resync slice's corrections) go to the sender thread,
# so a step never encodes more than a step's worth of events inline.
INLINE_MAX_EVENTS = 64


# --------------------------------------------------------------------------- resync requests

_resync_lock = threading.Lock()
_resync_pending = False


def take_resync_request() -> bool:
    """True once after any publisher of this process saw its fan-in reconnect (then cleared).

    The scheduler's idle-time reconciliation polls it (one rank per SGLang process)."""
    global _resync_pending
    with _resync_lock:
        pending, _resync_pending = _resync_pending, False
    return pending


def _request_resync() -> None:
    global _resync_pending
    with _resync_lock:
        _resync_pending = True


class _PeerWatch:
    """Counts handshakes of a PUSH socket with its PULL peer (a socket monitor, read NOBLOCK).

    The monitor must exist before the socket connects, or the first handshake could be
    missed and the first *re*connection taken for the normal start: :class:`ChannelPusher`
    connects in its constructor, so it gets its socket from :meth:`socket`, which attaches
    the monitor first."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.context = context
        self.monitor: zmq.Socket[bytes] | None = None
        self.connects = 0

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        """``Context.socket`` for the pusher: the socket comes with its monitor attached."""
        socket: zmq.Socket[bytes] = self.context.socket(kind)
        try:
            self.monitor = socket.get_monitor_socket(_PEER_EVENT)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        return socket

    def reconnections(self) -> int:
        """Handshakes since the last call, not counting the very first one (non-blocking)."""
        fresh = 0
        assert self.monitor is not None
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if parse_monitor_message(frames)["event"] == _PEER_EVENT:
                    fresh += 1
            except (ValueError, KeyError, TypeError):  # not a monitor message: ignore
                continue
        before, self.connects = self.connects, self.connects + fresh
        return fresh - 1 if before == 0 and fresh else fresh

    def close(self, socket: zmq.Socket[bytes]) -> None:
        """Sender thread, before the PUSH socket is closed."""
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        if self.monitor is not None:
            self.monitor.close(linger=0)


class RankPublisher:
    def __init__(
        self,
        config: PluginConfig,
        dp_rank: int,
        block_size: int,
        channel_endpoint: str,
        *,
        context: zmq.Context[Any] | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        """``on_resync``: called from the sender thread once per fan-in reconnection; it must
        be cheap and thread-safe (it may call :meth:`publish`; exceptions are logged)."""
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
        self._close_by = 0.0  # shutdown: the packet channel's backlog is moved on until then
        self._next_seq = 0
        self._published = 0
        self._queue_dropped = 0
        self._encode_errors = 0
        self._send_inline = config.rank_send == "inline"
        self._sending = False  # a thread owns the socket for a send outside the lock
        self._sent_inline = 0
        self._send_errors = 0
        self._resync_requested = False
        self._resyncs = 0
        self._on_resync = on_resync
        self._next_beat = time.monotonic() + config.heartbeat_s  # sender-owned
        self._encoder = BatchEncoder(config.event_encoding)
        self._foreign_encoder = msgspec.msgpack.Encoder()
        self._decoder = BatchDecoder()
        self._packet: PacketPusher | None = None
        self._peer: _PeerWatch | None = None
        self._pusher: ChannelPusher | PacketPusher
        if channel_endpoint.startswith(PACKET_SCHEME):  # no ZMQ here: see packet_channel.py
            self._owns_context = False
            self._context = context
            self._pusher = self._packet = PacketPusher(channel_endpoint, config.hwm)
        else:
            self._owns_context = context is None
            self._context = context or zmq.Context()
            self._peer = _PeerWatch(self._context)
            try:
                # The watch stands in for the context (only ``socket()`` is called): the pusher's
                # socket is monitored before it connects.  The context stays ours to term.
                self._pusher = ChannelPusher(channel_endpoint, config.hwm, cast("zmq.Context[Any]", self._peer))
            except BaseException:
                self._term_context()
                raise
        self._sender = _Sender.of_process()
        self._lock = self._sender.lock  # one lock: publish() callers and the sender
        self._sender.register(self)

    # ------------------------------------------------------------------ caller side

    def publish(self, batch: Any) -> None:
        """Send (inline mode, no backlog) or queue one batch; never blocks on I/O (see the
        module doc for the full-queue policy)."""
        sender = self._sender
        with self._lock:
            if self._stopping:
                return
            seq = self._next_seq
            self._next_seq = seq + 1
            self._published += 1
            queue = self._queue
            inline = (
                self._send_inline
                and not queue
                and not self._sending
                and len(getattr(batch, "events", ())) <= INLINE_MAX_EVENTS
            )
            if inline:
                self._sending = True
            else:
                wake, sender.idle = sender.idle, False
                if len(queue) >= self._limit:
                    self._queue_dropped += 1
                    if self._drop_oldest:
                        queue.popleft()
                        queue.append((seq, batch))
                else:
                    queue.append((seq, batch))
        if inline:
            self._send_now(seq, batch)
        elif wake:
            sender.wake.put(None)

    def _send_now(self, seq: int, batch: Any) -> None:
        """In the caller's thread, which owns the socket (``_sending``) until the end."""
        sender = self._sender
        wake = False
        try:
            payload = self._payload(batch)
            if payload is not None and self._pusher.send(self.dp_rank, self.rank_epoch, seq, payload):
                self._sent_inline += 1
        except Exception:  # never into the scheduler: the seq stays unused, a gap at the fan-in
            self._send_errors += 1
            log.exception("kvpub rank %d: inline send failed; batch dropped", self.dp_rank)
        finally:
            with self._lock:
                self._sending = False
                self._next_beat = time.monotonic() + self.config.heartbeat_s
                # Batches queued meanwhile (another thread), or a shutdown: the sender's turn.
                if (self._queue or self._stopping) and sender.idle:
                    wake, sender.idle = True, False
            if wake:
                sender.wake.put(None)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded by ``timeout_s``), then close the socket."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._linger_ms = int(timeout_s * 1000)
            self._close_by = time.monotonic() + timeout_s
        self._sender.wake.put(None)
        if not self._closed.wait(timeout_s):
            with self._lock:
                if not self._closed.is_set():
                    # The sender is stuck (e.g. in a slow batch): it closes us when it comes
                    # back, dropping (and counting) what is still queued, with no linger.
                    self._abandoned = True
                    log.warning("kvpub rank %d: shutdown flush timed out after %.1f s", self.dp_rank, timeout_s)
                    return
        self._term_context()

    def _term_context(self) -> None:
        """Once the sockets are closed; waits up to the linger for pending frames."""
        if self._owns_context and self._context is not None:
            self._context.term()

    @property
    def resync_requested(self) -> bool:
        """A fan-in reconnection was seen and not yet taken."""
        return self._resync_requested

    def take_resync_request(self) -> bool:
        """True once per pending request (this publisher only; see :func:`take_resync_request`)."""
        with self._lock:
            pending, self._resync_requested = self._resync_requested, False
        return pending

    @property
    def stats(self) -> dict[str, int]:
        return {
            "published": self._published,
            "dropped": self._queue_dropped + self._pusher.dropped + self._encode_errors + self._send_errors,
            "queue_dropped": self._queue_dropped,
            "send_dropped": self._pusher.dropped,
            "encode_errors": self._encode_errors,
            "sent": self._pusher.sent,
            "sent_inline": self._sent_inline,
            "send_errors": self._send_errors,
            "queue_depth": len(self._queue),
            "rank_seq": self._next_seq - 1,
            "rank_epoch": self.rank_epoch,
            "peer_connects": self._connects(),
            "resyncs_requested": self._resyncs,
        }

    # ------------------------------------------------------------------ sender side

    def _drain(self, now: float) -> None:
        """Sends what is queued now (one item at a time: the bound applies until sent;
        later arrivals wait for the next round, so no rank starves the others)."""
        queue = self._queue
        if not queue:
            return
        with self._lock:
            if self._sending:  # a publish() is sending inline; it wakes us when done
                return
            self._sending = True
        try:
            pusher, rank, epoch = self._pusher, self.dp_rank, self.rank_epoch
            for _ in range(len(queue)):
                try:
                    seq, batch = queue.popleft()
                except IndexError:  # dropped by drop_oldest meanwhile
                    break
                payload = self._payload(batch)
                if payload is not None:
                    pusher.send(rank, epoch, seq, payload)
        finally:
            with self._lock:
                self._sending = False
                self._next_beat = now + self.config.heartbeat_s

    def _connects(self) -> int:
        """Completed connections to a fan-in, whichever channel kind."""
        if self._packet is not None:
            return self._packet.connects
        return self._peer.connects if self._peer is not None else 0

    def _reconnections(self) -> int:
        """Sender thread: fan-in connections since the last call that need a resync."""
        packet = self._packet
        if packet is None:
            assert self._peer is not None
            return self._peer.reconnections()
        with self._lock:  # the liveness check uses the socket: own it, or try next time
            if self._sending or self._stopping:
                return 0
            self._sending = True
        try:
            packet.service()
        finally:
            with self._lock:
                self._sending = False
        return packet.reconnections()

    def _service_deadline(self, now: float) -> float:
        """When the sender next services the packet channel: within a millisecond while it
        holds a backlog, at the retry interval while it has no connection."""
        packet = self._packet
        if packet is None:
            return now + _WATCH_S
        if packet.backlog:
            return now + _BACKLOG_S
        return now + (RETRY_S if not packet.connected else _WATCH_S)

    def _backlog_left(self, now: float) -> bool:
        """Under the lock, shutting down: moves the packet channel's backlog on; True while
        some of it is left and the shutdown timeout has not passed."""
        packet = self._packet
        if packet is None or not packet.backlog:
            return False
        packet.flush()
        return bool(packet.backlog) and packet.connected and now < self._close_by

    def _watch(self) -> None:
        """Sender thread, outside the lock (``on_resync`` may publish): fan-in reconnections."""
        if self._closed.is_set():
            return
        count = self._reconnections()
        if not count:
            return
        with self._lock:
            self._resync_requested = True
            self._resyncs += count
        _request_resync()
        log.warning(
            "kvpub rank %d: the fan-in on %s reconnected (a new fan-in?): resync requested",
            self.dp_rank,
            self.channel_endpoint,
        )
        callback = self._on_resync
        if callback is None:
            return
        for _ in range(count):
            try:
                callback()
            except Exception:  # a broken callback must not stop the sender
                log.exception("kvpub rank %d: on_resync callback failed", self.dp_rank)

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
        if self._peer is not None and isinstance(self._pusher, ChannelPusher):
            self._peer.close(self._pusher.socket)
        if self._abandoned:
            self._pusher.close_socket(0)
            self._term_context()
        else:
            self._pusher.close_socket(self._linger_ms)
        self._closed.set()

    def _payload(self, batch: Any) -> bytes | None:
        try:
            if not isinstance(batch, EventBatch):
                # SGLang's own structs: read field by field; the msgpack round trip below
                # (which validates everything) only for what adopt_batch does not know.
                adopted = adopt_batch(
                    batch, dp_rank=self.dp_rank, block_size=self.block_size, hash_form=self.config.hash_form
                )
                if adopted is not None:
                    return self._encoder.encode(adopted)
                batch = self._decoder.decode(self._foreign_encoder.encode(batch))
            enrich_batch(batch, dp_rank=self.dp_rank, block_size=self.block_size, hash_form=self.config.hash_form)
            return self._encoder.encode(batch)
        except (WireError, TypeError, ValueError, OverflowError, msgspec.MsgspecError) as exc:
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
        global _resync_lock, _resync_pending
        cls._current = None
        cls._guard = threading.Lock()
        _resync_lock = threading.Lock()
        _resync_pending = False

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
                try:
                    publisher._drain(time.monotonic())
                    publisher._watch()
                except Exception:  # one rank's failure must not stop every rank of the process
                    log.exception("kvpub rank %d: sender step failed; continuing", publisher.dp_rank)
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
        deadline = now + _WATCH_S
        busy = False
        for publisher in list(self._publishers):
            if publisher._queue and not publisher._sending:
                busy = True
            elif publisher._sending:
                continue  # an inline send owns the socket; it wakes us if anything is left
            elif publisher._stopping:
                if publisher._backlog_left(now):
                    deadline = min(deadline, now + _BACKLOG_S)  # not holding the lock meanwhile
                    continue
                self._publishers.remove(publisher)
                publisher._close()
            else:
                if now >= publisher._next_beat:
                    publisher._beat(now)
                deadline = min(deadline, publisher._next_beat, publisher._service_deadline(now))
        return None if busy else deadline


os.register_at_fork(after_in_child=_Sender._forget)
