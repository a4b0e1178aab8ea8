"""One reader thread for every KV-event stream of the process.

A thread per stream does not scale: at a hundred dp-16 instances each thread is woken ~32
times a second and most of the process's time goes to threads giving up and winning back
the GIL (docs/operations.md, "Scale").  Here ONE thread owns one :class:`zmq.Poller` over
every stream's SUB socket and a wake-up socket; each wake it lets every readable stream
read a bounded number of messages and apply what is in order, then gives the GIL back in
the next poll.  Work that blocks on the network (a replay or snapshot fetch) never runs
here: the stream hands it to a thread of its own (see ``motor_adapter.stream``).

Sockets are opened, polled and closed on this thread only (ZMQ sockets are not
thread-safe): a stream asks for that through :meth:`IngestReader.attach` and
:meth:`IngestReader.detach`, which run its ``_reader_open``/``_reader_close`` here.  The
thread starts with the first stream and ends after the last one has been detached.

Why a thread and not the aiohttp event loop's own FD watchers: ingest on the loop would
put every batch's decode and index write between two ``/query`` answers; on its own
thread the interpreter interleaves them every few milliseconds at most (the GIL's switch
interval) and the loop's latency does not grow with the batch rate (bench/scale.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, Union

import zmq

from sglang_kvpub.core.ratelimit import RateLimitedLog

__all__ = ["IngestReader", "ReaderClient", "shared_reader"]

log = logging.getLogger(__name__)

# How long one poll may sleep: liveness and stop requests are looked at this often.
TICK_S = 0.05
# Wakes at most this often while no stream has a backlog: each wake then reads several
# batches (a dp-16 instance sends ~32 a second), the poll's cost is paid ~500 times a second
# rather than once per batch, and the GIL goes to the HTTP loop in between.  It adds at most
# this much to the ingest lag.
COALESCE_S = 0.002


class ReaderClient(Protocol):
    """What the reader calls on a stream, always on its own thread."""

    def _reader_open(self, reader: IngestReader) -> None: ...
    def _reader_readable(self) -> bool: ...
    def _reader_tick(self, now: float) -> None: ...
    def _reader_close(self) -> None: ...


_Command = tuple[str, ReaderClient, threading.Event]


class IngestReader:
    """The thread and its poller; streams attach and detach themselves."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._commands: collections.deque[_Command] = collections.deque()
        self._thread: threading.Thread | None = None
        self._clients: list[ReaderClient] = []
        self._handlers: dict[Any, Callable[[], bool]] = {}  # socket -> what reads it
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self.wakes = 0  # poll returns (for the bench and tests)
        self.handler_errors = 0  # a stream's handler raised (contained, counted, logged rate-limited)
        self._rlog = RateLimitedLog(log)

    # ------------------------------------------------------------------ any thread

    def attach(self, client: ReaderClient) -> threading.Event:
        """Queues ``client`` to be opened on the reader thread; the event is set once it was."""
        return self._command("attach", client)

    def detach(self, client: ReaderClient) -> threading.Event:
        """Queues ``client`` to be closed on the reader thread; the event is set once it was."""
        return self._command("detach", client)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _command(self, kind: str, client: ReaderClient) -> threading.Event:
        done = threading.Event()
        with self._lock:
            self._commands.append((kind, client, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-ingest-reader", daemon=True)
                self._thread.start()
        self._wake()
        return done

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full of wake-ups already: the reader will look
            self._wake_w.send(b"\0")

    # ------------------------------------------------------------------ reader thread only

    def watch(self, sock: zmq.Socket[bytes], on_readable: Callable[[], bool]) -> None:
        """``on_readable()`` reads a bounded amount; True: it left batches behind (read again now)."""
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = on_readable

    def unwatch(self, sock: zmq.Socket[bytes]) -> None:
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def _run(self) -> None:
        next_tick = time.monotonic() + TICK_S
        backlog = False
        while True:
            if not self._run_commands():
                return
            if not backlog:
                time.sleep(COALESCE_S)  # let batches gather (see COALESCE_S)
            timeout = max(0.0, next_tick - time.monotonic())
            ready = self._poller.poll(int(timeout * 1000) + 1)
            self.wakes += 1
            backlog = False
            for sock, _ in ready:
                handler = self._handlers.get(sock)
                if handler is not None:
                    backlog = self._guard(handler) or backlog
                elif sock == self._wake_r.fileno():
                    self._drain_wakes()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                for client in self._clients:
                    self._guard(client._reader_tick, now)

    def _run_commands(self) -> bool:
        """Opens and closes what was asked; False when the thread should end (nothing left)."""
        while True:
            with self._lock:
                if not self._commands:
                    if self._clients:
                        return True
                    self._thread = None  # the next attach starts a new one
                    return False
                kind, client, done = self._commands.popleft()
            try:
                if kind == "attach":
                    self._clients.append(client)
                    self._guard(client._reader_open, self)
                elif client in self._clients:
                    self._clients.remove(client)
                    self._guard(client._reader_close)
            finally:
                done.set()

    def _drain_wakes(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _guard(self, call: Callable[..., Any], *args: Any) -> bool:
        try:
            return bool(call(*args))
        except Exception as exc:  # one stream's bug must not stop every other stream
            self.handler_errors += 1
            name = getattr(call, "__qualname__", repr(call))
            self._rlog.warning(f"handler:{name}", "ingest reader: %s failed: %r", name, exc)
            log.debug("ingest reader: handler failure", exc_info=True)
            return False


_shared: Union[IngestReader, None] = None
_shared_lock = threading.Lock()


def shared_reader() -> IngestReader:
    """The process's reader (a forked child gets its own)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.pid != os.getpid():
            _shared = IngestReader()
        return _shared
