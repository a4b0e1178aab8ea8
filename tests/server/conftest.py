"""The real-server tier (marker ``server``): fixtures shared by its modules.

Servers are expensive (20-40 s to start on a quiet 2-core machine, minutes under load), so
each module starts its servers once (module-scoped fixtures) and runs its checks in order
against them.  The launcher is ``bench/sglang_server.py`` (shared with bench/); the CPU
stand-ins it puts on the server's PYTHONPATH are ``bench/cpu_shims`` (README there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import e2e_checks as checks  # noqa: E402  (tests/e2e_checks.py)
import sglang_server  # noqa: E402  (bench/sglang_server.py)
from conftest import free_port_block  # noqa: E402  (tests/conftest.py)
from npu.npu_engine import StreamRecorder  # noqa: E402  (tests/npu: a plain SUB on the stream)

SERVER_MODULES = sglang_server.SERVER_MODULES


def _missing() -> list[str]:
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing()
    if not missing or os.environ.get("KVPUB_REQUIRE_SGLANG") == "1":
        return
    skip = pytest.mark.skip(reason=f"real-server tier needs {', '.join(missing)} (.ci/requirements-server.txt)")
    for item in items:
        if "server" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sglang_server.make_model_dir(tmp_path_factory.mktemp("model"))


def start_server(model: Path, log_dir: Path, **spec: Any) -> sglang_server.Server:
    """A started server with ports from tests/conftest.py's helpers."""
    dp_size = int(spec.get("dp_size", 2))
    server_spec = sglang_server.ServerSpec(
        model_path=model,
        log_path=log_dir / "server.log",
        shim_dir=sglang_server.cpu_shim_dir(),
        http_port=free_port_block(1),
        kv_port=free_port_block(dp_size),
        replay_port=free_port_block(dp_size),
        **spec,
    )
    return sglang_server.Server(server_spec).start(timeout_s=900.0)


class Adapter:
    """``motor-kv-adapter serve`` as a subprocess (the real console entry point's module)."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "motor_adapter.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = log_path
        deadline = time.monotonic() + 60.0
        while True:
            assert self.proc.poll() is None, f"adapter exited\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"adapter not up\n{log_path.read_text()[-3000:]}"
            time.sleep(0.1)  # polling readiness with a deadline

    def call(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def adapter_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Adapter] = []

    def make(log_path: Path) -> Adapter:
        made.append(Adapter(log_path))
        return made[-1]

    yield make
    for adapter in made:
        adapter.stop()


@dataclass
class PluginRig:
    """One real server with ``--plugin sglang_kvpub``, a plain SUB on its instance stream, and
    ``motor-kv-adapter serve`` registered for it as Motor registers a fanned-in instance."""

    server: sglang_server.Server
    recorder: StreamRecorder
    adapter: Adapter
    log_dir: Path
    instance: str
    model: str
    page: int
    core: str

    def select(self, token_ids: list[int]) -> dict[str, Any]:
        """The adapter's ``/select`` over this one instance."""
        body = {"model": self.model, "block_size": self.page, "candidates": [{"instance_id": self.instance, "load": 0}]}
        decision: dict[str, Any] = self.adapter.call("/select", {**body, "token_ids": token_ids})
        return decision

    def until(self, check: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
        """Re-runs ``check`` until it returns a truthy value (polling with a deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f} s\n{self.server.log_tail(30)}"
            time.sleep(0.1)  # polling a condition with a deadline

    def one_stream_carries_every_rank(self, seed: int, dp_size: int, timeout_s: float) -> None:
        """One prompt of 5 full pages pinned to each rank (``dp_rank``); the ONE instance stream
        carries every rank's store, tagged, in increasing seq, with no malformed frame."""
        pinned = {rank: sglang_server.prompt_ids(seed + rank, 5 * self.page + 3) for rank in range(dp_size)}
        for rank, ids in pinned.items():
            assert self.server.generate(ids, dp_rank=rank)["meta_info"]["dp_rank"] == rank

        def stored(stream: Any) -> None:
            checks.check_ranks_in_one_stream(stream, range(dp_size))
            checks.check_seq_increasing(stream)
            for rank, ids in pinned.items():
                assert checks.check_prompt_on_rank(stream, ids, rank, self.page) == 5

        self.recorder.wait_for(stored, timeout=timeout_s)
        assert self.recorder.errors == 0

    def kill9_seen_dead(self, token_ids: list[int], timeout_s: float) -> None:
        """``kill -9`` of the server once the adapter holds ``token_ids``: the adapter marks the
        instance dead (every stream disconnected) and drops its blocks, and logs so."""
        self.until(lambda: self.select(token_ids)["policy"] == checks.POLICY_AFFINITY, "the adapter's hit")
        self.server.kill9()
        assert not self.server.alive()

        def dead() -> bool:
            workers = self.adapter.call("/workers")["workers"]
            healths = [h for w in workers for hs in w["health"].values() for h in hs]
            return bool(healths) and not any(h["connected"] for h in healths)

        self.until(dead, "the instance marked dead", timeout_s)
        self.until(
            lambda: self.select(token_ids)["policy"] == checks.POLICY_LOAD_BALANCE, "its blocks dropped", timeout_s
        )
        assert "marked dead, its blocks dropped" in (self.log_dir / "adapter.log").read_text()

    def quiet(self) -> None:
        """Waits until two instance heartbeats followed the last request: the ranks' flushes
        (each request's events, then the idle flush) have passed the fan-in."""
        start = self.recorder.last_seq()
        self.until(
            lambda: sum(1 for seq, b in self.recorder.snapshot() if seq > start and not b.events) >= 2,
            "two heartbeats",
            120.0,
        )


@contextlib.contextmanager
def plugin_rig(
    model: Path,
    log_dir: Path,
    *,
    instance: str,
    model_name: str,
    page: int,
    dp_size: int,
    tree_core: str = "rust",
    extra_args: Sequence[str] = (),
    started: Callable[[sglang_server.Server], None] | None = None,
    kv_events_extra: dict[str, Any] | None = None,
) -> Iterator[PluginRig]:
    """The server (heartbeats every 0.2 s, 4096 tokens per rank), the recorder and the adapter;
    all stopped on exit.  ``started(server)``: called once the server is up (e.g. to report);
    ``kv_events_extra``: more ``--kv-events-config`` keys."""
    server = start_server(
        model,
        log_dir,
        plugin=True,
        tree_core=tree_core,
        page_size=page,
        dp_size=dp_size,
        max_total_tokens=4096,
        kv_events_extra={"heartbeat_s": 0.2, **(kv_events_extra or {})},
        extra_args=tuple(extra_args),
    )
    if started is not None:
        started(server)
    recorder = StreamRecorder(server.spec.stream_endpoint, sglang_server.TOPIC)
    adapter = None
    try:
        adapter = Adapter(log_dir / "adapter.log")
        registered = adapter.call(
            "/register",
            {
                "instance_id": instance,
                "dp_rank": 0,
                "medium_endpoints": {"npu": server.spec.stream_endpoint},
                "replay_endpoint": f"tcp://127.0.0.1:{server.spec.replay_port}",
                "type": "sglang",
                "modelname": model_name,
                "block_size": page,
                "fanned_in": True,
                "dp_size": dp_size,
            },
        )
        assert registered["status"], registered
        yield PluginRig(server, recorder, adapter, log_dir, instance, model_name, page, tree_core)
    finally:
        if adapter is not None:
            adapter.stop()
        recorder.close()
        server.stop()
