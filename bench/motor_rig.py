"""What the end-to-end rigs share: real SGLang servers, ``motor-kv-adapter serve`` and Motor's
real coordinator, each in its own process, started side by side and read back from their logs.

:class:`MotorRig` owns the lifecycle (servers started in threads since they are the slow part,
the adapter and Motor meanwhile, then the rig's own registration), a ``/v1/completions``
through Motor, the adapter's HTTP API, and the conditions a test or bench waits for (each with
a deadline, the log tails on failure).  ``bench/e2e_rig.py`` (one plain DP instance) and
``bench/pd_rig.py`` (two PD prefills and a decode) say which servers, which Motor config and how
Motor's controller registers them.  Imports nothing from ``tests/``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import sglang_server

from motor_adapter.tools.motor_coordinator import Coordinator

__all__ = ["MotorRig", "stop_process"]

_Rig = TypeVar("_Rig", bound="MotorRig")


class MotorRig:
    """The base of the rigs.  A subclass sets ``servers``, ``coordinator`` and ``model_name`` in
    its ``__init__`` (after calling this one) and implements :meth:`_register`."""

    servers: Sequence[sglang_server.Server]
    coordinator: Coordinator
    model_name: str

    def __init__(self, work_dir: Path, start_timeout_s: float) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = work_dir
        self.start_timeout_s = start_timeout_s
        self.adapter_port = sglang_server.free_port_block(1)
        self.adapter_log = work_dir / "adapter.log"
        self._adapter: subprocess.Popen[bytes] | None = None
        self.timings: dict[str, float] = {}
        # The adapter's kv_affinity (its serve --config): the engines' rank cost, so both halves agree.
        self.adapter_kv_affinity: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self: _Rig) -> _Rig:
        """Every server (a thread each), the adapter and Motor side by side; then :meth:`_register`."""
        began = time.monotonic()
        failures: list[BaseException] = []

        def start_server(server: sglang_server.Server) -> None:
            try:
                server.start(timeout_s=self.start_timeout_s)
            except BaseException as exc:  # re-raised in the caller's thread
                failures.append(exc)

        threads = [
            threading.Thread(target=start_server, args=(s,), name=f"sglang-start-{n}", daemon=True)
            for n, s in enumerate(self.servers)
        ]
        for thread in threads:
            thread.start()
        try:
            self._start_adapter()
            self.coordinator.start()
            for thread in threads:
                thread.join()
            if failures:
                raise failures[0]
            self.timings["processes_ready_s"] = time.monotonic() - began
            self._register()
        except BaseException:
            for thread in threads:
                thread.join(timeout=5)
            self.stop()
            raise
        self.timings["ready_s"] = time.monotonic() - began
        return self

    def _register(self) -> None:
        """Motor's controller-style registration of the instances, and the adapter subscribed."""
        raise NotImplementedError

    # "memory", or "file:PATH": registrations kept across an adapter restart (restart_adapter)
    adapter_registry = "memory"

    def _start_adapter(self) -> None:
        command = [sys.executable, "-m", "motor_adapter.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.adapter_port), "--registry", self.adapter_registry]
        if self.adapter_kv_affinity:
            config = self.work_dir / "adapter_config.json"
            config.write_text(json.dumps({"kv_affinity": self.adapter_kv_affinity}), encoding="utf-8")
            command += ["--config", str(config)]
        with open(self.adapter_log, "ab") as log:
            self._adapter = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.wait_for(lambda: self.adapter_call("/health") is not None, "the adapter's /health")

    def restart_adapter(self) -> None:
        """``kill -9`` of the adapter, then the same command again (its log appended)."""
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            adapter.kill()
            adapter.wait(10)
        self._start_adapter()

    @property
    def adapter_pid(self) -> int | None:
        adapter = self._adapter
        return None if adapter is None or adapter.poll() is not None else adapter.pid

    def stop(self) -> None:
        self.coordinator.stop()
        for server in self.servers:
            server.stop()
        adapter, self._adapter = self._adapter, None
        stop_process(adapter)

    def __enter__(self: _Rig) -> _Rig:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests

    def post_completion(self, body: dict[str, Any], timeout_s: float) -> tuple[int, Any, float]:
        """One ``/v1/completions`` through Motor: (HTTP status, the JSON answer or its text, seconds)."""
        request = urllib.request.Request(
            self.coordinator.infer_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                status, raw = int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            status, raw = int(exc.code), exc.read()
        seconds = time.perf_counter() - began
        try:
            return status, json.loads(raw), seconds
        except ValueError:
            return status, raw.decode(errors="replace"), seconds

    def log_marks(self) -> tuple[int, list[int]]:
        """Where Motor's and each server's log end now: what a request logs comes after."""
        return len(self.coordinator.log()), [len(s.log_text()) for s in self.servers]

    def log_since(self, marks: tuple[int, list[int]]) -> tuple[str, list[str]]:
        """Motor's and each server's log text written since ``marks``."""
        motor, servers = marks
        texts = [s.log_text()[mark:] for s, mark in zip(self.servers, servers, strict=True)]
        return self.coordinator.log()[motor:], texts

    # ------------------------------------------------------------------ the adapter, logs, waiting

    def adapter_call(self, path: str, body: Any = None) -> Any:
        """GET (``body`` None) or POST JSON to the adapter: the JSON answer (text if not JSON);
        None when the adapter does not answer 200."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.adapter_port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                raw = response.read()
        except OSError:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def adapter_query(self, token_ids: list[int], block_size: int) -> dict[str, Any]:
        """The adapter's ``/query`` answer per instance id (what Motor will read); empty if none."""
        body = {"model": self.model_name, "block_size": block_size, "token_ids": token_ids}
        answer = self.adapter_call("/query", body)
        tenant = answer.get("default", {}) if isinstance(answer, dict) else {}
        return dict(tenant) if isinstance(tenant, dict) else {}

    def adapter_text(self) -> str:
        try:
            return self.adapter_log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def wait_for(self, check: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
        """Polls ``check`` until truthy (a condition with a deadline); the log tails on failure."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s\n{self.tails()}")
            time.sleep(0.1)  # polling a condition with a deadline

    def tails(self, lines: int = 25) -> str:
        parts = [s.log_tail(lines) for s in self.servers]
        for name, text in (("motor", self.coordinator.log()), ("adapter", self.adapter_text())):
            tail = text.splitlines()[-lines:]
            parts.append(f"--- last {len(tail)} lines of the {name} log ---\n" + "\n".join(tail))
        return "\n".join(parts)


def stop_process(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM, then SIGKILL after 10 s: the rigs' adapter processes."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
