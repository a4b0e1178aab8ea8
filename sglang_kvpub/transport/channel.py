"""The internal channel between rank publishers (PUSH) and the instance fan-in (PULL).

One single-frame message per rank batch: ``MAGIC | dp_rank u32 | rank_epoch u64 |
rank_seq u64 | payload`` (big-endian 26-byte prefix) with ``payload`` an encoded,
enriched batch.  An empty payload is a rank heartbeat: liveness only, never forwarded,
but it takes a rank_seq so loss stays detectable.  One frame, not three: the fan-in
reads it with one backend ``recv`` and no ``RCVMORE`` query (:mod:`sglang_kvpub.transport.zmq_io`);
a multipart message from a foreign peer is read frame by frame and each frame fails the
magic check (counted as malformed).

On one node the channel is a Unix SEQPACKET socket (``unixpkt://``, see
:mod:`sglang_kvpub.transport.packet_channel`; ZMQ ipc where that socket type does not exist) in a
private directory (mode 0700, under ``$XDG_RUNTIME_DIR`` or the temp dir) whose socket
name both sides derive from an instance key (the instance PUB endpoint), so ranks and
fan-in agree without any extra setting.  Multi-node DP uses ``internal_channel =
tcp://<fan-in host>:<port>`` (ZMQ).  The sending side never blocks: non-blocking sends,
bounded buffers, drops counted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any

import zmq

from sglang_kvpub.config import PACKET_SCHEME, PluginConfig
from sglang_kvpub.transport.zmq_io import NOBLOCK, send_frame
from sglang_kvpub.wire import WireError

__all__ = [
    "MAGIC",
    "ChannelFrame",
    "channel_prefix",
    "channel_message",
    "parse_channel_message",
    "ChannelPusher",
    "ChannelPuller",
    "channel_frames",
    "parse_channel_frames",
    "default_channel_endpoint",
    "resolve_channel_endpoint",
    "private_dir",
    "seqpacket_available",
    "PACKET_SCHEME",
]

MAGIC = b"kvpub2"  # kvpub1 was the three-frame form
_PREFIX = struct.Struct(">6sIQQ")  # magic, dp_rank, rank_epoch, rank_seq
PREFIX_BYTES = _PREFIX.size
MAX_MESSAGE_BYTES = 64 << 20
ChannelFrame = tuple[int, int, int, bytes]  # (dp_rank, rank_epoch, rank_seq, payload)


def channel_prefix(dp_rank: int, rank_epoch: int, rank_seq: int) -> bytes:
    """What precedes the payload: a sender that writes both parts at once needs no copy."""
    return _PREFIX.pack(MAGIC, dp_rank, rank_epoch, rank_seq)


def channel_message(dp_rank: int, rank_epoch: int, rank_seq: int, payload: bytes) -> bytes:
    return channel_prefix(dp_rank, rank_epoch, rank_seq) + payload


def parse_channel_message(message: bytes) -> ChannelFrame:
    if len(message) < PREFIX_BYTES:
        raise WireError("short channel message", f"{len(message)} bytes")
    magic, dp_rank, rank_epoch, rank_seq = _PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise WireError("bad channel magic", repr(magic))
    return dp_rank, rank_epoch, rank_seq, message[PREFIX_BYTES:]


def channel_frames(dp_rank: int, rank_epoch: int, rank_seq: int, payload: bytes) -> list[bytes]:
    """The message as a frame list (``send_multipart``; tests and tools)."""
    return [channel_message(dp_rank, rank_epoch, rank_seq, payload)]


def parse_channel_frames(frames: list[Any]) -> ChannelFrame:
    if len(frames) != 1:
        raise WireError("bad channel frame count", str(len(frames)))
    message = frames[0]
    return parse_channel_message(message if type(message) is bytes else bytes(message))


# --------------------------------------------------------------------------- endpoints


def private_dir() -> Path:
    """``<runtime dir>/sglang-kvpub-<uid>``, created 0700 and checked to be ours and private."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"sglang-kvpub-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by uid {os.getuid()}: remove it")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def default_channel_endpoint(instance_key: str) -> str:
    """``unixpkt://<private dir>/<hash of instance_key>.pkt`` (:mod:`sglang_kvpub.transport.packet_channel`),
    or ZMQ's ``ipc://<private dir>/<hash>.sock`` where Unix SEQPACKET sockets do not exist;
    every process computes the same."""
    digest = hashlib.sha256(instance_key.encode("utf-8")).hexdigest()[:20]
    if seqpacket_available():
        return f"{PACKET_SCHEME}{private_dir() / digest}.pkt"
    return f"ipc://{private_dir() / digest}.sock"


def seqpacket_available() -> bool:
    """Unix SEQPACKET sockets exist here (Linux; not macOS)."""
    if not hasattr(socket, "AF_UNIX") or not hasattr(socket, "SOCK_SEQPACKET"):
        return False
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).close()
    except OSError:
        return False
    return True


def resolve_channel_endpoint(config: PluginConfig) -> str:
    """``internal_channel`` if configured, else the per-instance default keyed by the PUB endpoint."""
    return config.internal_channel or default_channel_endpoint(config.endpoint)


# --------------------------------------------------------------------------- sockets


class ChannelPusher:
    """Rank side: connects a PUSH socket; ``send`` never blocks and reports drops."""

    def __init__(self, endpoint: str, hwm: int, context: zmq.Context[Any] | None = None) -> None:
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self.socket = self._context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.LINGER, 500)
        self.socket.connect(endpoint)
        self.sent = 0
        self.dropped = 0

    def send(self, dp_rank: int, rank_epoch: int, rank_seq: int, payload: bytes) -> bool:
        try:
            send_frame(self.socket, channel_message(dp_rank, rank_epoch, rank_seq, payload), NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self, linger_ms: int = 500) -> None:
        self.close_socket(linger_ms)
        self.close_context()

    def close_socket(self, linger_ms: int = 500) -> None:
        """From the thread that sends; returns at once (pending frames get ``linger_ms``)."""
        self.socket.close(linger=linger_ms)

    def close_context(self) -> None:
        """From any thread once the socket is closed; waits up to the linger for an owned context."""
        if self._owns_context:
            self._context.term()


class ChannelPuller:
    """Fan-in side: binds a PULL socket (removing its ipc file on close)."""

    def __init__(self, endpoint: str, hwm: int, context: zmq.Context[Any]) -> None:
        self.endpoint = endpoint
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a peer over the limit is disconnected
        self.socket.bind(endpoint)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint[len("ipc://") :])
