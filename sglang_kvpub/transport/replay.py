"""The one replay client: a DEALER on a replay ROUTER (SGLang 0.5.23's protocol, docs/wire.md).

``sglang-kvpub tail``, the fan-in sidecar (per rank) and the router's stream subscriber all
ask for history through it: a request is ``replay_request_frames(start_seq, snapshot)``, the
answer is ``(seq, payload)`` replies up to an end marker.  The socket is opened on the first
request and kept until :meth:`ReplayClient.close` (a client that gave up on an answer closes
it, so late replies cannot be mistaken for the next answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from sglang_kvpub.transport.curve import CurveClientKeys, apply_client
from sglang_kvpub.wire import ReplayReply, WireError, parse_replay_reply, replay_request_frames

__all__ = ["ReplayClient"]

_POLL_MS = 200


class ReplayClient:
    """Requests history from one replay endpoint; ``curve``: the stream's client keys, if any."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, *, curve: CurveClientKeys | None = None) -> None:
        self.context = context
        self.endpoint = endpoint
        self.curve = curve
        self._socket: zmq.Socket[bytes] | None = None

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The DEALER (opened and connected on first use), e.g. to poll it beside other sockets."""
        if self._socket is None:
            dealer: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            apply_client(dealer, self.curve)
            try:
                dealer.connect(self.endpoint)
            except zmq.ZMQError:
                dealer.close(linger=0)
                raise
            self._socket = dealer
        return self._socket

    def request(self, start_seq: int, *, snapshot: bool = False) -> None:
        """Asks for every batch from ``start_seq`` on (``snapshot``: the current state first)."""
        self.socket.send_multipart(replay_request_frames(start_seq, snapshot=snapshot))

    def recv(self, timeout_ms: int = 0) -> ReplayReply | None:
        """The next reply within ``timeout_ms`` (0: only one already here), or None.

        Raises :class:`~sglang_kvpub.wire.WireError` for a malformed reply (the caller counts
        and skips it; the next reply may be fine)."""
        socket = self.socket
        if timeout_ms > 0 and not socket.poll(timeout_ms):
            return None
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return parse_replay_reply(frames)

    def fetch(
        self,
        start_seq: int,
        *,
        snapshot: bool = False,
        timeout_s: float = 5.0,
        on_bad: Callable[[WireError], None] | None = None,
    ) -> Iterator[tuple[int, bytes]]:
        """``(seq, payload)`` of one answer, until its end marker; TimeoutError when the
        endpoint is silent for ``timeout_s`` (each reply restarts the clock)."""
        self.request(start_seq, snapshot=snapshot)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reply = self.recv(_POLL_MS)
            except WireError as exc:
                if on_bad is not None:
                    on_bad(exc)
                continue
            if reply is None:
                continue
            if reply.is_end:
                return
            deadline = time.monotonic() + timeout_s
            yield reply.seq, reply.payload
        raise TimeoutError(f"no end of replay from {self.endpoint} within {timeout_s}s")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
