"""A failed rank registration is told to the decode (sglang_kvpub/engine/pd_register.py).

Real sockets on loopback: a real HTTP server that records registrations as SGLang's bootstrap
server does (and can answer the first ones with an error), a listener that accepts and never
answers, a closed port.  The decode of a failed request asks the bootstrap server for the
room's rank; the lane registers the room with ``FAILED_RANK``, which SGLang's decode fails at
once (``tests/pd/test_pd_faults.py`` shows that with real processes).  No timing asserts.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_kvpub.engine.pd_register import FAILED_RANK, Registrar
from sglang_kvpub.tools.ports import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class _Bootstrap(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, errors: int = 0) -> None:
        self.rooms: dict[int, int] = {}
        self.errors = errors  # the first this many POSTs are answered 503
        self.changed = threading.Condition()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def wait_for(self, room: int) -> int:
        with self.changed:
            self.changed.wait_for(lambda: room in self.rooms)
            return self.rooms[room]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Bootstrap
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.changed:
            status = 503 if self.server.errors > 0 else 200
            self.server.errors -= 1
            if status == 200:
                self.server.rooms[int(data["bootstrap_room"])] = int(data["dp_rank"])
                self.server.changed.notify_all()
        body = b"OK" if status == 200 else b"busy"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def bootstrap(errors: int = 0) -> Iterator[_Bootstrap]:
    server = _Bootstrap(errors)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[str, threading.Event]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.1)
    accepted = threading.Event()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(sock.accept()[0])
                accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        sock.close()


def _failures() -> tuple[dict[int, str], Any]:
    messages: dict[int, str] = {}

    def of(room: int) -> Any:
        return lambda message: messages.__setitem__(room, message)

    return messages, of


def _until(predicate: Any) -> None:
    event = threading.Event()
    while not predicate():
        event.wait(0.01)


def test_an_http_error_fails_the_request_and_tells_its_decode() -> None:
    registrar = Registrar()
    messages, of = _failures()
    with bootstrap(errors=1) as server:
        registrar.submit(server.address, 7, 1, of(7))
        # The decode's view: the room's rank is one no prefill has.
        assert server.wait_for(7) == FAILED_RANK
    assert "http_error" in messages[7] and "HTTP 503" in messages[7], messages
    _until(lambda: registrar.stats()["decode_told"] == 1)
    assert registrar.stats()["failed"] == {"http_error": 1}


def test_a_full_queue_fails_the_request_and_tells_its_decode() -> None:
    """The right bootstrap server answers; the queue is full of registrations for a silent one."""
    registrar = Registrar(timeout_s=30.0, max_pending=1)
    messages, of = _failures()
    with silent_listener() as (silent, accepted), bootstrap() as server:
        registrar.submit(silent, 1, 0, of(1))
        accepted.wait()  # in flight
        registrar.submit(silent, 2, 0, of(2))  # pending: 1 of 1
        registrar.submit(server.address, 3, 1, of(3))  # refused at once, on the caller's thread
        assert "queue_full" in messages[3], messages
        assert server.wait_for(3) == FAILED_RANK
        assert 1 not in messages and 2 not in messages  # the silent ones still wait
        _until(lambda: registrar.stats()["decode_told"] == 1)


def test_a_notice_the_address_does_not_take_is_counted() -> None:
    registrar = Registrar()
    messages, of = _failures()
    refused = f"127.0.0.1:{free_port()}"
    registrar.submit(refused, 5, 0, of(5))
    _until(lambda: registrar.stats()["decode_not_told"] == {"unreachable": 1})
    assert "unreachable" in messages[5]
    assert registrar.stats()["decode_told"] == 0


def test_without_a_lane_free_the_decode_is_not_told_and_that_is_counted() -> None:
    registrar = Registrar(timeout_s=30.0, max_lanes=1)
    messages, of = _failures()
    with silent_listener() as (silent, accepted), bootstrap() as server:
        registrar.submit(silent, 1, 0, of(1))
        accepted.wait()
        registrar.submit(server.address, 2, 0, of(2))  # a second address: over the lanes' bound
        assert "queue_full" in messages[2]
        assert registrar.stats()["decode_not_told"] == {"no_lane": 1}
        assert 2 not in server.rooms
