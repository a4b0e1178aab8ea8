"""Shared fixtures: free loopback endpoints and private ipc directories.

Tests never use fixed ports: several suites (and developers) run at once on one machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_kvpub.tools.ports import free_port as free_tcp_port
from sglang_kvpub.tools.ports import free_port_block

__all__ = ["free_port_block", "free_tcp_endpoint", "free_tcp_port"]


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
