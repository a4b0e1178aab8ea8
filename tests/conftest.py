"""Shared fixtures and helpers: free loopback endpoints, private ipc directories, a ZMQ context,
polling a real condition, and an adapter state fed by hand.

Tests never use fixed ports: several suites (and developers) run at once on one machine.
Imports of ``motor_adapter`` stay inside the helpers: the README's clean venv collects every
test module without the router's extra.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq

from sglang_kvpub.tools.ports import free_port as free_tcp_port
from sglang_kvpub.tools.ports import free_port_block

if TYPE_CHECKING:
    from motor_adapter.affinity import KvAffinity
    from motor_adapter.settings import ServiceConfig
    from motor_adapter.state import AdapterState
    from sglang_kvpub.wire import LoadReport

__all__ = [
    "free_port_block",
    "free_tcp_endpoint",
    "free_tcp_port",
    "load_report",
    "offline_adapter",
    "offline_state",
    "wait_for",
]


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Polls a real condition until it holds and returns its value (another process's state
    gives no event to wait on); fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # polling a condition with a deadline
    raise AssertionError(f"timed out waiting for {what}")


def offline_state(config: ServiceConfig) -> AdapterState:
    """The adapter's state with affinities that subscribe to nothing: the test applies events
    and rank loads to ``affinity.index`` / ``affinity.loads`` itself."""
    from motor_adapter.affinity import KvAffinity, NoSubscriber
    from motor_adapter.state import AdapterState

    return AdapterState(config, affinity_factory=lambda c, cap: KvAffinity(c, cap, subscriber_factory=NoSubscriber))


def offline_adapter(
    config: ServiceConfig, instances: Sequence[tuple[str, str]], block_size: int, model: str = "m"
) -> tuple[AdapterState, KvAffinity]:
    """``offline_state`` with each ``(instance_id, endpoint)`` registered as Motor registers it
    (``type: vLLM``, ``dp_rank`` 0), and the one affinity they share for ``model``."""
    from motor_adapter.registration import parse_registration

    state = offline_state(config)
    for instance_id, endpoint in instances:
        body = {"instance_id": instance_id, "endpoint": endpoint, "type": "vLLM", "dp_rank": 0}
        state.register(parse_registration({**body, "modelname": model, "block_size": block_size}))
    affinity = state.affinity(model, "default", block_size)
    assert affinity is not None
    return state, affinity


def load_report(loads: Sequence[float]) -> LoadReport:
    """A rank-load report as the adapter receives one: rank ``r`` with ``loads[r]`` tokens
    queued and one request running, through the wire codec both ways."""
    from sglang_kvpub import wire

    figures = wire.RankLoads([wire.RankLoad(r, v, 1) for r, v in enumerate(loads)], {}, 0.1)
    codec = wire.LoadReportCodec()
    report = codec.decode(codec.encode(1.0, figures))
    assert report is not None
    return report


@pytest.fixture
def native_renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per answer the C renderer renders from here on (``rank_render.NATIVE`` behind
    a counting stand-in); the test is skipped where the renderer is not built."""
    from motor_adapter import rank_render

    native = rank_render.NATIVE
    if native is None:
        pytest.skip("the C renderer is not built (or KVPUB_NATIVE=0)")
    renders: list[int] = []

    class Counting:
        @staticmethod
        def rank_answer(*args: Any) -> Any:
            renders.append(1)
            return native.rank_answer(*args)

    monkeypatch.setattr(rank_render, "NATIVE", Counting)
    return renders


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
def zctx() -> Iterator[zmq.Context[Any]]:
    """A ZMQ context for the test, destroyed after it (lingering sockets dropped)."""
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


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
