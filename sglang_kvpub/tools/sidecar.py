"""``sglang-kvpub fanin``: the fan-in as a standalone process for an unmodified SGLang.

For SGLang versions whose DP controller loads no plugin: SUB-connect to each rank's own
stream (``rank_base`` port + rank), decode whatever shape that SGLang writes, and feed the
same :class:`~sglang_kvpub.publish.fanin.FanIn` the plugin uses, so the instance stream, replay
and snapshot are identical.

Per rank the sidecar follows SGLang's own seq: a jump is replayed from the rank's replay
ROUTER (``rank_replay_base`` + rank) when one is given, otherwise the fan-in counts the
gap; a seq that goes backwards is a restarted rank (SGLang counts from 0 on every start),
which the sidecar turns into a new rank epoch, so the fan-in clears that rank's blocks.
The first batch seen from a rank also fetches what that rank still buffers, so a sidecar
started after the engine begins with the rank's recent history.  Malformed batches are
counted, logged and skipped.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from typing import Any

import zmq

from sglang_kvpub.config import ConfigError, PluginConfig, offset_endpoint
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.transport.replay import ReplayClient
from sglang_kvpub.wire import (
    BatchDecoder,
    EventBatch,
    WireError,
    parse_live_frames,
)

__all__ = ["Sidecar", "add_parser", "run"]

log = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 2000
_MAX_REPLAY_BATCHES = 1_000_000


class _Rank:
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.epoch = 1
        self.last_seq = -1
        self.seen = False
        self.replay: ReplayClient | None = None


class Sidecar:
    """SUBs on ``rank_base``+rank for every rank, feeding one :class:`FanIn`."""

    def __init__(
        self,
        config: PluginConfig,
        dp_size: int,
        rank_base: str,
        rank_replay_base: str | None = None,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.dp_size = dp_size
        self.rank_base = rank_base
        self.rank_replay_base = rank_replay_base
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self.fanin = FanIn(config, dp_size, context=self._context, listen_channel=False)
        self._decoder = BatchDecoder()
        self._ranks = [_Rank(rank) for rank in range(dp_size)]
        self._subs: dict[zmq.Socket[bytes], _Rank] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"batches": 0, "malformed": 0, "replayed": 0, "replay_failures": 0, "restarts": 0}

    def start(self) -> None:
        self.fanin.start()
        topic = self.config.topic.encode("utf-8")
        for rank in self._ranks:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self.config.hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(offset_endpoint(self.rank_base, rank.dp_rank))
            self._subs[sub] = rank
        self._thread = threading.Thread(target=self._run, name="kvpub-sidecar", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for sub in self._subs:
            sub.close(linger=0)
        for rank in self._ranks:
            if rank.replay is not None:
                rank.replay.close()
        self.fanin.stop()
        if self._owns_context:
            self._context.term()

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "fanin": self.fanin.stats()}

    def status_line(self) -> str:
        stats = self.fanin.stats()
        alive = sum(1 for state in stats["ranks"].values() if state["alive"])
        gaps = sum(state["gaps"] for state in stats["ranks"].values())
        return (
            f"kvpub sidecar: epoch {stats['epoch']} batches {stats['batches']} ranks alive {alive}/{self.dp_size} "
            f"gaps {gaps} replayed {self.counts['replayed']} restarts {self.counts['restarts']} "
            f"malformed {self.counts['malformed'] + stats['malformed']} snapshots {stats['snapshots_served']}"
        )

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                for _ in range(256):
                    try:
                        frames = sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(self._subs[sub], frames)

    def _on_frames(self, rank: _Rank, frames: list[bytes]) -> None:
        try:
            _, seq, payload = parse_live_frames(frames)
        except WireError as exc:
            self.counts["malformed"] += 1
            log.warning("kvpub sidecar: rank %d sent bad frames: %s", rank.dp_rank, exc)
            return
        if rank.seen and seq <= rank.last_seq:
            rank.epoch += 1
            rank.last_seq = -1
            self.counts["restarts"] += 1
            log.warning("kvpub sidecar: rank %d restarted (seq went back to %d)", rank.dp_rank, seq)
        if seq > rank.last_seq + 1 and self.rank_replay_base:
            self._replay(rank, rank.last_seq + 1, seq)
        rank.seen = True
        self._ingest(rank, seq, payload)

    def _ingest(self, rank: _Rank, seq: int, payload: bytes) -> None:
        rank.last_seq = seq
        try:
            batch: EventBatch = self._decoder.decode(payload)
        except WireError as exc:
            self.counts["malformed"] += 1
            log.warning("kvpub sidecar: rank %d seq %d: malformed batch skipped: %s", rank.dp_rank, seq, exc)
            return
        self.counts["batches"] += 1
        self.fanin.ingest(rank.dp_rank, rank.epoch, seq, batch)

    def _replay(self, rank: _Rank, start: int, stop: int) -> None:
        """Fetches ``[start, stop)`` from the rank's replay ROUTER and ingests it in order."""
        assert self.rank_replay_base is not None
        if rank.replay is None:
            rank.replay = ReplayClient(self._context, offset_endpoint(self.rank_replay_base, rank.dp_rank))
        client = rank.replay
        client.request(start)
        for _ in range(_MAX_REPLAY_BATCHES):
            try:
                reply = client.recv(_REPLAY_TIMEOUT_MS)
            except WireError as exc:
                log.warning("kvpub sidecar: rank %d: bad replay reply: %s", rank.dp_rank, exc)
                continue
            if reply is None or self._stop.is_set():
                break
            if reply.is_end:
                return
            if start <= reply.seq < stop and reply.seq > rank.last_seq:
                self.counts["replayed"] += 1
                self._ingest(rank, reply.seq, reply.payload)
        # No end marker: drop the socket so late replies cannot be mistaken for a later answer.
        self.counts["replay_failures"] += 1
        log.warning("kvpub sidecar: rank %d: replay of seqs %d..%d failed", rank.dp_rank, start, stop - 1)
        client.close()
        rank.replay = None


# --------------------------------------------------------------------------- CLI


class _StopRequest:
    """SIGTERM/SIGINT handler that only sets a flag.

    A handler runs in the main thread between bytecodes, possibly while that thread holds
    a lock (a ``threading.Event``'s own, inside ``Event.wait``); taking any lock here could
    then wait on itself forever, so the handler takes none."""

    requested = False

    def __call__(self, signum: int, _frame: Any) -> None:
        self.requested = True


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fanin",
        help="serve one instance stream from an unmodified SGLang's per-rank streams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rank-base", required=True, help="rank 0's stream, e.g. tcp://HOST:5557 (rank r: port+r)")
    parser.add_argument("--dp-size", type=int, required=True, help="number of publishing ranks")
    parser.add_argument("--rank-replay-base", help="rank 0's replay ROUTER, e.g. tcp://HOST:6667 (rank r: port+r)")
    parser.add_argument(
        "--endpoint", required=True, help="instance PUB, e.g. tcp://*:5600 or tcp://127.0.0.1:5600 (bound)"
    )
    parser.add_argument(
        "--connect",
        action="store_true",
        help="connect the instance PUB to --endpoint instead of binding it (a subscriber that binds)",
    )
    parser.add_argument("--replay-endpoint", help="instance replay ROUTER, e.g. tcp://*:5700")
    parser.add_argument("--topic", default="", help="topic of the rank streams and of the instance stream")
    parser.add_argument("--hash-form", default="u64", choices=("u64", "i64"))
    parser.add_argument("--event-encoding", default="map", choices=("map", "array"))
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--hwm", type=int, default=100_000)
    parser.add_argument("--status-interval", type=float, default=10.0, help="seconds between status lines (0: off)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.dp_size < 1:
        log.error("--dp-size must be >= 1")
        return 2
    try:
        config = PluginConfig(
            endpoint=args.endpoint,
            # The sidecar is the stable end: it binds whatever host it is given (SGLang's
            # wildcard rule would connect a concrete host, and nobody would receive anything).
            bind=not args.connect,
            replay_endpoint=args.replay_endpoint,
            topic=args.topic,
            hash_form=args.hash_form,
            event_encoding=args.event_encoding,
            heartbeat_s=args.heartbeat_s,
            buffer_steps=args.buffer_steps,
            hwm=args.hwm,
        )
        offset_endpoint(args.rank_base, args.dp_size - 1)
        if args.rank_replay_base:
            offset_endpoint(args.rank_replay_base, args.dp_size - 1)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    stop = _StopRequest()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sidecar = Sidecar(config, args.dp_size, args.rank_base, args.rank_replay_base)
    try:
        sidecar.start()
    except zmq.ZMQError as exc:
        log.error("cannot open the instance sockets: %s", exc)
        sidecar.stop()
        return 1
    how = "CONNECTED to (a subscriber must bind there)" if args.connect else "bound on"
    print(
        f"kvpub sidecar: instance PUB {how} {config.endpoint} for {args.dp_size} ranks from {args.rank_base}",
        flush=True,
    )
    interval = args.status_interval if args.status_interval > 0 else None
    next_status = time.monotonic() + (interval or 0)
    while not stop.requested:
        time.sleep(0.2)  # the flag is read within 0.2 s of a signal
        if interval and time.monotonic() >= next_status:
            log.info("%s", sidecar.status_line())
            next_status = time.monotonic() + interval
    sidecar.stop()
    log.info("%s (stopped)", sidecar.status_line())
    return 0
