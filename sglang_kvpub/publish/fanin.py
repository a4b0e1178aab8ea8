"""The instance fan-in: every rank's batches on ONE PUB, one seq, replay and snapshot.

One per instance: in SGLang's DataParallelController process, or in the sidecar.

Stream.  Each rank batch becomes exactly one instance batch (ranks never mixed, dp_rank
set, per-rank order kept) with ``seq = wire.make_seq(epoch, n)``: ``epoch`` in
``[1, 2**23)`` is new per start and above the last start's (:mod:`sglang_kvpub.publish.epoch`), ``n``
counts 0, 1, 2, ... without holes.  Every ``heartbeat_s``
an empty batch (``dp_rank`` None) goes out too; heartbeats take seqs and sit in the
replay buffer like any batch, so seqs stay contiguous.  The first heartbeat is sent at
``start()``, so a snapshot always has a seq to refer to.

Ranks.  Batches arrive on the internal channel (:mod:`sglang_kvpub.transport.channel`) or through
:meth:`FanIn.ingest` (the sidecar).  Per rank the fan-in checks ``rank_seq``: a jump is a
gap (counted, logged), an old seq a duplicate (counted, dropped).  A new ``rank_epoch``
is a restarted rank: the fan-in emits ``AllBlocksCleared`` for that rank first, so
subscribers drop its stale blocks.  A rank silent (not even rank heartbeats) for
``rank_timeout_s`` is reported dead in the log and ``stats()``; the stream keeps serving
the others.

Views.  With ``folded_endpoint`` set, every forwarded rank batch is also folded into the
instance-level view on its own PUB (:mod:`sglang_kvpub.publish.folded_view`), after the
instance stream sent it; with ``rank_order`` each rank batch carries its rank's (epoch, seq)
(``wire.RankOrder``), a rank restart's clear opening the new epoch at 0.

Rank loads.  With a load source (:meth:`FanIn.set_load_source`: the DP controller's view of
every rank's load, wired by the plugin), every ``load_report_s`` the fan-in thread sends a
``wire.LoadReport`` - a heartbeat-shaped message ``[ts, [], nil, RankLoads]`` with a seq like
any other - when the figures changed since the last one, and unchanged ones every
``heartbeat_s``.  Consumers that do not know it read
a heartbeat.  Off the scheduler's path: the source reads figures the controller already
holds.

Replay (SGLang 0.5.23 protocol) on the ROUTER at ``replay_endpoint``: a DEALER sends
``[b"", start_seq]``; it gets ``[b"", topic, seq, payload]`` for every buffered batch
with ``start_seq <= seq <= last seq at request time``, then ``[b"", b"", END_SEQ, b""]``.

Snapshot (beyond upstream): when ``start_seq`` belongs to another epoch (e.g. 0, or a
previous fan-in start), is older than the oldest buffered seq, or the request carries
the fourth frame ``wire.SNAPSHOT_MARKER``, the reply is a snapshot.  Let ``S`` be the seq
of the newest batch already emitted when the snapshot starts: the residency of every rank
as of ``S`` goes out as, per rank (``0..dp_size-1`` and any other rank seen), one batch
``[AllBlocksCleared, BlockStored...]`` followed by more ``[BlockStored...]`` batches
(at most ``snapshot_batch_blocks`` blocks each, parents first), ALL sent with seq ``S``.
Then the buffered tail ``S+1 ..`` (up to the newest seq when the tail starts), then the
end marker.  A subscriber applies the snapshot, then the tail, then live batches with a
seq greater than the last one applied.  If the buffer rolls past the tail while a slow
client reads, the reply ends early; the client sees a seq gap on the live stream and
asks again.

Replies are streamed by the publishing thread in small slices between channel reads,
with ``ROUTER_MANDATORY``: a slow reader slows only its own reply, never the stream.

Thread safety: :meth:`ingest` may be called from any thread; calls are serialised by
one lock and each rank's order is the order of its calls.

Hot path (internal channel): a burst of messages is handled under one lock acquisition.
Each payload from our own rank publishers is decoded only structurally (token ids stay
msgpack bytes, see :class:`~sglang_kvpub.core.residency.RawBatch`) and checked; then the
burst's payloads are published as they are, back to back (one ZMQ I/O-thread wake-up per
burst rather than per batch); then their residency updates are applied - and before
anything else reads residency (snapshot, stats, a rank restart).  Token ids are not
re-validated here: the channel is private to the instance, and every consumer's decoder
checks them.

Why one module over 450 lines: :class:`FanIn`'s loop is the instance's per-message hot path
(one lock acquisition per burst, the channel drain, the publish and the residency update in
one pass); the replay and snapshot half is :mod:`sglang_kvpub.publish.replay_server`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.core.residency import RankResidency, raw_batch_decoder
from sglang_kvpub.publish.epoch import EpochRecord, start_epoch
from sglang_kvpub.publish.folded_view import FoldedStream
from sglang_kvpub.publish.replay_server import ReplayServer
from sglang_kvpub.publish.stream_sockets import bind_replay_router, open_pub
from sglang_kvpub.transport.channel import (
    PACKET_SCHEME,
    ChannelPuller,
    default_channel_endpoint,
    parse_channel_message,
    private_dir,
    resolve_channel_endpoint,
)
from sglang_kvpub.transport.curve import server_keys_from_files, start_authenticator
from sglang_kvpub.transport.packet_channel import PacketListener
from sglang_kvpub.transport.zmq_io import MORE_NOBLOCK, NOBLOCK, recv_frame, send_frame
from sglang_kvpub.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BatchEncoder,
    EventBatch,
    LoadReportCodec,
    RankLoads,
    RankOrder,
    WireError,
    encode_seq,
    enrich_batch,
    make_seq,
    tag_payload,
)

__all__ = ["FanIn", "RankState", "default_channel_endpoint"]

log = logging.getLogger(__name__)

_CHANNEL_BURST = 512
_PUBLISH_RUN = 32  # a long burst is published in runs: its first batches do not wait for the rest


@dataclasses.dataclass
class RankState:
    rank_epoch: int | None = None
    last_rank_seq: int = -1
    batches: int = 0
    gaps: int = 0  # batches missing, summed over all gaps
    gap_events: int = 0
    duplicates: int = 0
    restarts: int = 0
    late_join: bool = False
    last_seen: float = 0.0  # wall clock, for humans
    last_seen_mono: float = 0.0
    alive: bool = False


class FanIn(ReplayServer):
    def __init__(
        self,
        config: PluginConfig,
        dp_size: int,
        *,
        channel_endpoint: str | None = None,
        context: zmq.Context[Any] | None = None,
        listen_channel: bool = True,
        rank_timeout_s: float | None = None,
        snapshot_batch_blocks: int = 256,
    ) -> None:
        self.config = config
        self.dp_size = dp_size
        self.epoch = start_epoch(EpochRecord(config.endpoint, _record_dir()))
        self.channel_endpoint = channel_endpoint or resolve_channel_endpoint(config)
        self.listen_channel = listen_channel
        self.rank_timeout_s = rank_timeout_s if rank_timeout_s is not None else max(3.0 * config.heartbeat_s, 1.0)
        self.snapshot_batch_blocks = max(1, snapshot_batch_blocks)
        self._owns_context = context is None
        self._context = context
        self._topic = config.topic.encode("utf-8")
        self._encoder = BatchEncoder(config.event_encoding)
        self._decoder = BatchDecoder()
        self._trusted = msgspec.msgpack.Decoder(EventBatch)
        self._fast = raw_batch_decoder()
        self._pending: list[tuple[int, list[Any]]] = []  # (dp_rank, events) not yet in residency
        # Observers (the cache-aware dispatcher): every forwarded rank batch, after it is out.
        self._observers: list[tuple[BatchObserver, RestartObserver | None]] = []
        self._observed: list[tuple[int, EventBatch | bytes]] = []
        self._outbox: list[bytes] = []  # payloads of the current burst, not yet published
        self._lock = threading.Lock()
        self._counter = 0
        self._seq_base = make_seq(self.epoch, 0)
        self._last_seq = -1
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._ranks: dict[int, RankState] = {}
        self._residency: dict[int, RankResidency] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._puller: ChannelPuller | None = None
        self._packets: PacketListener | None = None  # the unixpkt:// channel instead of a PULL
        self._next_beat = self._next_liveness = 0.0  # loop timers (monotonic)
        self._load_source: LoadSource | None = None
        self._load_codec = LoadReportCodec()
        self._last_loads: RankLoads | None = None
        self._next_load = self._last_load_sent = 0.0
        self.pub_connects = False  # the PUB connects instead of binding (said in the start line)
        self._auth: Any = None  # ZAP authenticator when curve_authorized_keys is set
        self._rlog = RateLimitedLog(log, interval_s=None)  # first ten, then every thousandth
        self._counts = collections.Counter[str]()
        # Per-rank order on the stream (wire.RankOrder): dp_rank -> [rank epoch, next seq].
        self._orders: dict[int, list[int]] = {}
        self._rank_order = config.rank_order
        folded = config.folded_endpoint is not None
        self._folded = FoldedStream(config, self.epoch, self._lock, self.snapshot_batch_blocks) if folded else None
        self._replies = self._replay_jobs()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Binds (or connects) the sockets in the caller's thread - errors surface here - then
        runs the loop on a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("FanIn already started")
        context = self._context = self._context or zmq.Context()
        config = self.config
        curve = server_keys_from_files(config.curve_secret_key_file, config.curve_public_key_file)
        self._auth = start_authenticator(context, config.curve_authorized_keys) if curve else None
        pub: zmq.Socket[bytes] | None = None
        try:
            pub, self.pub_connects = open_pub(context, config.endpoint, bind=config.bind, hwm=config.hwm, curve=curve)
            if config.replay_endpoint:
                self._router = bind_replay_router(context, config.replay_endpoint, curve)
            if self._folded is not None:
                self._folded.open(context, curve, self._current_residency)
            if self.listen_channel and self.channel_endpoint.startswith(PACKET_SCHEME):
                # Ranks (re)connect once each; the bound keeps a local misbehaving peer small.
                self._packets = PacketListener(self.channel_endpoint, max_connections=max(64, 4 * self.dp_size))
            elif self.listen_channel:
                self._puller = ChannelPuller(self.channel_endpoint, config.hwm, context)
        except (zmq.ZMQError, OSError):
            self._close_sockets(pub)
            raise
        self._pub = pub
        self._heartbeat()
        freeze_host_objects()
        self._thread = threading.Thread(target=self._run, name="kvpub-fanin", daemon=True)
        self._thread.start()
        log.info(
            "kvpub fan-in: epoch %d, PUB %s %s, replay %s, channel %s, dp_size %d",
            self.epoch,
            "CONNECTS to (a subscriber must bind there)" if self.pub_connects else "bound on",
            config.endpoint,
            config.replay_endpoint,
            self.channel_endpoint if self.listen_channel else "-",
            self.dp_size,
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            pub, self._pub = self._pub, None
            self._close_sockets(pub)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._owns_context and self._context is not None:
            self._context.term()
            self._context = None

    def _close_sockets(self, pub: zmq.Socket[bytes] | None) -> None:
        if pub is not None:
            pub.close(linger=0)
        if self._folded is not None:
            self._folded.close()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._puller is not None:
            self._puller.close()
            self._puller = None
        if self._packets is not None:
            self._packets.close()
            self._packets = None

    # ------------------------------------------------------------------ observers

    def add_observer(self, on_batch: BatchObserver, on_restart: RestartObserver | None = None) -> None:
        """``on_batch(dp_rank, batch_or_payload)`` for every rank batch the fan-in forwards -
        from the internal channel (either kind) or :meth:`ingest` alike: it is called from
        the one per-message step (:meth:`_forward`), after the batch is published.  The
        payload is the instance-tagged bytes as published (or the EventBatch given to
        ``ingest``).  ``on_restart(dp_rank)`` when a rank comes back with a new epoch,
        after its old batches.  Called on the fan-in thread; exceptions are counted
        (``observer_errors``), never raised into the loop."""
        with self._lock:
            self._observers.append((on_batch, on_restart))

    def _notify(self) -> None:
        """Under the lock: hands the observed batches to the observers, in arrival order."""
        observed, self._observed = self._observed, []
        for dp_rank, item in observed:
            for on_batch, _ in self._observers:
                try:
                    on_batch(dp_rank, item)
                except Exception as exc:
                    self._counts["observer_errors"] += 1
                    self._rlog.warning("malformed", "kvpub fan-in: observer failed on rank %d: %r", dp_rank, exc)

    def set_load_source(self, source: LoadSource | None) -> None:
        """``source()`` -> the ranks' current :class:`~sglang_kvpub.wire.RankLoads` (or None:
        nothing to say), called on the fan-in thread every ``config.load_report_s`` (0: never).
        A source that raises is switched off (logged once, counted ``load_report_errors``)."""
        self._load_source = source if self.config.load_report_s > 0 else None

    def _report_loads(self, now: float) -> None:
        """Sends the ranks' loads when they changed since the last report (fan-in thread)."""
        self._next_load = now + self.config.load_report_s
        source = self._load_source
        if source is None:
            return
        try:
            loads = source()
        except Exception as exc:  # the engine's figures must never stop the stream
            self._load_source = None
            self._counts["load_report_errors"] += 1
            log.warning("kvpub fan-in: the rank-load source failed (%r); rank-load messages switched off", exc)
            return
        if loads is None or (loads == self._last_loads and now - self._last_load_sent < self.config.heartbeat_s):
            return  # unchanged figures are repeated every heartbeat, so a consumer can tell them fresh
        self._last_loads, self._last_load_sent = loads, now
        payload = self._load_codec.encode(time.time(), loads)
        with self._lock:
            if self._pub is None:
                return
            self._emit(payload)
            self._counts["load_reports"] += 1

    # ------------------------------------------------------------------ ingest

    def ingest(self, dp_rank: int, rank_epoch: int, rank_seq: int, batch_or_payload: EventBatch | bytes) -> None:
        """One rank batch: an :class:`EventBatch` (enriched and encoded here; what the sidecar
        passes after validating foreign engines' payloads) or an encoded payload from a
        :class:`RankPublisher` (forwarded as is when already tagged with this rank; empty =
        rank heartbeat).  Undecodable payloads are counted, logged and skipped.  The batch
        is published first and applied to the rank's residency after, off the latency path.
        """
        with self._lock:
            if self._pub is None:
                return
            self._forward(dp_rank, rank_epoch, rank_seq, batch_or_payload, time.time(), time.monotonic())
            self._publish_outbox()
            self._apply_pending()

    def _forward(
        self,
        dp_rank: int,
        rank_epoch: int,
        rank_seq: int,
        batch_or_payload: EventBatch | bytes,
        wall: float,
        mono: float,
    ) -> None:
        """Under the lock: sequence check, decode; queues the payload for publishing and the
        residency update."""
        if not 0 <= dp_rank < self.dp_size:  # state is kept per rank: never per network-chosen key
            self._counts["malformed"] += 1
            self._rlog.warning(
                "malformed", "kvpub fan-in: dp_rank %d outside dp_size %d; batch dropped", dp_rank, self.dp_size
            )
            return
        if not self._track(dp_rank, rank_epoch, rank_seq, wall, mono):
            return
        if isinstance(batch_or_payload, EventBatch):
            events: list[Any] = batch_or_payload.events
            payload = self._encode(batch_or_payload, dp_rank)
        else:
            if not batch_or_payload:
                return
            decoded = self._decode_rank_payload(dp_rank, batch_or_payload)
            if decoded is None:
                return
            events, payload = decoded
        if self._rank_order:
            payload = self._tag_order(dp_rank, rank_epoch, payload)
        self._outbox.append(payload)
        if events:
            self._pending.append((dp_rank, events))
            if self._observers:
                observed = batch_or_payload if isinstance(batch_or_payload, EventBatch) else payload
                self._observed.append((dp_rank, observed))

    def _apply_pending(self) -> None:
        """Under the lock: applies queued batches to the ranks' residency, in arrival order,
        then hands them to the observers."""
        if self._observed:
            self._notify()
        pending = self._pending
        if pending:
            self._pending = []
            folded = self._folded
            for dp_rank, events in pending:
                if folded is not None:
                    self._fold(folded, dp_rank, events)  # before residency keeps them
                try:
                    self._residency_of(dp_rank).apply_all(events)
                except Exception as exc:  # a rank's bad input must never stop the fan-in loop
                    self._counts["malformed"] += 1
                    self._rlog.warning(
                        "malformed", "kvpub fan-in: rank %d batch not applied to residency: %s", dp_rank, exc
                    )

    def _decode_rank_payload(self, dp_rank: int, payload: bytes) -> tuple[list[Any], bytes] | None:
        """``(events, payload to publish)``, or None for a malformed payload (counted)."""
        # Our rank publishers' payloads, already tagged: a structural decode (token ids stay
        # msgpack bytes) and the payload is forwarded as is.
        try:
            raw = self._fast.decode(payload)
            if raw.dp_rank == dp_rank and raw.tokens_look_valid():
                return raw.events, payload
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        # Untagged, array-encoded or another engine's shape: full decode, tagged here if needed.
        try:
            batch: EventBatch = self._trusted.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            try:
                batch = self._decoder.decode(payload)
            except WireError as exc:
                self._counts["malformed"] += 1
                self._rlog.warning("malformed", "kvpub fan-in: rank %d sent a malformed payload: %s", dp_rank, exc)
                return None
        forwarded = bytes(payload) if batch.dp_rank == dp_rank else self._encode(batch, dp_rank)
        return batch.events, forwarded

    def _encode(self, batch: EventBatch, dp_rank: int) -> bytes:
        enrich_batch(batch, dp_rank=dp_rank, block_size=0, hash_form=self.config.hash_form)
        return self._encoder.encode(batch)

    def _fold(self, folded: FoldedStream, dp_rank: int, events: list[Any]) -> None:
        """Under the lock: the batch's instance-level effect on the folded view."""
        try:
            folded.take(dp_rank, events)
        except Exception as exc:  # the folded view must never stop the instance stream
            self._counts["folded_errors"] += 1
            self._rlog.warning("malformed", "kvpub fan-in: rank %d batch not folded: %r", dp_rank, exc)

    def _tag_order(self, dp_rank: int, rank_epoch: int, payload: bytes) -> bytes:
        """Under the lock: the payload with its rank's next (epoch, seq) on the stream."""
        order = self._orders.get(dp_rank)
        if order is None or order[0] != rank_epoch:
            order = self._orders[dp_rank] = [rank_epoch, 0]
        tagged = tag_payload(payload, RankOrder(rank_epoch, order[1]))
        order[1] += 1
        return tagged

    def _current_residency(self) -> dict[int, RankResidency]:
        """Under the lock: every rank's residency with everything forwarded applied."""
        self._apply_pending()
        return self._residency

    def _residency_of(self, dp_rank: int) -> RankResidency:
        residency = self._residency.get(dp_rank)
        if residency is None:
            residency = self._residency[dp_rank] = RankResidency()
        return residency

    def _track(self, dp_rank: int, rank_epoch: int, rank_seq: int, wall: float, mono: float) -> bool:
        """Updates the rank's sequence state; False for a duplicate to drop."""
        state = self._ranks.get(dp_rank)
        if state is None:
            state = self._ranks[dp_rank] = RankState()
        if state.rank_epoch is None:  # first sight: earlier seqs predate this fan-in
            state.rank_epoch = rank_epoch
            state.late_join = rank_seq != 0
            if state.late_join:
                # The rank's publisher sees this fan-in's connection as a reconnection and
                # re-announces its residency (AllBlocksCleared, then stores) as normal batches.
                log.info(
                    "kvpub fan-in: rank %d joined at rank_seq %d (fan-in started after it); "
                    "expecting a resync (its blocks re-announced) from that rank",
                    dp_rank,
                    rank_seq,
                )
        else:
            if rank_epoch != state.rank_epoch:
                self._restart(dp_rank, state, rank_epoch)
            elif rank_seq <= state.last_rank_seq:
                state.duplicates += 1
                return False
            missing = rank_seq - state.last_rank_seq - 1
            if missing > 0:
                state.gaps += missing
                state.gap_events += 1
                self._rlog.warning(
                    "gap", "kvpub fan-in: rank %d lost %d batch(es) before rank_seq %d", dp_rank, missing, rank_seq
                )
        state.last_rank_seq = rank_seq
        state.batches += 1
        state.last_seen = wall
        state.last_seen_mono = mono
        if not state.alive:
            if state.batches > 1:
                log.warning("kvpub fan-in: rank %d is back", dp_rank)
            state.alive = True
        return True

    def _restart(self, dp_rank: int, state: RankState, rank_epoch: int) -> None:
        """A new rank epoch: the rank's cache is gone; tell subscribers before its new batches."""
        state.restarts += 1
        state.rank_epoch = rank_epoch
        state.last_rank_seq = -1
        log.warning("kvpub fan-in: rank %d restarted (new rank epoch); clearing its blocks", dp_rank)
        self._apply_pending()  # the old epoch's batches first, then the clear
        self._residency_of(dp_rank).clear()
        if self._folded is not None:
            self._folded.drop_rank(dp_rank)
        for _, on_restart in self._observers:
            if on_restart is not None:
                try:
                    on_restart(dp_rank)
                except Exception as exc:
                    self._counts["observer_errors"] += 1
                    self._rlog.warning(
                        "malformed", "kvpub fan-in: observer failed on rank %d restart: %r", dp_rank, exc
                    )
        clear = EventBatch(ts=time.time(), events=[AllBlocksCleared()], dp_rank=dp_rank)
        payload = self._encoder.encode(clear)
        if self._rank_order:  # seq 0 of the new rank epoch
            payload = self._tag_order(dp_rank, rank_epoch, payload)
        self._outbox.append(payload)  # before the new epoch's first batch
        self._counts["rank_restarts"] += 1

    def _publish_outbox(self) -> None:
        """Under the lock: the burst's batches, back to back.  ZMQ wakes its I/O thread when
        a send finds it idle; sends that follow each other closely find it still busy, so a
        burst costs about one wake-up instead of one per batch."""
        outbox = self._outbox
        if outbox:
            self._outbox = []
            for payload in outbox:
                self._emit(payload)

    def _emit(self, payload: bytes) -> int:
        """Publishes one instance batch under the lock; returns its seq."""
        counter = self._counter
        seq = self._seq_base | counter
        self._counter = counter + 1
        self._last_seq = seq
        self._buffer.append((seq, payload))
        pub = self._pub
        assert pub is not None
        try:
            send_frame(pub, self._topic, MORE_NOBLOCK)  # a PUB takes the whole message once the first part is in
            send_frame(pub, encode_seq(seq), MORE_NOBLOCK)
            send_frame(pub, payload, NOBLOCK)
        except zmq.Again:
            self._counts["pub_dropped"] += 1
        return seq

    def _heartbeat(self) -> None:
        with self._lock:
            if self._pub is None:
                return
            self._emit(self._encoder.encode(EventBatch(ts=time.time(), events=[], dp_rank=None)))
            self._counts["heartbeats"] += 1
            if self._folded is not None:
                self._folded.heartbeat()

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._puller is not None:
            poller.register(self._puller.socket, zmq.POLLIN)
        if self._packets is not None:
            poller.register(self._packets.fileno(), zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        folded_router = self._folded.router if self._folded is not None else None
        if folded_router is not None:
            poller.register(folded_router, zmq.POLLIN)
        self._next_beat = self._next_liveness = time.monotonic() + self.config.heartbeat_s
        while not self._stop.is_set():
            try:
                self._turn(poller)
            except Exception:  # a bug must not silently end the instance stream
                self._counts["loop_errors"] += 1
                log.exception("kvpub fan-in: loop turn failed; continuing")
                self._stop.wait(0.01)  # a fault that repeats must not spin a core

    def _turn(self, poller: zmq.Poller) -> None:
        """One wait for input (or the next timer), then everything that is due."""
        now = time.monotonic()
        # Jobs blocked on a slow reader are retried every 10 ms, not spun on.
        replies = self._replies
        folded = self._folded
        folded_replies = folded.replies if folded is not None else None
        next_timer = min(self._next_beat, self._next_load) if self._load_source is not None else self._next_beat
        if replies.busy or (folded_replies is not None and folded_replies.busy):
            runnable = replies.runnable or (folded_replies is not None and folded_replies.runnable)
            wait_s = 0.0 if runnable else min(max(0.0, next_timer - now), 0.01)
        else:
            wait_s = min(max(0.0, next_timer - now), 0.1)
        if poller.sockets:
            ready = dict(poller.poll(int(wait_s * 1000)))
        else:
            self._stop.wait(wait_s)
            ready = {}
        if self._puller is not None and self._puller.socket in ready:
            self._drain_channel(self._puller.socket)
        if self._packets is not None and ready:
            self._drain_packets(self._packets, poller, ready)
        for router, jobs in ((self._router, replies), (folded.router if folded else None, folded_replies)):
            if router is not None and jobs is not None:
                if router in ready:
                    jobs.drain(router)
                if jobs.busy:
                    jobs.advance(router)
        now = time.monotonic()
        if self._load_source is not None and now >= self._next_load:
            self._report_loads(now)
        if now >= self._next_beat:
            self._heartbeat()
            self._next_beat = now + self.config.heartbeat_s
        if now >= self._next_liveness:
            self._check_liveness(now)
            self._next_liveness = now + self.config.heartbeat_s

    def _drain_channel(self, socket: zmq.Socket[bytes]) -> None:
        """Up to one burst under one lock: the batches published in runs of up to
        ``_PUBLISH_RUN``, the residency updated once the burst is out."""
        wall, mono = time.time(), time.monotonic()
        with self._lock:
            if self._pub is None:
                return
            for _ in range(_CHANNEL_BURST):
                try:
                    message = recv_frame(socket, NOBLOCK)
                except zmq.Again:
                    break
                if not self._take(message, wall, mono):
                    _discard_rest(socket)  # a foreign multipart message counts once
            self._publish_outbox()
            self._apply_pending()

    def _drain_packets(self, packets: PacketListener, poller: zmq.Poller, ready: dict[Any, int]) -> None:
        """The unixpkt:// channel: new rank connections, then each ready connection's
        messages (up to one burst each) under one lock, as :meth:`_drain_channel`."""
        listener = packets.fileno()
        if listener in ready:
            for fd in packets.accept():
                poller.register(fd, zmq.POLLIN)
        wall, mono = time.time(), time.monotonic()
        with self._lock:
            if self._pub is None:
                return
            for fd in ready:
                if fd == listener or fd not in packets.connections:
                    continue
                messages, closed = packets.read(fd, _CHANNEL_BURST)
                if closed:
                    poller.unregister(fd)
                for message in messages:
                    self._take(message, wall, mono)
            self._publish_outbox()
            self._apply_pending()

    def _take(self, message: bytes | WireError, wall: float, mono: float) -> bool:
        """Under the lock: one channel message (or the error of a bad packet) into the
        burst; a long burst goes out in runs of ``_PUBLISH_RUN``.  False when malformed."""
        try:
            if isinstance(message, WireError):
                raise message
            dp_rank, rank_epoch, rank_seq, payload = parse_channel_message(message)
        except WireError as exc:
            self._counts["malformed"] += 1
            self._rlog.warning("malformed", "kvpub fan-in: malformed internal message: %s", exc)
            return False
        self._forward(dp_rank, rank_epoch, rank_seq, payload, wall, mono)
        if len(self._outbox) >= _PUBLISH_RUN:
            self._publish_outbox()
        return True

    def _check_liveness(self, now: float) -> None:
        with self._lock:
            for dp_rank, state in self._ranks.items():
                if state.alive and now - state.last_seen_mono > self.rank_timeout_s:
                    state.alive = False
                    self._counts["rank_silences"] += 1
                    log.warning(
                        "kvpub fan-in: rank %d silent for %.1f s (dead or stuck); serving the other ranks",
                        dp_rank,
                        now - state.last_seen_mono,
                    )

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._apply_pending()
            ranks = {
                rank: {
                    "rank_epoch": state.rank_epoch,
                    "last_rank_seq": state.last_rank_seq,
                    "batches": state.batches,
                    "gaps": state.gaps,
                    "gap_events": state.gap_events,
                    "duplicates": state.duplicates,
                    "restarts": state.restarts,
                    "late_join": state.late_join,
                    "last_seen": state.last_seen,
                    "alive": state.alive,
                    "resident": self._residency[rank].counts() if rank in self._residency else {},
                }
                for rank, state in sorted(self._ranks.items())
            }
            return {
                "epoch": self.epoch,
                "seq": self._last_seq,
                "batches": self._counter,
                "buffered": len(self._buffer),
                "jobs": len(self._replies),
                "channel_connections": len(self._packets.connections) if self._packets is not None else None,
                "channel_refused": self._packets.refused if self._packets is not None else None,
                "never_seen": [r for r in range(self.dp_size) if r not in self._ranks],
                "dead": [r for r, s in self._ranks.items() if not s.alive],
                "ranks": ranks,
                "rank_order": {rank: {"epoch": o[0], "seq": o[1] - 1} for rank, o in sorted(self._orders.items())},
                "folded": self._folded.stats() if self._folded is not None else None,
                **{key: self._counts[key] for key in _COUNTERS},
            }


def _record_dir() -> Path | None:
    """Where the epoch records live: the plugin's private directory, or None (this process's
    memory) when it cannot be made."""
    try:
        return private_dir()
    except OSError as exc:
        log.warning("no private directory for the epoch record (%s): kept in this process only", exc)
        return None


_frozen = [False]  # per process


def freeze_host_objects() -> bool:
    """Once per process, at the first fan-in start: the host process's objects so far (the DP
    controller's or the sidecar's: modules, SGLang's startup state) move to the cyclic GC's
    permanent generation, so a full collection no longer walks them while rank batches wait
    (2-30 ms a pass on the forwarding path, measured in bench/fanin.py; SGLang's own
    ``freeze_gc`` does the same for its scheduler).  Objects made later are collected as
    before.  True when this call froze."""
    if _frozen[0]:
        return False
    _frozen[0] = True
    gc.freeze()
    return True


def _discard_rest(socket: zmq.Socket[bytes]) -> None:
    """The remaining frames of a multipart message (asked only after a bad frame: our
    channel messages are single frames, so the hot path never queries ``RCVMORE``)."""
    with contextlib.suppress(zmq.ZMQError):
        while socket.getsockopt(zmq.RCVMORE):
            socket.recv(zmq.NOBLOCK)


_COUNTERS = (
    "heartbeats",
    "malformed",
    "bad_requests",
    "replays_served",
    "snapshots_served",
    "replays_rejected",
    "replays_abandoned",
    "replays_truncated",
    "rank_restarts",
    "rank_silences",
    "pub_dropped",
    "loop_errors",
    "observer_errors",
    "load_reports",
    "load_report_errors",
    "folded_errors",
)

BatchObserver = Callable[[int, EventBatch | bytes], None]
RestartObserver = Callable[[int], None]
LoadSource = Callable[[], "RankLoads | None"]
