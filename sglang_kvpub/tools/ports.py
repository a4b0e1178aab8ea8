"""Free loopback ports for the demo, the benches and the tests.

Ports come from below the kernel's ephemeral range. A port from inside it can be taken as the
source port of an outgoing connection between the moment it is handed out and the moment the
server binds it - and a client polling ``127.0.0.1:P`` before the server listens on ``P`` can be
given ``P`` itself as its source port: TCP's simultaneous open then connects the socket to itself,
the client reads back its own ``GET /health`` as the "response", and the port stays held so the
server cannot bind it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_block", "port_range"]

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 20000  # above the well-known and most registered service ports
_MIN_SPAN = 2000
_handed_out: set[int] = set()
_rng = random.Random()  # private: test frameworks seed the global one


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _LINUX_DEFAULT_EPHEMERAL
    return low, high


def port_range() -> tuple[int, int]:
    """``[start, stop)`` to pick from: below the ephemeral range, else above it, else all of it."""
    low, high = _ephemeral_range()
    if low - _LOWEST >= _MIN_SPAN:
        return _LOWEST, low
    if 65536 - (high + 1) >= _MIN_SPAN:
        return high + 1, 65536
    return 1024, 65536  # no room outside: the bind check below is all there is


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int = 1) -> int:
    """A base port whose ``count`` consecutive ports bind now and were not handed out before in
    this process."""
    start, stop = port_range()
    if count < 1 or stop - start <= count:
        raise ValueError(f"a block of {count} ports does not fit in [{start}, {stop})")
    for _ in range(2000):
        base = _rng.randrange(start, stop - count)
        block = range(base, base + count)
        if _handed_out.isdisjoint(block) and all(_bindable(port) for port in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no block of {count} free loopback ports in [{start}, {stop})")


def free_port() -> int:
    return free_port_block(1)
