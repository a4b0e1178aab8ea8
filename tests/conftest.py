"""Shared fixtures: free loopback endpoints and private ipc directories.

Tests never use fixed ports: several suites (and developers) run at once on one machine.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Below Linux's ephemeral range (32768-60999): outgoing connections of concurrent tests never
# take these ports between the moment one is handed out and the moment it is bound.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()
_rng = random.Random()  # private: hypothesis seeds the global one per example


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """A base port whose next ``count`` ports are free and not handed out before in this process."""
    for _ in range(2000):
        base = _rng.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        block = range(base, base + count)
        if _handed_out.isdisjoint(block) and all(_bindable(port) for port in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no block of {count} free ports")


def free_tcp_port() -> int:
    return free_port_block(1)


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"


@pytest.fixture(autouse=True, scope="session")
def private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``motor-kv-adapter serve`` keeps registrations under ``$XDG_STATE_HOME`` by default: every
    adapter a test starts (subprocesses inherit it) writes into a temporary directory, never the
    user's own state."""
    path = tmp_path_factory.mktemp("xdg-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(path))
        yield path


@pytest.fixture
def tcp_endpoint() -> Callable[[], str]:
    return free_tcp_endpoint


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ipc"
    path.mkdir()
    yield path


@pytest.fixture(autouse=True)
def _fresh_plugin_guard() -> Iterator[None]:
    """A feature a test switched off (sglang_kvpub/engine/guard.py, process-wide) stays off only there."""
    from sglang_kvpub.engine import guard

    guard.reset()
    yield
    guard.reset()
