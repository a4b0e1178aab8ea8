"""``sglang-kvpub tail``: print any SGLang, vLLM or instance KV-event stream for humans or tools.

One line per batch (``--json``: one JSON object per batch).  Sequence gaps and restarts go
to stderr; a malformed frame is reported there and skipped.  Ctrl-C exits 0.

``--check``: also follow every rank's own order on an instance stream (``wire.RankOrder``,
docs/wire.md) and report a batch of one rank missing even when the instance seq is
contiguous; at exit one summary line goes to stderr and the exit status is 1 if anything
was missing.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

import zmq

from sglang_kvpub import wire
from sglang_kvpub.transport.replay import ReplayClient

_POLL_MS = 200
_REPLAY_TIMEOUT_S = 5.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tail",
        help="print a KV-event stream (SGLang, vLLM or an sglang-kvpub instance stream)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("endpoint", help="the publisher's ZMQ endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default: every topic)")
    parser.add_argument("--replay-endpoint", help="the publisher's replay ROUTER, to print history first")
    parser.add_argument("--from-seq", type=int, help="with --replay-endpoint: replay from this sequence number")
    parser.add_argument("--snapshot", action="store_true", help="with --replay-endpoint: ask for a snapshot")
    parser.add_argument("--json", action="store_true", help="one JSON object per batch")
    parser.add_argument("--bind", action="store_true", help="bind instead of connect (for publishers that connect)")
    parser.add_argument("--count", type=int, default=0, help="exit after this many batches (0: run until Ctrl-C)")
    parser.add_argument("--idle-exit", type=float, default=0.0, help="exit after this many idle seconds (0: never)")
    parser.add_argument(
        "--check", action="store_true", help="check each rank's order too; exit 1 if a batch of any rank was missed"
    )
    parser.set_defaults(run=run)


@dataclass
class SeqTracker:
    """Reports gaps and restarts; works for plain counters and for epoch-tagged instance seqs.

    A snapshot repeats one seq for several batches, and live messages can overlap what a
    replay already printed: both are expected and neither is reported.
    """

    err: TextIO
    last: int | None = None
    replayed_until: int | None = None
    gaps: int = 0
    restarts: int = 0

    def observe_replayed(self, seq: int) -> None:
        self.last = seq
        self.replayed_until = seq

    def observe(self, seq: int) -> bool:
        """True when a live ``seq`` is new (not already printed by a replay)."""
        last = self.last
        if last is not None:
            replayed = self.replayed_until
            if replayed is not None and seq <= replayed and wire.seq_epoch(seq) == wire.seq_epoch(replayed):
                return False
            if wire.seq_epoch(seq) != wire.seq_epoch(last) or seq <= last:
                self.restarts += 1
                print(f"restart: publisher sequence moved from {last} to {seq}", file=self.err)
            elif seq != last + 1:
                self.gaps += 1
                print(f"gap: expected seq {last + 1}, got {seq} ({seq - last - 1} batches missed)", file=self.err)
        self.replayed_until = None
        self.last = seq
        return True


@dataclass
class Printer:
    out: TextIO
    as_json: bool
    batches: int = 0
    counts: Counter[str] = field(default_factory=Counter)

    def show(self, seq: int, batch: wire.EventBatch) -> None:
        self.batches += 1
        if self.as_json:
            self.out.write(json.dumps(wire.batch_to_json(seq, batch), separators=(",", ":")) + "\n")
        else:
            self.out.write(describe_batch(seq, batch) + "\n")
        self.out.flush()


def describe_batch(seq: int, batch: wire.EventBatch) -> str:
    """``seq=12 epoch=0 dp_rank=3 events=4 BlockStored[GPU]=3 BlockRemoved[GPU]=1``."""
    counts: Counter[str] = Counter()
    blocks = 0
    for event in batch.events:
        name = type(event).__name__
        medium = getattr(event, "medium", None)
        counts[f"{name}[{medium}]" if medium else name] += 1
        blocks += len(getattr(event, "block_hashes", ()))
    detail = " ".join(f"{key}={value}" for key, value in sorted(counts.items())) or "heartbeat"
    return (
        f"seq={wire.seq_counter(seq)} epoch={wire.seq_epoch(seq)} dp_rank={batch.dp_rank} "
        f"events={len(batch.events)} blocks={blocks} {detail}"
    )


def replay(context: zmq.Context, endpoint: str, start_seq: int, snapshot: bool) -> Iterator[tuple[int, bytes]]:
    """``(seq, payload)`` pairs the replay ROUTER returns, until its end marker."""

    def skipped(exc: wire.WireError) -> None:
        print(f"skipped malformed replay reply: {exc}", file=sys.stderr)

    with ReplayClient(context, endpoint) as client:
        yield from client.fetch(start_seq, snapshot=snapshot, timeout_s=_REPLAY_TIMEOUT_S, on_bad=skipped)


def _summary(tracker: SeqTracker, ranks: wire.RankOrderCheck, err: TextIO) -> int:
    """The ``--check`` line: 0 when no batch was missed, else 1."""
    # the instance's restarts beside the ranks' ("restarts": per rank, from the rank check)
    report = {"instance_gaps": tracker.gaps, "instance_restarts": tracker.restarts, **ranks.as_dict()}
    print("check: " + json.dumps(report, sort_keys=True), file=err)
    return 1 if tracker.gaps or ranks.gaps else 0


class _Stop:
    requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    if args.from_seq is not None and not args.replay_endpoint:
        print("--from-seq needs --replay-endpoint", file=err)
        return 2
    stop = _Stop()
    previous = signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    try:
        (sub.bind if args.bind else sub.connect)(args.endpoint)
        tracker = SeqTracker(err)
        ranks = wire.RankOrderCheck() if getattr(args, "check", False) else None
        code = _loop(args, context, sub, stop, Printer(out, args.json), tracker, err, ranks)
        return _summary(tracker, ranks, err) if ranks is not None and code == 0 else code
    except KeyboardInterrupt:
        return 0
    except TimeoutError as exc:
        print(f"replay failed: {exc}", file=err)
        return 1
    finally:
        sub.close()
        context.term()
        signal.signal(signal.SIGINT, previous)


def _loop(
    args: argparse.Namespace,
    context: zmq.Context,
    sub: zmq.Socket,
    stop: _Stop,
    printer: Printer,
    tracker: SeqTracker,
    err: TextIO,
    ranks: wire.RankOrderCheck | None = None,
) -> int:
    decoder = wire.BatchDecoder()

    def handle(seq: int, payload: bytes, replayed: bool = False) -> bool:
        restarts = tracker.restarts
        if replayed:
            tracker.observe_replayed(seq)
        elif not tracker.observe(seq):
            return False
        if ranks is not None:
            if tracker.restarts != restarts:
                ranks.reset()  # a new instance epoch: every rank's order starts again
            gap = ranks.observe(*wire.read_rank_order(payload))
            if gap is not None:
                print(gap.describe(), file=err)
        try:
            batch = decoder.decode(payload)
        except wire.WireError as exc:
            print(f"skipped malformed batch seq={seq}: {exc}", file=err)
            return False
        printer.show(seq, batch)
        return bool(args.count) and printer.batches >= args.count

    if args.replay_endpoint and (args.from_seq is not None or args.snapshot):
        for seq, payload in replay(context, args.replay_endpoint, args.from_seq or 0, args.snapshot):
            if handle(seq, payload, replayed=True):
                return 0
    idle_since = time.monotonic()
    while not stop.requested:
        if not sub.poll(_POLL_MS):
            if args.idle_exit and time.monotonic() - idle_since > args.idle_exit:
                return 0
            continue
        idle_since = time.monotonic()
        frames = sub.recv_multipart()
        try:
            _, seq, payload = wire.parse_live_frames(frames)
        except wire.WireError as exc:
            print(f"skipped malformed message: {exc}", file=err)
            continue
        if handle(seq, payload):
            return 0
    return 0
