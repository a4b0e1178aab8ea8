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


@pytest.fixture(scope="session")
def exported_metrics(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ``/metrics`` text of a real ``motor-kv-adapter serve`` (registry on a real etcd, so the
    replica series are there too) following one real instance stream (tests/stream_publisher.py)
    after a ``/query`` and an unregistered ``/query``: what an operator's Prometheus scrapes,
    every family the adapter exports present.  Skips without etcd (fails where CI requires it)."""
    from fanin.test_stream import Pub
    from registry_procs import AdapterProcess, EtcdServer, http, require_etcd, wait_for

    tmp = tmp_path_factory.mktemp("exported-metrics")
    etcd = EtcdServer(require_etcd(), tmp / "etcd-data", tmp / "etcd.log")
    adapter = AdapterProcess(f"etcd://127.0.0.1:{etcd.client_port}/metrics-test", tmp / "adapter.log")
    endpoint, replay = free_tcp_endpoint(), free_tcp_endpoint()
    pub = Pub(endpoint, replay, "--heartbeat", "0.05")
    try:
        etcd.start()
        adapter.start()
        registration = {
            "instance_id": "vllm-prefill-0",
            "dp_rank": 0,
            "medium_endpoints": {"npu": endpoint},
            "replay_endpoint": replay,
            "type": "sglang",
            "modelname": "m",
            "block_size": 4,
            "fanned_in": True,
            "dp_size": 2,
        }
        status, body = http(adapter.url + "/register", registration)
        assert status == 200, body
        pub.cmd("store", rank=1, hashes=[1, 2, 3])
        wait_for(lambda: http(adapter.url + "/ready")[0] == 200, "the adapter ready")
        for model in ("m", "nobody-registered-this"):
            status, body = http(adapter.url + "/query", {"model": model, "block_size": 4, "token_ids": list(range(16))})
            assert status in (200, 404), body
        status, text = http(adapter.url + "/metrics")
        assert status == 200 and isinstance(text, str), text
        return text
    finally:
        pub.close()
        adapter.stop()
        etcd.stop()


def metric_names(exposition: str) -> set[str]:
    """Every family (``# TYPE``) and sample name of a Prometheus text exposition."""
    import re

    names = set(re.findall(r"^# (?:TYPE|HELP) ([a-zA-Z_:][a-zA-Z0-9_:]*)", exposition, re.M))
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", exposition, re.M))
    return names
