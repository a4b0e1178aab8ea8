"""Loopback ports for servers the tests, benches and demo start (sglang_kvpub/tools/ports.py).

The regression behind it: a readiness probe connecting to a port inside the ephemeral range
before the server listened was given that same port as its source port, TCP connected the
socket to itself, and the probe read its own ``GET /health HTTP/1.1`` back as the status line
(``http.client.BadStatusLine``), which failed the whole e2e module in CI.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_kvpub.tools import demo, ports

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import sglang_server  # noqa: E402  (bench/sglang_server.py)

pytestmark = pytest.mark.unit

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _with_range_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "ip_local_port_range"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", path)


@pytest.mark.skipif(not RANGE_FILE.exists(), reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_ports_are_picked_outside_this_machines_ephemeral_range() -> None:
    low, high = (int(part) for part in RANGE_FILE.read_text().split())
    start, stop = ports.port_range()
    assert stop <= low or start > high
    for _ in range(50):
        base = ports.free_port_block(4)
        assert all(not low <= port <= high for port in range(base, base + 4))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", (20000, 32768)),  # Linux's default: below it
        ("10000 60999", (61000, 65536)),  # no room below: above it
        ("1024 65000", (1024, 65536)),  # no room outside: anywhere, the bind check decides
        ("garbage", (20000, 32768)),  # unreadable: Linux's default assumed
        (None, (20000, 32768)),  # no such file
    ],
)
def test_the_range_follows_the_kernels_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None, expected: tuple[int, int]
) -> None:
    _with_range_file(monkeypatch, tmp_path, text)
    assert ports.port_range() == expected


def test_blocks_bind_and_are_never_handed_out_twice() -> None:
    seen: set[int] = set()
    for count in (1, 2, 4, 8) * 10:
        base = ports.free_port_block(count)
        block = set(range(base, base + count))
        assert seen.isdisjoint(block)
        seen |= block
        held = []
        try:
            for port in block:
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        finally:
            for sock in held:
                sock.close()


def test_an_exhausted_or_too_small_range_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ports.free_port_block(4)  # handed out: never again in this process
    monkeypatch.setattr(ports, "port_range", lambda: (base, base + 4))
    with pytest.raises(RuntimeError, match=rf"no block of 2 free loopback ports in \[{base}, {base + 4}\)"):
        ports.free_port_block(2)
    with pytest.raises(ValueError, match="a block of 8 ports does not fit"):
        ports.free_port_block(8)
    with pytest.raises(ValueError, match="a block of 0 ports"):
        ports.free_port_block(0)


@pytest.fixture
def echo_listener() -> Iterator[int]:
    """A listener that sends every request back: what a self-connected probe reads."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = int(server.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    server.close()
    thread.join(5)


@pytest.fixture
def idle_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait(10)


def test_server_readiness_keeps_polling_through_a_non_http_answer(
    tmp_path: Path, echo_listener: int, idle_process: subprocess.Popen[bytes]
) -> None:
    spec = sglang_server.ServerSpec(model_path=tmp_path, log_path=tmp_path / "server.log", http_port=echo_listener)
    spec.log_path.write_text("")
    server = sglang_server.Server(spec)
    server.proc = idle_process
    with pytest.raises(sglang_server.ServerError, match="not ready within"):
        server._wait_ready(1.5)


def test_demo_adapter_readiness_keeps_polling_through_a_non_http_answer(
    monkeypatch: pytest.MonkeyPatch, echo_listener: int, idle_process: subprocess.Popen[bytes]
) -> None:
    monkeypatch.setattr(demo, "WAIT_S", 1.5)
    adapter = object.__new__(demo.HttpAdapter)
    adapter.url = f"http://127.0.0.1:{echo_listener}"
    adapter._proc = idle_process
    assert adapter._wait_healthy() is False
