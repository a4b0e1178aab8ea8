"""The PD prefill's rank registration off the scheduler thread (sglang_kvpub/engine/pd_register.py).

Real sockets on loopback: a real HTTP server that records registrations as SGLang's bootstrap
server does, a listener that accepts and never answers (a stalled or wrong bootstrap server),
a closed port.  No timing asserts: ordering is read from events.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_kvpub.engine.pd_register import Registrar
from sglang_kvpub.tools.ports import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class _Bootstrap(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        self.rooms: dict[int, int] = {}
        self.status = status
        self.arrived = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Bootstrap
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.status == 200:
            self.server.rooms[int(data["bootstrap_room"])] = int(data["dp_rank"])
        body = b"OK" if self.server.status == 200 else b"bad request"
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.arrived.set()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def bootstrap(status: int = 200) -> Iterator[_Bootstrap]:
    server = _Bootstrap(status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[str, threading.Event]]:
    """Accepts connections and never answers; the event is set once one was accepted."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted = threading.Event()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = sock.accept()
                held.append(conn)
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


class Failures:
    def __init__(self) -> None:
        self.messages: dict[int, str] = {}
        self.done = threading.Event()
        self.expected = 1

    def of(self, room: int) -> Any:
        def on_failure(message: str) -> None:
            self.messages[room] = message
            if len(self.messages) >= self.expected:
                self.done.set()

        return on_failure


def _wait(predicate: Any) -> None:
    event = threading.Event()
    while not predicate():
        event.wait(0.01)


def test_every_registration_reaches_the_bootstrap_server_and_the_caller_never_waits() -> None:
    registrar = Registrar()
    registrar.start()  # as the hook's installation does: no submit starts a thread
    failures = Failures()
    with bootstrap() as server:
        for room in range(200):
            registrar.submit(server.address, room, room % 2, failures.of(room))
        _wait(lambda: registrar.stats()["registered"] == 200)
    assert server.rooms == {room: room % 2 for room in range(200)}
    stats = registrar.stats()
    assert stats["failed"] == {} and stats["pending"] == 0 and failures.messages == {}
    assert stats["submitted"] == 200 and stats["lanes"] == 1


def test_a_silent_bootstrap_address_delays_only_its_own_requests_and_fails_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's wrong bootstrap host that accepts and never answers, then a good request."""
    registrar = Registrar(timeout_s=2.0)
    failures = Failures()
    failures.expected = 3
    with silent_listener() as (silent, accepted), bootstrap() as server, caplog.at_level(logging.INFO):
        for room in (1, 2, 3):  # three bad ones on one lane
            registrar.submit(silent, room, 0, failures.of(room))
        accepted.wait()
        registrar.submit(server.address, 10, 1, failures.of(10))
        server.arrived.wait()
        # The good registration landed while the bad ones were still pending.
        _wait(lambda: registrar.stats()["registered"] == 1)
        assert not failures.done.is_set() and server.rooms == {10: 1}
        failures.done.wait()
    assert sorted(failures.messages) == [1, 2, 3]
    assert all("timeout" in m and silent in m for m in failures.messages.values()), failures.messages
    assert registrar.stats()["failed"] == {"timeout": 3}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    # One line for the three failed registrations; telling their decode through the same
    # silent address may fail too, which is its own kind, logged once as well.
    registering = [m for m in errors if "registering the prefill DP rank" in m]
    assert len(registering) == 1 and "logged once per cause" in registering[0], errors
    telling = [m for m in errors if "telling the decode" in m]
    assert len(telling) <= 1 and len(errors) == len(registering) + len(telling), errors


def test_a_refused_address_fails_fast_and_an_http_error_fails_only_its_request() -> None:
    registrar = Registrar()
    failures = Failures()
    refused = f"127.0.0.1:{free_port()}"  # nothing listens there
    registrar.submit(refused, 5, 0, failures.of(5))
    failures.done.wait()
    assert "unreachable" in failures.messages[5]
    failures = Failures()
    failures.expected = 2
    with bootstrap(status=500) as server:
        registrar.submit(server.address, 6, 0, failures.of(6))
        registrar.submit(server.address, 7, 0, failures.of(7))
        failures.done.wait()
    assert all("HTTP 500" in failures.messages[r] for r in (6, 7))
    assert registrar.stats()["failed"] == {"unreachable": 1, "http_error": 2}


def test_the_queue_is_bounded_and_a_refused_registration_fails_at_once() -> None:
    registrar = Registrar(timeout_s=30.0, max_pending=1, max_lanes=1)
    failures = Failures()
    with silent_listener() as (silent, accepted):
        registrar.submit(silent, 1, 0, failures.of(1))
        accepted.wait()  # room 1 is in flight, no longer pending
        registrar.submit(silent, 2, 0, failures.of(2))  # pending: 1 of 1
        registrar.submit(silent, 3, 0, failures.of(3))  # over the bound
        assert "queue_full" in failures.messages[3] and 2 not in failures.messages
        registrar.submit("127.0.0.1:1", 4, 0, failures.of(4))
        assert "queue_full" in failures.messages[4]
        assert registrar.stats()["failed"] == {"queue_full": 2}
