"""Shared fixtures: free loopback endpoints and private ipc directories.

Tests never use fixed ports: several suites (and developers) run at once on one machine.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def free_port_block(count: int) -> int:
    """A base port whose next ``count`` ports are free (for base+rank layouts)."""
    for _ in range(200):
        base = free_tcp_port()
        if base + count >= 65535:
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {count} free ports")


@pytest.fixture
def tcp_endpoint() -> Callable[[], str]:
    return free_tcp_endpoint


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ipc"
    path.mkdir()
    yield path
