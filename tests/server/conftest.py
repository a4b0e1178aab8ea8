"""The real-server tier (marker ``server``): fixtures shared by its modules.

Servers are expensive (20-40 s to start on a quiet 2-core machine, minutes under load), so
each module starts its servers once (module-scoped fixtures) and runs its checks in order
against them.  The launcher is ``bench/sglang_server.py`` (shared with bench/); the CPU
stand-ins it puts on the server's PYTHONPATH are ``bench/cpu_shims`` (README there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import sglang_server  # noqa: E402  (bench/sglang_server.py)
from conftest import free_port_block  # noqa: E402  (tests/conftest.py)

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
