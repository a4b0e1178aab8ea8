"""Router-side subscriber of one KV-event stream: the only writer of its slice of the index.

Two kinds of source:

* the **instance stream** of our fan-in: every batch carries ``dp_rank``; ``seq`` is
  ``epoch << 40 | counter`` so a restarted fan-in is recognisable; empty batches are
  heartbeats (about one per second); the replay ROUTER answers snapshots.
* **compatibility mode** (an engine without the plugin): one subscriber per SGLang rank
  port (base+rank) with ``dp_rank_override=rank``; plain SGLang ``seq`` restarts at 0 with
  every publisher start, has no epoch bits and no heartbeats, and its replay ROUTER ignores
  snapshot requests.  Without heartbeats liveness cannot be enforced: such a stream is
  never reconnected by us (ZMQ itself still reconnects the TCP connection), and
  ``connected`` only means that a message (or a replay answer) has arrived since the
  socket was opened.  A plain publisher restarted behind ZMQ's own reconnect is
  recognised by a seq at or below one already seen live, or by a seq that a replay
  gave with other content; one whose first heard seq is beyond everything seen before
  is indistinguishable from a gap (replayed from its buffer, then continued).

Threads: ONE reader thread serves every subscriber of the process
(:mod:`motor_adapter.ingest`): it owns the SUB sockets, reads each readable stream a bounded
number of messages per wake, and applies the batches that simply follow the last one.  Any
other transition (a gap, a restart, the sync at start or after a reconnect) runs the state
machine below on a thread of that stream's own, for as long as it has batches queued, while
the reader keeps reading the stream's live batches into its bounded buffer: a replay endpoint
that stalls delays its own stream only.  Exactly one thread at a time writes a scope (the
whole instance, or one rank in compatibility mode), so its writes stay in seq order.  The
state machine:

* ``seq == last + 1``: apply.  ``seq <= last`` (already applied through a replay): skip.
* ``seq > last + 1``: a gap.  Replay from ``last + 1`` over a DEALER (SGLang 0.5.23
  protocol, 2-frame replies accepted) while live messages are buffered (bounded), then
  apply the buffer.  History gone: rebuild - clear the scope, then a snapshot (or, when
  the endpoint has none, the history it still holds, a subset of the truth).
* a new epoch, or a seq at or below one already seen on this connection (a restarted
  plain publisher): the scope is cleared and rebuilt, never mixed.
* at start and after a reconnect: a snapshot (falling back to a replay of the epoch's
  whole history), so a late or restarted router reaches the engine's state.

Without a replay endpoint a gap or a restart clears the scope and the next batch becomes
the new baseline; this is logged loudly once.

Bounds: the SUB socket queues at most ``rcvhwm`` batches (ZMQ counts messages; the default
1,000 is ~25 MB at the report's ~25 KB batches, ~30 s of a dp-16 instance's traffic) - past
it the fan-in's PUB drops and the stream sees a gap, which its replay fills.  The live buffer
held while a replay runs is bounded by count (``live_buffer``) and bytes
(``live_buffer_bytes``); its drops are counted (``dropped_live``) and are gaps too.

Why one module over 450 lines: :class:`StreamSubscriber` is the state machine above (live,
gap replay, snapshot, reconnect); every transition reads and writes the same seq, buffer and
index state, and the per-message path is the router's hot path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Union

import zmq

from motor_adapter.ingest import IngestReader, shared_reader
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import token_ids_from_msgpack
from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.transport.curve import CurveClientKeys, apply_client, client_keys
from sglang_kvpub.transport.replay import ReplayClient

if TYPE_CHECKING:
    from sglang_kvpub.core.index import PrefixIndex

__all__ = ["StreamHealth", "StreamOptions", "StreamSubscriber"]

log = logging.getLogger(__name__)


class _Item(NamedTuple):
    """A received batch.  ``batch`` None: the seq was readable but the payload was not; it
    still consumes its seq, or the same garbage would be replayed forever.  ``digest``
    tells a late live copy of a replayed batch from a restarted publisher's new batch."""

    seq: int
    batch: Union[wire.EventBatch, None]
    digest: int
    size: int = 0  # payload bytes, for the live buffer's byte bound


@dataclasses.dataclass
class StreamHealth:
    instance_id: str
    endpoint: str
    dp_rank_override: int | None
    connected: bool
    last_seq: int | None
    epoch: int | None
    batches: int  # applied batches, heartbeats included
    events: int
    gaps: int
    replays: int  # gaps filled by a replay
    replayed_batches: int
    snapshots: int  # snapshots applied
    decode_errors: int
    dropped_block_size: int
    restarts: int  # publisher restarts detected (new epoch or seq backwards)
    last_event_age_s: float | None  # since the last batch that carried events
    reconnects: int
    apply_errors: int = 0
    dropped_live: int = 0  # live batches dropped because the buffer was full during a replay
    # Ranks of an instance stream, from its snapshot (the fan-in sends every rank 0..dp_size-1,
    # empty ones included); None: not known (plain engine stream, or no snapshot yet).
    dp_size: int | None = None
    load_reports: int = 0  # rank-load messages received live (wire.LoadReport)
    # A replay or snapshot is running, or live batches wait behind one: not caught up yet.
    syncing: bool = False
    # Whether ``connected`` can prove the stream alive: heartbeats expected, or a replay endpoint
    # that answers the sync at start (a plain engine stream without either looks idle when dead).
    provable: bool = True
    # Blocks removed per (engine dp_rank, wire.reason_label(BlockRemoved.reason)).
    removed: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    # Batches of one engine rank missed live, from the stream's rank order (wire.RankOrder).
    rank_gaps: dict[int, int] = dataclasses.field(default_factory=dict)


_ORDERED = b"\x95"  # a batch of five elements: [ts, events, dp_rank, nil, RankOrder]
_COUNTERS = (
    "batches",
    "events",
    "gaps",
    "replays",
    "replayed_batches",
    "snapshots",
    "decode_errors",
    "dropped_block_size",
    "restarts",
    "reconnects",
)


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """Tuning knobs; the defaults suit the instance stream of our fan-in."""

    liveness_s: float = 5.0
    # None: enforced on the instance stream, not in compatibility mode (plain SGLang sends none).
    expect_heartbeats: bool | None = None
    replay_timeout_s: float = 2.0  # silence allowed between two replay replies
    live_buffer: int = 10_000  # live batches kept while a replay runs
    live_buffer_bytes: int = 64 << 20  # ... and their payload bytes at most
    max_replay_batches: int = 1_000_000
    backoff_min_s: float = 0.1
    backoff_max_s: float = 30.0
    poll_s: float = 0.05  # bounds how long a replay wait takes to see stop()
    # Batches the SUB socket queues (ZMQ counts messages, not bytes): ~25 MB at ~25 KB a batch.
    rcvhwm: int = 1_000
    read_budget: int = 64  # batches read per stream per wake of the reader, so none starves the rest
    # CURVE (docs/security.md): the fan-in's public key (Z85 text or a .key file) turns it on;
    # the client's own pair comes from this NAME.key_secret file, else an ephemeral one.
    curve_server_key: Union[str, None] = None
    curve_client_secret_key_file: Union[str, None] = None


@dataclasses.dataclass
class _Fetch:
    ok: bool  # the end marker arrived
    replies: list[_Item]


class StreamSubscriber:
    """Subscribes to one stream and keeps ``index`` equal to what the publisher holds."""

    def __init__(
        self,
        instance_id: str,
        endpoint: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        dp_rank_override: int | None = None,
        context: zmq.Context[Any] | None = None,
        decode_limits: wire.DecodeLimits | None = None,
        options: StreamOptions | None = None,
        load_sink: Callable[[str, wire.LoadReport], None] | None = None,
    ) -> None:
        """``load_sink(instance_id, report)``: every live rank-load message (wire.LoadReport)."""
        self.instance_id = instance_id
        self._load_sink = load_sink
        self._load_codec = wire.LoadReportCodec()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.dp_rank_override = dp_rank_override
        self.options = options or StreamOptions()
        self._index = index
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = context or zmq.Context()
        self._limits = decode_limits or wire.DecodeLimits()
        self._decoder = wire.BatchDecoder(self._limits, token_ids=token_ids_from_msgpack)  # no int per id
        self._curve: CurveClientKeys | None = None
        if self.options.curve_server_key:
            self._curve = client_keys(self.options.curve_server_key, self.options.curve_client_secret_key_file)
        expect = self.options.expect_heartbeats
        self._expect_heartbeats = (dp_rank_override is None) if expect is None else expect
        self._rlog = RateLimitedLog(log)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._reader: IngestReader | None = None
        self._attached = False  # on the reader (from start() until the reader closed the socket)
        self._closed = threading.Event()
        self._sub: zmq.Socket[bytes] | None = None  # reader thread only
        # The live buffer: the reader appends; whoever runs the state machine pops.
        self._pending: collections.deque[_Item] = collections.deque()
        self._pending_bytes = 0
        self._qlock = threading.Lock()  # guards _pending, _pending_bytes and _worker
        # The thread running the state machine while a transition may block; None: the reader
        # applies in-order batches itself.
        self._worker: threading.Thread | None = None
        # sequence state (thread-owned)
        self._last: int | None = None  # last seq applied
        self._live_high: int | None = None  # highest live seq accepted on this connection
        self._need_sync = False
        self._snapshot_ok: bool | None = None  # None: not known yet
        self._kind_logged = False  # what the registration turned out to be, said once
        self._ranks = wire.RankOrderCheck()  # live batches carrying their rank's order (rank_order on)
        self._ranks_epoch: int | None = None
        self._gap_key: tuple[int, int] | None = None
        self._restarted_by: _Item | None = None
        self._epoch: int | None = None  # epoch of the last applied seq; None after a counted restart
        self._replayed: collections.OrderedDict[int, int] = collections.OrderedDict()  # seq -> payload digest
        self._warned_no_replay = False
        # liveness (thread-owned)
        self._started_at = 0.0
        self._opened_at = 0.0
        self._last_msg: float | None = None
        self._backoff = self.options.backoff_min_s
        self._next_reconnect: float | None = None
        # counters (read by health())
        zero: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        self._c = StreamHealth(
            instance_id, endpoint, dp_rank_override, False, None, None, last_event_age_s=None, **zero
        )
        self._last_event_at: float | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("StreamSubscriber already started")
        self._started_at = time.monotonic()
        self._reader = shared_reader()
        self._attached = True
        self._reader.attach(self)

    def request_stop(self) -> None:
        """Asks the stream to stop without waiting; :meth:`stop` then waits for it."""
        if not self._stop.is_set():
            self._stop.set()
            if self._reader is not None:
                self._reader.detach(self)

    def stop(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        self.request_stop()
        stopped = self._reader is None or self._closed.wait(timeout)
        with self._qlock:
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()))
            stopped = stopped and not worker.is_alive()
        if not stopped:
            log.warning("stream %s: did not stop within %.1f s", self.endpoint, timeout)
            return  # its sockets may still live in the context: do not terminate it
        if self._own_context:
            self._ctx.term()

    def is_alive(self) -> bool:
        """Started and not yet stopped (its socket open, or a sync still running)."""
        with self._qlock:
            worker = self._worker
        return self._attached or (worker is not None and worker.is_alive())

    def health(self) -> StreamHealth:
        with self._cond:
            return self._health_locked()

    def wait_for(self, predicate: Callable[[StreamHealth], bool], timeout: float) -> bool:
        """Waits until ``predicate(health())`` holds; woken by the thread after each step."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if predicate(self._health_locked()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # bounded slices: connected and ages change with time alone
                self._cond.wait(min(remaining, 0.1))

    # ------------------------------------------------------------------ health

    def _health_locked(self) -> StreamHealth:
        now = time.monotonic()
        health = dataclasses.replace(self._c)
        health.removed = dict(self._c.removed)
        health.rank_gaps = dict(self._c.rank_gaps)
        health.connected = self._connected(now)
        health.syncing = self._worker is not None or bool(self._pending)
        health.provable = self._expect_heartbeats or bool(self.replay_endpoint)
        last = self._last
        if last is not None:  # "start of epoch - 1" means nothing of the epoch applied yet
            health.epoch = wire.seq_epoch(last + 1)
            health.last_seq = None if wire.seq_counter(last + 1) == 0 else last
        health.last_event_age_s = None if self._last_event_at is None else now - self._last_event_at
        return health

    def _connected(self, now: float) -> bool:
        if self._sub is None or self._last_msg is None or self._last_msg < self._opened_at:
            return False
        return not self._expect_heartbeats or now - self._last_msg <= self.options.liveness_s

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ on the reader thread

    def _reader_open(self, reader: IngestReader) -> None:
        self._open()
        if self.replay_endpoint:
            self._hand_off(initial=True)
        self._notify()

    def _reader_readable(self) -> bool:
        """Reads a bounded number of batches, then applies what simply follows the last one;
        True when the budget ran out (more may be queued)."""
        if self._sub is None:
            return False
        more = self._read_live(self.options.read_budget) >= self.options.read_budget
        try:
            self._drain_in_order()
        except Exception:  # never let one bad batch stop the stream
            self._rlog.warning("step", "stream %s: unexpected error", self.endpoint)
            log.debug("stream step failed", exc_info=True)
        self._notify()
        return more

    def _reader_tick(self, now: float) -> None:
        with self._qlock:
            busy = self._worker is not None
        if not busy and not self._stop.is_set():
            self._check_liveness()  # during a sync the sync's own deadline decides
        self._notify()  # ``connected`` and the ages change with time alone

    def _reader_close(self) -> None:
        self._close()
        self._attached = False
        self._closed.set()
        self._notify()

    def _drain_in_order(self) -> None:
        """Applies queued batches while each is the next seq; hands the rest to a sync thread."""
        pending = self._pending
        while pending and not self._stop.is_set():
            with self._qlock:
                if self._worker is not None or not pending:
                    return
                item = pending[0]
                last, high = self._last, self._live_high
                if self._need_sync or last is None or item.seq != last + 1 or (high is not None and item.seq <= high):
                    self._start_worker(initial=False)
                    return
                pending.popleft()
                self._pending_bytes -= item.size
            # exactly _process's path for the next seq of the same epoch, without its checks
            self._live_high = item.seq
            self._apply(item.seq, item.batch)

    # ------------------------------------------------------------------ sync thread

    def _hand_off(self, *, initial: bool) -> None:
        with self._qlock:
            if self._worker is None:
                self._start_worker(initial=initial)

    def _start_worker(self, *, initial: bool) -> None:
        """Under ``_qlock``: the state machine moves to a thread that may block on a replay."""
        name = f"kv-sync-{self.instance_id}" + ("" if self.dp_rank_override is None else f"-r{self.dp_rank_override}")
        self._worker = threading.Thread(target=self._work, args=(initial,), name=name, daemon=True)
        self._worker.start()

    def _work(self, initial: bool) -> None:
        try:
            if initial:
                try:
                    self._initial_sync()
                except Exception:
                    log.exception("stream %s: initial sync failed", self.endpoint)
            while not self._stop.is_set():
                try:
                    self._drain()
                except Exception:  # never let one bad step kill the only writer
                    self._rlog.warning("step", "stream %s: unexpected error", self.endpoint)
                    log.debug("stream step failed", exc_info=True)
                    self._stop.wait(self.options.poll_s)
                with self._qlock:
                    if not self._pending:
                        self._worker = None  # back to the reader
                        return
        finally:
            with self._qlock:
                if self._worker is threading.current_thread():
                    self._worker = None
            self._notify()

    # ------------------------------------------------------------------ sockets (reader thread)

    def _open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
        sub.setsockopt(zmq.RECONNECT_IVL, int(self.options.backoff_min_s * 1000))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.options.backoff_max_s * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        apply_client(sub, self._curve)
        sub.connect(self.endpoint)
        self._sub = sub
        if self._reader is not None:
            self._reader.watch(sub, self._reader_readable)
        self._opened_at = time.monotonic()

    def _close(self) -> None:
        if self._sub is not None:
            if self._reader is not None:
                self._reader.unwatch(self._sub)
            self._sub.close(linger=0)
            self._sub = None

    def _check_liveness(self) -> None:
        """Silent past the liveness window: reopen the socket, 100 ms -> 30 s apart."""
        if not self._expect_heartbeats:
            return
        now = time.monotonic()
        heard = self._last_msg if self._last_msg is not None else self._started_at
        if now - heard <= self.options.liveness_s:
            return
        if self._next_reconnect is None:
            self._next_reconnect = now + self._backoff
            # Dead (or cut off): its blocks must not attract requests.  Only the index is
            # cleared; the stream's own state is kept, so a restart is still recognised and
            # the reconnection's sync rebuilds the blocks from the replay snapshot.
            if self.dp_rank_override is None:
                self._index.clear_instance(self.instance_id)
            else:
                self._index.clear_rank(self.instance_id, self.dp_rank_override)
            log.warning(
                "stream %s: silent for %.1f s: instance %s marked dead, its blocks dropped",
                self.endpoint,
                now - heard,
                self.instance_id,
            )
        if now < self._next_reconnect:
            return
        self._rlog.warning("silent", "stream %s: silent for %.1f s, reconnecting", self.endpoint, now - heard)
        self._close()
        self._open()
        self._c.reconnects += 1
        self._backoff = min(self._backoff * 2, self.options.backoff_max_s)
        self._next_reconnect = time.monotonic() + self._backoff
        self._live_high = None  # a new connection: its seqs may start anywhere
        self._need_sync = bool(self.replay_endpoint)

    # ------------------------------------------------------------------ live input

    def _read_live(self, budget: int) -> int:
        """Reads up to ``budget`` messages; how many were read."""
        assert self._sub is not None
        recv = self._sub.recv_multipart
        for count in range(budget):
            try:
                frames = recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return count
            self._receive(frames)
        return budget

    def _receive(self, frames: list[bytes]) -> None:
        self._last_msg = time.monotonic()
        self._backoff = self.options.backoff_min_s
        self._next_reconnect = None
        try:
            _topic, seq, payload = wire.parse_live_frames(frames, self._limits.max_payload_bytes)
        except wire.WireError as exc:
            self._bad_input("live frame", exc)
            return
        batch = self._decode(payload)
        if payload[:1] == _ORDERED and batch is not None:
            self._check_rank_order(seq, payload)
        if self._load_sink is not None and batch is not None and not batch.events and self.dp_rank_override is None:
            self._take_loads(payload)  # live figures only: a replayed report is history
        self._enqueue(_Item(seq, batch, hash(payload), len(payload)))

    def _check_rank_order(self, seq: int, payload: bytes) -> None:
        """A live batch with its rank's order: a batch of that rank missed is a rank gap."""
        epoch = wire.seq_epoch(seq)
        if epoch != self._ranks_epoch:  # a new instance epoch: every rank's order starts again
            self._ranks_epoch = epoch
            self._ranks.reset()
        gap = self._ranks.observe(*wire.read_rank_order(payload))
        if gap is not None:
            with self._cond:
                self._c.rank_gaps[gap.dp_rank] = self._c.rank_gaps.get(gap.dp_rank, 0) + max(gap.missing, 0)
            self._rlog.warning("rank-gap", "stream %s: %s", self.endpoint, gap.describe())

    def _take_loads(self, payload: bytes) -> None:
        """A heartbeat-shaped payload that is a rank-load message: its figures to the sink."""
        try:
            report = self._load_codec.decode(payload)
        except wire.WireError as exc:
            self._bad_input("rank-load message", exc)
            return
        if report is not None and self._load_sink is not None:
            self._c.load_reports += 1
            self._load_sink(self.instance_id, report)

    def _decode(self, payload: bytes) -> wire.EventBatch | None:
        try:
            return self._decoder.decode(payload)
        except wire.WireError as exc:
            self._bad_input("payload", exc)
            return None

    def _bad_input(self, what: str, exc: wire.WireError) -> None:
        with self._cond:  # counted by the reader (live) and by a sync thread (replies)
            self._c.decode_errors += 1
        self._rlog.warning(f"bad:{exc.reason}", "stream %s: skipped a malformed %s: %s", self.endpoint, what, exc)

    def _enqueue(self, item: _Item) -> None:
        with self._qlock:
            pending = self._pending
            while pending and (
                len(pending) >= self.options.live_buffer
                or self._pending_bytes + item.size > self.options.live_buffer_bytes
            ):
                self._pending_bytes -= pending.popleft().size  # the gap this leaves is replayed later
                self._c.dropped_live += 1
                self._rlog.warning("buffer", "stream %s: live buffer full, dropping the oldest batch", self.endpoint)
            pending.append(item)
            self._pending_bytes += item.size

    def _push_front(self, item: _Item) -> None:
        """Puts back the batch being processed: it is looked at again after a sync."""
        with self._qlock:
            self._pending.appendleft(item)
            self._pending_bytes += item.size

    def _drain(self) -> None:
        """Runs the whole state machine over the buffer (on the sync thread; may block)."""
        while not self._stop.is_set():
            with self._qlock:
                if not self._pending:
                    return
                item = self._pending.popleft()
                self._pending_bytes -= item.size
            self._process(item)

    # ------------------------------------------------------------------ state machine

    def _process(self, item: _Item) -> None:
        seq, batch = item.seq, item.batch
        if self._need_sync:
            self._need_sync = False
            self._push_front(item)
            self._full_sync(wire.seq_epoch(seq))
            return
        empty = batch is None or not batch.events
        # the expected seq's epoch: ``last`` may be "start of epoch - 1" after an empty history
        ref = self._last + 1 if self._last is not None else self._live_high
        if ref is not None and wire.seq_epoch(seq) != wire.seq_epoch(ref):
            self._restart(item, f"epoch {wire.seq_epoch(ref)} -> {wire.seq_epoch(seq)}")
            return
        if self._live_high is not None and seq <= self._live_high:
            if not empty:  # a repeated heartbeat carries nothing to undo
                self._restart(item, f"seq went backwards {self._live_high} -> {seq}")
            return
        last = self._last
        if last is not None and seq > last + 1:
            self._gap(item)
            return
        if last is not None and seq <= last and self._replayed.get(seq, item.digest) != item.digest:
            # not the live copy of what a replay gave: a plain publisher restarted meanwhile
            self._restart(item, f"seq {seq} reused with other content")
            return
        self._live_high = seq
        if last is None or seq == last + 1:
            self._apply(seq, batch)
        # else seq <= last: already applied through a replay or snapshot

    def _apply(self, seq: int, batch: wire.EventBatch | None) -> None:
        self._last = seq
        epoch = wire.seq_epoch(seq)
        if epoch != self._epoch:
            self._new_epoch(epoch)
        self._c.batches += 1
        if batch is None or not batch.events:
            return
        self._c.events += len(batch.events)
        self._last_event_at = time.monotonic()
        if not self._kind_logged and self.dp_rank_override is None and epoch == 0:
            self._kind_logged = True
            log.warning(
                "stream %s: a plain engine stream (no fan-in epoch), not an instance stream: only the ranks it "
                "publishes are visible (SGLang without the plugin publishes rank r on port + r); run the engine "
                "with --plugin sglang_kvpub, or register type sglang with dp_size (compatibility mode)",
                self.endpoint,
            )
        try:
            result = self._index.apply_batch(self.instance_id, batch, dp_rank=self.dp_rank_override)
        except Exception:
            self._c.apply_errors += 1
            self._rlog.warning("apply", "stream %s: index rejected batch %d", self.endpoint, seq)
            log.debug("apply_batch failed", exc_info=True)
            return
        self._c.dropped_block_size += int(getattr(result, "ignored_block_size", 0) or 0)
        rank = batch.dp_rank if self.dp_rank_override is None else self.dp_rank_override
        removed = self._c.removed
        for event in batch.events:
            if type(event) is wire.BlockRemoved:
                key = (rank if rank is not None else 0, wire.reason_label(event.reason))
                removed[key] = removed.get(key, 0) + len(event.block_hashes)

    def _clear_scope(self) -> None:
        if self.dp_rank_override is None:
            self._index.clear_instance(self.instance_id)
        else:
            self._index.clear_rank(self.instance_id, self.dp_rank_override)
        self._last = None
        self._replayed.clear()

    def _restart(self, item: _Item, reason: str) -> None:
        if item is self._restarted_by:
            # still inconsistent with the state just rebuilt: older than it; it is covered
            log.info("stream %s: dropped batch %d that predates the rebuilt state", self.endpoint, item.seq)
            return
        self._restarted_by = item
        self._c.restarts += 1
        self._epoch = None  # counted here: the rebuilt state's epoch is not a second restart
        log.warning("stream %s: publisher restarted (%s); rebuilding %s", self.endpoint, reason, self._scope())
        self._clear_scope()
        self._live_high = None
        self._gap_key = None
        self._push_front(item)
        self._full_sync(wire.seq_epoch(item.seq))

    def _new_epoch(self, epoch: int) -> None:
        # A reconnect or gap repair can land on a restarted fan-in's snapshot before any live
        # batch of the new epoch is seen: that is a restart too.
        if self._epoch is not None:
            self._c.restarts += 1
            log.warning(
                "stream %s: publisher restarted (epoch %d -> %d, found by a resync)", self.endpoint, self._epoch, epoch
            )
        self._epoch = epoch

    def _gap(self, item: _Item) -> None:
        assert self._last is not None
        seq, last = item.seq, self._last
        self._push_front(item)
        key = (seq, last)
        if self._gap_key == key:  # the previous attempt made no progress: start over from here
            log.warning("stream %s: gap before %d cannot be filled; continuing from it", self.endpoint, seq)
            self._clear_scope()
            return
        if self._gap_key is None or self._gap_key[0] != seq:
            self._c.gaps += 1
        self._gap_key = key
        if not self.replay_endpoint:
            self._warn_no_replay()
            self._clear_scope()
            return
        fetch = self._fetch(last + 1, snapshot=False)
        if fetch.ok and fetch.replies:
            if _looks_like_snapshot(fetch.replies, last + 1):
                self._apply_snapshot(fetch.replies)
                return
            if fetch.replies[0][0] <= last + 1:
                self._apply_history(fetch.replies)
                self._c.replays += 1
                return
        self._rlog.warning("lost", "stream %s: replay cannot fill %d..%d; rebuilding", self.endpoint, last + 1, seq - 1)
        self._rebuild(fetch)

    def _rebuild(self, partial: _Fetch) -> None:
        """Clears the scope, then reloads it from a snapshot or whatever history is left."""
        self._clear_scope()
        if self._snapshot_ok is not False:
            fetch = self._fetch(0, snapshot=True)
            if fetch.ok:
                self._snapshot_ok = True
                self._apply_snapshot(fetch.replies)
                return
        if partial.ok and partial.replies:
            self._apply_history(partial.replies)  # a subset of the truth: blocks stored and not removed since

    def _initial_sync(self) -> None:
        """At start: a snapshot; if the endpoint does not answer yet, retry on the first batch."""
        if not self._full_sync(None):
            self._need_sync = True

    def _full_sync(self, epoch: int | None) -> bool:
        """Reloads the scope from a snapshot, else from the epoch's whole history; True if answered."""
        if not self.replay_endpoint:
            self._warn_no_replay()
            return False
        start = wire.make_seq(epoch or 0, 0)
        if self._snapshot_ok is not False:
            fetch = self._fetch(start, snapshot=True)
            if fetch.ok:
                self._snapshot_ok = True
                self._apply_snapshot(fetch.replies)
                return True
        fetch = self._fetch(start, snapshot=False)
        if not fetch.ok:
            self._rlog.warning("sync", "stream %s: replay endpoint %s silent", self.endpoint, self.replay_endpoint)
            return False
        if self._snapshot_ok is None:
            self._snapshot_ok = False
            log.info("stream %s: replay endpoint has no snapshots (plain SGLang); using its history", self.endpoint)
        if fetch.replies and _looks_like_snapshot(fetch.replies, start):
            self._apply_snapshot(fetch.replies)
            return True
        self._clear_scope()
        if not fetch.replies or fetch.replies[0][0] == start:
            self._last = start - 1  # complete history: the epoch's first batch comes next
        else:
            self._rlog.warning("partial", "stream %s: history from %d only", self.endpoint, fetch.replies[0][0])
        if fetch.replies:
            self._apply_history(fetch.replies)
        return True

    def _apply_snapshot(self, replies: list[_Item]) -> None:
        """Replies: per rank a batch opening with AllBlocksCleared, all at seq S; then the tail."""
        self._clear_scope()
        self._gap_key = None
        self._c.snapshots += 1
        if not replies:
            return  # nothing resident, position unknown: the next batch is the baseline
        snap_seq = replies[0][0]
        index = 0
        while index < len(replies) and replies[index][0] == snap_seq:
            self._apply(snap_seq, replies[index].batch)
            index += 1
        self._apply_tail(replies[index:])
        log.info("stream %s: snapshot at seq %d applied (%d batches)", self.endpoint, snap_seq, index)
        self._discover(snap_seq, replies[:index])

    def _discover(self, snap_seq: int, snapshot: list[_Item]) -> None:
        """Learns the instance's dp_size from a fan-in snapshot and says what was found."""
        if wire.seq_epoch(snap_seq) == 0:
            return  # not our fan-in: a plain engine stream has no epoch and no snapshot
        ranks = sorted({item.batch.dp_rank for item in snapshot if item.batch and item.batch.dp_rank is not None})
        if not ranks or ranks != list(range(len(ranks))) or len(ranks) == self._c.dp_size:
            return
        self._c.dp_size = len(ranks)
        self._kind_logged = True
        log.info(
            "stream %s: instance stream with dp_size %d (ranks 0..%d, epoch %d) found from its snapshot; "
            "every rank's blocks are indexed and fold into the registered dp",
            self.endpoint, len(ranks), len(ranks) - 1, wire.seq_epoch(snap_seq),
        )  # fmt: skip

    def _apply_history(self, replies: list[_Item]) -> None:
        """Applies replayed batches in order from the first one that follows ``last``."""
        if self._last is None:
            self._apply_replayed(replies[0])
            self._c.replayed_batches += 1
            replies = replies[1:]
        self._c.replayed_batches += self._apply_tail(replies)

    def _apply_tail(self, replies: list[_Item]) -> int:
        applied = 0
        for item in replies:
            assert self._last is not None
            if item.seq <= self._last:
                continue  # duplicate
            if item.seq != self._last + 1:
                break  # a hole: the next live batch finds it again
            self._apply_replayed(item)
            applied += 1
        return applied

    def _apply_replayed(self, item: _Item) -> None:
        self._apply(item.seq, item.batch)
        self._replayed[item.seq] = item.digest
        while len(self._replayed) > self.options.live_buffer:
            self._replayed.popitem(last=False)

    def _warn_no_replay(self) -> None:
        if not self._warned_no_replay:
            self._warned_no_replay = True
            log.error(
                "stream %s: lost events and no replay endpoint; %s cleared and rebuilt from new events only",
                self.endpoint,
                self._scope(),
            )

    def _scope(self) -> str:
        if self.dp_rank_override is None:
            return f"instance {self.instance_id}"
        return f"instance {self.instance_id} rank {self.dp_rank_override}"

    # ------------------------------------------------------------------ replay

    def _fetch(self, start_seq: int, *, snapshot: bool) -> _Fetch:
        """One replay request (on the sync thread); the reader buffers live batches meanwhile."""
        assert self.replay_endpoint is not None
        client = ReplayClient(self._ctx, self.replay_endpoint, curve=self._curve)
        replies: list[_Item] = []
        try:
            client.request(start_seq, snapshot=snapshot)
            deadline = time.monotonic() + self.options.replay_timeout_s
            while not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    kind = "snapshot" if snapshot else "replay"
                    self._rlog.warning(f"timeout:{kind}", "stream %s: %s request timed out", self.endpoint, kind)
                    return _Fetch(False, replies)
                if client.socket.poll(max(1, int(min(remaining, self.options.poll_s) * 1000)), zmq.POLLIN):
                    self._last_msg = time.monotonic()  # the publisher's process answers: it is up
                    done = self._read_replies(client, replies)
                    if done is not None:
                        return _Fetch(done, replies)
                    deadline = time.monotonic() + self.options.replay_timeout_s
            return _Fetch(False, replies)
        finally:
            client.close()

    def _read_replies(self, client: ReplayClient, replies: list[_Item]) -> bool | None:
        """Reads what is ready; True at the end marker, False when too much, None for more."""
        while True:
            try:
                reply = client.recv()
            except wire.WireError as exc:
                self._bad_input("replay reply", exc)
                continue
            if reply is None:
                return None
            if reply.is_end:
                return True
            replies.append(_Item(reply.seq, self._decode(reply.payload), hash(reply.payload)))
            if len(replies) > self.options.max_replay_batches:
                self._rlog.warning("big", "stream %s: replay longer than %d batches", self.endpoint, len(replies))
                return False


def _looks_like_snapshot(replies: list[_Item], start_seq: int) -> bool:
    """A fan-in answers a start older than its buffer with a snapshot: AllBlocksCleared first."""
    seq, batch = replies[0].seq, replies[0].batch
    if batch is None or not batch.events or seq == start_seq:
        return False
    return type(batch.events[0]) is wire.AllBlocksCleared
