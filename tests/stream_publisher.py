"""A minimal KV-event publisher for subscriber tests, run as a subprocess.

Two personalities:

* default - an instance stream like our fan-in: ``seq = epoch << 40 | n``, batches tagged
  with ``dp_rank``, empty heartbeat batches (``--heartbeat``), a replay ROUTER that answers
  the SGLang 0.5.23 protocol, snapshot requests, and a start older than its buffer with a
  snapshot (unless ``--no-auto-snapshot``);
* ``--compat`` - one plain SGLang rank publisher: seq from 0, no heartbeats, snapshot
  requests ignored (SGLang's ROUTER drops anything but 3 frames), old history replayed as is.

Commands arrive as JSON lines on stdin, one JSON answer line each on stdout:
``store``/``remove`` {rank, hashes, medium?, live?}, ``clear`` {rank, live?},
``heartbeat``, ``garbage`` (a payload that is not msgpack, consuming a seq),
``badframes`` (2 frames, then a 3-frame message with a short seq frame), ``restart``
{epoch?} (counter, buffer and truth reset, as a restarted engine), ``truth``, ``quit``.
``live: false`` publishes into the replay buffer only: the subscriber sees a gap.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

import zmq

from sglang_kvpub import wire


class Publisher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.topic: bytes = args.topic.encode()
        self.epoch: int = 0 if args.compat else args.epoch
        self.counter = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=args.buffer_steps)
        self.truth: dict[int, dict[str, set[int]]] = {}
        self.encoder = wire.BatchEncoder("map")
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(args.endpoint)
        self.router = None
        if args.replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(args.replay_endpoint)

    # ------------------------------------------------------------------ publishing

    def next_seq(self) -> int:
        seq = self.counter if self.args.compat else wire.make_seq(self.epoch, self.counter)
        self.counter += 1
        return seq

    def publish(self, events: list[Any], rank: int | None, live: bool = True) -> int:
        payload = self.encoder.encode(wire.EventBatch(ts=time.time(), events=events, dp_rank=rank))
        return self.publish_payload(payload, live)

    def publish_payload(self, payload: bytes, live: bool) -> int:
        seq = self.next_seq()
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart(wire.live_frames(self.topic, seq, payload))
        return seq

    def stored(self, hashes: list[int], medium: str) -> wire.BlockStored:
        size = self.args.block_size
        tokens = [(h + i) % 50_000 for h in hashes for i in range(size)]
        return wire.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=size, medium=medium)

    def rank_media(self, rank: int) -> dict[str, set[int]]:
        return self.truth.setdefault(rank, {})

    # ------------------------------------------------------------------ commands

    def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        live = bool(cmd.get("live", True))
        rank = int(cmd.get("rank", self.args.rank))
        medium = str(cmd.get("medium", wire.MEDIUM_GPU))
        if op == "store":
            hashes = [int(h) for h in cmd["hashes"]]
            self.rank_media(rank).setdefault(medium, set()).update(hashes)
            return {"seq": self.publish([self.stored(hashes, medium)], rank, live)}
        if op == "remove":
            hashes = [int(h) for h in cmd["hashes"]]
            self.rank_media(rank).setdefault(medium, set()).difference_update(hashes)
            return {"seq": self.publish([wire.BlockRemoved(block_hashes=hashes, medium=medium)], rank, live)}
        if op == "clear":
            self.truth[rank] = {}
            return {"seq": self.publish([wire.AllBlocksCleared()], rank, live)}
        if op == "heartbeat":
            return {"seq": self.publish([], None, live)}
        if op == "garbage":
            return {"seq": self.publish_payload(b"\xc1 not msgpack", live)}
        if op == "badframes":
            self.pub.send_multipart([self.topic, b"only two"])
            self.pub.send_multipart([self.topic, b"\x00\x01", b"short seq frame"])
            return {}
        if op == "restart":
            self.epoch = 0 if self.args.compat else int(cmd.get("epoch", self.epoch + 1))
            self.counter = 0
            self.buffer.clear()
            self.truth = {}
            return {}
        if op == "truth":
            truth = {str(r): {m: sorted(h) for m, h in media.items()} for r, media in self.truth.items()}
            return {"truth": truth, "last_seq": self.buffer[-1][0] if self.buffer else None}
        raise ValueError(f"unknown op {op!r}")

    # ------------------------------------------------------------------ replay

    def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, start, snapshot = wire.parse_replay_request(frames)
            except wire.WireError:
                continue
            if snapshot and self.args.compat:
                continue  # plain SGLang logs and ignores a 4-frame request
            too_old = bool(self.buffer) and start < self.buffer[0][0]
            if snapshot or (too_old and not self.args.compat and not self.args.no_auto_snapshot):
                self.send_snapshot(identity)
            else:
                for seq, payload in self.buffer:
                    if seq >= start:
                        self.send_reply(identity, seq, payload)
            self.router.send_multipart(self.end_frames(identity))

    def send_snapshot(self, identity: bytes) -> None:
        if not self.buffer:
            return
        snap_seq = self.buffer[-1][0]
        for rank in sorted(self.truth):
            events: list[Any] = [wire.AllBlocksCleared()]
            for medium, hashes in sorted(self.truth[rank].items()):
                if hashes:
                    events.append(self.stored(sorted(hashes), medium))
            payload = self.encoder.encode(wire.EventBatch(ts=time.time(), events=events, dp_rank=rank))
            self.send_reply(identity, snap_seq, payload)

    def send_reply(self, identity: bytes, seq: int, payload: bytes) -> None:
        assert self.router is not None
        if self.args.old_replies:  # SGLang <= 0.5.21 / vLLM: no topic frame
            self.router.send_multipart([identity, b"", wire.encode_seq(seq), payload])
        else:
            self.router.send_multipart(wire.replay_reply_frames(identity, self.topic, seq, payload))

    def end_frames(self, identity: bytes) -> list[bytes]:
        if self.args.old_replies:
            return [identity, b"", wire.END_SEQ_BYTES, b""]
        return wire.replay_end_frames(identity)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        stdin = sys.stdin.fileno()
        poller = zmq.Poller()
        poller.register(stdin, zmq.POLLIN)
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        reply({"ready": True})
        pending = b""
        next_beat = time.monotonic() + self.args.heartbeat if self.args.heartbeat > 0 else None
        while True:
            timeout = 100 if next_beat is None else max(0, int((next_beat - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout))
            if self.router is not None and self.router in events:
                self.serve_replay()
            if stdin in events:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    cmd = json.loads(line)
                    if cmd["op"] == "quit":
                        return
                    reply(self.command(cmd))
            if next_beat is not None and time.monotonic() >= next_beat:
                self.publish([], None)
                next_beat = time.monotonic() + self.args.heartbeat

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.term()


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay-endpoint")
    parser.add_argument("--topic", default="")
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--compat", action="store_true", help="plain SGLang rank publisher")
    parser.add_argument("--rank", type=int, default=0, help="default dp_rank of batches")
    parser.add_argument("--heartbeat", type=float, default=0.0, help="seconds between empty batches; 0: none")
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--old-replies", action="store_true", help="2-frame replay replies")
    parser.add_argument("--no-auto-snapshot", action="store_true")
    publisher = Publisher(parser.parse_args())
    try:
        publisher.run()
    finally:
        publisher.close()


if __name__ == "__main__":
    main()
