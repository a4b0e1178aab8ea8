"""The single-node internal channel on a Unix ``SOCK_SEQPACKET`` socket (no ZMQ I/O thread).

Through ZMQ PUSH/PULL every batch costs the rank one thread wake-up (its ZMQ I/O thread)
and the fan-in two (its I/O thread, then the fan-in thread); on a busy host each wake-up
is a chance to wait for a CPU.  Over a SEQPACKET socket the rank's send is one
non-blocking system call from the publishing thread and the fan-in thread polls the
connections itself.  Endpoint form: ``unixpkt://<path>``, the default on one node
(:func:`channel.default_channel_endpoint`); ``ipc://`` and ``tcp://`` stay ZMQ.

Packets: a flag byte, then the channel message of :mod:`sglang_kvpub.transport.channel` (or a piece
of it).  A message of up to ``PACKET_BYTES`` is one packet (``WHOLE``); a bigger one is
cut into ``MORE`` packets and a final ``LAST`` one, reassembled per connection (at most
``MAX_MESSAGE_BYTES``).  SEQPACKET keeps packet boundaries and order on a connection.

Rank side (:class:`PacketPusher`), the same contract as ZMQ's PUSH with ``NOBLOCK``:
sends never block (``MSG_DONTWAIT``).  What the socket buffer cannot take right now -
the fan-in is behind, or not there yet - waits in the pusher's *backlog*, in order, up
to ``limit`` packets (the ``hwm`` setting, as ZMQ's SNDHWM); beyond it a message is
dropped and counted, and the fan-in sees the rank_seq gap.  Every send first moves the
backlog on (a few packets: it runs in the scheduler's thread); :meth:`PacketPusher.service`
(the sender thread) moves the rest, reconnects, and notices a fan-in that went away
(end of file).  A connection lost with messages in the backlog drops them (counted); the
next connection reaches a fan-in that never saw the blocks announced before, so the
rank resyncs: :meth:`PacketPusher.reconnections` counts it, as the ZMQ connection
monitor does.  The very first connection needs no resync unless a message was dropped
before it; messages sent before the fan-in exists wait in the backlog, as with ZMQ.

Fan-in side (:class:`PacketListener`): binds the path (its private directory is mode
0700), accepts every rank's connection and reads packets without blocking; a connection
that closes drops any half-reassembled message.  Malformed packets are reported to the
caller as :class:`~sglang_kvpub.wire.WireError` values (it counts and logs them).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator

from sglang_kvpub.transport.channel import MAX_MESSAGE_BYTES, PACKET_SCHEME, channel_prefix
from sglang_kvpub.wire import WireError

__all__ = [
    "PACKET_BYTES",
    "RETRY_S",
    "PacketPusher",
    "PacketListener",
    "packet_path",
]

PACKET_BYTES = 60 << 10  # under the default socket buffer (208 KiB), with room for the flag byte
RETRY_S = 0.1
INLINE_FLUSH_PACKETS = 8  # backlog packets a send moves on before its own (scheduler thread)
WHOLE, MORE, LAST = b"\x00", b"\x01", b"\x02"
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)
_SNDBUF = 4 << 20  # asked for; the kernel caps it (wmem_max)
Packet = tuple[bytes, bytes | memoryview]  # (flag, body)


def packet_path(endpoint: str) -> str:
    if not endpoint.startswith(PACKET_SCHEME) or len(endpoint) == len(PACKET_SCHEME):
        raise ValueError(f"not a {PACKET_SCHEME}<path> endpoint: {endpoint!r}")
    return endpoint[len(PACKET_SCHEME) :]


def message_packets(message: bytes) -> list[Packet]:
    if len(message) <= PACKET_BYTES:
        return [(WHOLE, message)]
    view = memoryview(message)
    last = len(view) - PACKET_BYTES
    starts = range(0, len(view), PACKET_BYTES)
    return [(LAST if start >= last else MORE, view[start : start + PACKET_BYTES]) for start in starts]


# --------------------------------------------------------------------------- rank side


class PacketPusher:
    """Rank side; one thread at a time (the rank publisher's ``_sending`` flag)."""

    def __init__(self, endpoint: str, limit: int = 100_000) -> None:
        self.path = packet_path(endpoint)
        self.limit = max(1, limit)
        self.sent = 0
        self.dropped = 0
        self.connects = 0
        self.resets = 0  # connections given up: the fan-in went away
        self._resyncs_due = 0
        self._sock: socket.socket | None = None
        self._backlog: collections.deque[Packet] = collections.deque()
        self._next_try = 0.0
        self._connect()

    @property
    def backlog(self) -> int:
        """Packets waiting for the socket (0 on the fast path)."""
        return len(self._backlog)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        try:
            sock.connect(self.path)
        except OSError:  # no fan-in (yet): ENOENT, ECONNREFUSED; a full accept queue: EAGAIN
            sock.close()
            self._next_try = time.monotonic() + RETRY_S
            return False
        if self.connects or self.dropped:  # this fan-in missed blocks announced before
            self._resyncs_due += 1
        self._sock = sock
        self.connects += 1
        return True

    def _reset(self) -> None:
        """The fan-in went away: what waits for it is lost (counted, per message)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.resets += 1
        self.dropped += sum(1 for flag, _ in self._backlog if flag != MORE)
        self._backlog.clear()
        self._next_try = time.monotonic() + RETRY_S

    def send(self, dp_rank: int, rank_epoch: int, rank_seq: int, payload: bytes) -> bool:
        """Sends or queues one message; False when it was dropped (backlog full)."""
        prefix = channel_prefix(dp_rank, rank_epoch, rank_seq)
        sock = self._sock
        if sock is not None and not self._backlog and len(prefix) + len(payload) <= PACKET_BYTES:
            try:  # the fast path: one system call, the payload not copied
                sock.sendmsg([WHOLE, prefix, payload], (), _SEND_FLAGS)
            except BlockingIOError:
                self._backlog.append((WHOLE, prefix + payload))
                return True
            except OSError:  # EPIPE, ECONNRESET: the fan-in went away
                self._reset()
                self.dropped += 1
                return False
            self.sent += 1
            return True
        packets = message_packets(prefix + payload)
        if len(self._backlog) + len(packets) > self.limit and self._backlog:
            self.dropped += 1
            return False
        self._backlog.extend(packets)
        self.flush(INLINE_FLUSH_PACKETS + len(packets))
        return True

    def flush(self, max_packets: int | None = None) -> None:
        """Moves the backlog into the socket until it would block (or ``max_packets``)."""
        backlog = self._backlog
        if not backlog:
            return
        sock = self._sock
        if sock is None:
            if time.monotonic() < self._next_try or not self._connect():
                return
            sock = self._sock
            assert sock is not None
        budget = len(backlog) if max_packets is None else max_packets
        while backlog and budget > 0:
            flag, body = backlog[0]
            try:
                sock.sendmsg([flag, body], (), _SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError:
                self._reset()
                return
            backlog.popleft()
            budget -= 1
            if flag != MORE:
                self.sent += 1

    def service(self) -> None:
        """Sender thread, owning the socket: reconnects, notices a fan-in that went away,
        moves the backlog on."""
        sock = self._sock
        if sock is None:
            if time.monotonic() >= self._next_try:
                self._connect()
        else:
            try:
                data = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except BlockingIOError:
                data = None  # connected; the fan-in never writes
            except OSError:
                data = b""
            if data is not None and not data:  # end of file: the fan-in closed or died
                self._reset()
                self._connect()
        self.flush()

    def reconnections(self) -> int:
        """Connections since the last call that need a resync (see the module doc)."""
        due, self._resyncs_due = self._resyncs_due, 0
        return due

    def close_socket(self, linger_ms: int = 0) -> None:
        """Moves what the socket takes now, then closes without waiting (the caller gives
        the backlog its time first, see ``RankPublisher.shutdown``); packets already in
        the socket stay deliverable (the kernel keeps them).  What is left is dropped and
        counted.  ``linger_ms`` is accepted for the ZMQ pusher's signature."""
        del linger_ms
        self.flush()
        self.dropped += sum(1 for flag, _ in self._backlog if flag != MORE)
        self._backlog.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# --------------------------------------------------------------------------- fan-in side


class _Connection:
    __slots__ = ("partial", "sock", "too_big")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.partial: bytearray | None = None
        self.too_big = False


class PacketListener:
    """Fan-in side: the listening socket and the ranks' connections, all non-blocking."""

    def __init__(self, endpoint: str, max_connections: int = 1024) -> None:
        self.path = packet_path(endpoint)
        self.max_connections = max(1, max_connections)
        self.refused = 0  # connections closed at once: over max_connections or out of descriptors
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a previous fan-in's socket file (its directory is private)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            sock.listen(self.max_connections)
            self._identity = _file_identity(self.path)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.sock = sock
        self.connections: dict[int, _Connection] = {}
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY)  # see accept()

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> list[int]:
        """Every pending connection; their file descriptors, to poll.  Beyond
        ``max_connections``, or with no descriptor left, a connection is accepted and closed
        at once (the rank retries): left pending it would keep the listener readable and
        the loop spinning."""
        fresh: list[int] = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return fresh
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or self._spare is None:
                    raise
                os.close(self._spare)  # the classic way out: free one descriptor, shed, take it back
                self._spare = None
                with contextlib.suppress(OSError):
                    self.sock.accept()[0].close()
                    self.refused += 1
                with contextlib.suppress(OSError):
                    self._spare = os.open(os.devnull, os.O_RDONLY)
                return fresh
            if len(self.connections) >= self.max_connections:
                conn.close()
                self.refused += 1
                continue
            conn.setblocking(False)
            self.connections[conn.fileno()] = _Connection(conn)
            fresh.append(conn.fileno())

    def read(self, fd: int, limit: int) -> tuple[list[bytes | WireError], bool]:
        """Up to ``limit`` packets of connection ``fd``: complete messages (or the error of a
        bad one) in order, and whether the connection closed (then it is forgotten)."""
        conn = self.connections[fd]
        out: list[bytes | WireError] = []
        for packet in self._packets(conn, limit):
            if packet is None:
                self._close(fd)
                return out, True
            message = self._assemble(conn, packet)
            if message is not None:
                out.append(message)
        return out, False

    def _packets(self, conn: _Connection, limit: int) -> Iterator[bytes | None]:
        recv = conn.sock.recv
        for _ in range(limit):
            try:
                packet = recv(PACKET_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                packet = b""
            yield packet or None  # b"": end of file

    def _assemble(self, conn: _Connection, packet: bytes) -> bytes | WireError | None:
        flag, body = packet[:1], packet[1:]
        if flag == WHOLE:
            if conn.partial is not None:  # cannot happen from our pusher: drop the piece
                conn.partial, conn.too_big = None, False
                return WireError("bad channel packet", "a whole message inside a cut one")
            return body
        if flag not in (MORE, LAST):
            return WireError("bad channel packet", f"flag {flag!r}")
        if conn.partial is None:
            conn.partial = bytearray()
        if not conn.too_big:
            conn.partial += body
            conn.too_big = len(conn.partial) > MAX_MESSAGE_BYTES
        if flag == MORE:
            return None
        message, too_big = conn.partial, conn.too_big
        conn.partial, conn.too_big = None, False
        if too_big:
            return WireError("channel message too large", f"> {MAX_MESSAGE_BYTES} bytes")
        return bytes(message)

    def _close(self, fd: int) -> None:
        conn = self.connections.pop(fd, None)
        if conn is not None:
            conn.sock.close()

    def close(self) -> None:
        # The listening socket and its file first: a rank whose connection the loop below
        # closes reconnects at once, and a listener still open would take that connection
        # into its queue (a SEQPACKET connect completes there), reset it a moment later, and
        # the rank would count a reconnection - and request a resync - for a fan-in already
        # gone, besides the one for the fan-in that comes next.
        self.sock.close()
        with contextlib.suppress(OSError):
            if _file_identity(self.path) == self._identity:  # not a newer fan-in's socket
                os.unlink(self.path)
        for fd in list(self.connections):
            self._close(fd)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None


def _file_identity(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino
