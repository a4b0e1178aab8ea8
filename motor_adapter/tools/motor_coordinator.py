"""Motor's real coordinator on loopback, next to ``motor-kv-adapter serve`` (a dev and test tool).

:func:`user_config` writes the Motor user config that Motor's own loader reads for an SGLang
instance behind this adapter (docs/motor.md "What Motor reads"); :class:`Coordinator` starts
``python -m motor.coordinator.main`` from the installed ``mindie-motor`` package, unmodified,
in its own process group, registers an instance the way Motor's controller does (POST
``/instances/refresh`` on the Mgmt port with an ``InsEventMsg(add)`` built from Motor's own
classes), polls until Motor serves it, and tears the whole group down.

It lives in the package, not under tests/, so ``bench/`` can drive the same coordinator
without importing tests; ``mindie-motor`` is imported only by :meth:`Coordinator.add_instance`.
Loopback only: every address it writes is 127.0.0.x. Motor's coordinator uses fixed IPC names
(``scheduler_frontend`` and ``scheduler_instance_pub`` under the temp dir, a shm segment): one
per machine at a time, so :meth:`Coordinator.start` holds an exclusive lock file until
:meth:`Coordinator.stop` (another test run on the same machine waits instead of colliding).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Union

__all__ = ["Coordinator", "CoordinatorError", "instance_event", "topology", "user_config"]


class CoordinatorError(RuntimeError):
    """Motor's coordinator did not start, or did not take an instance; the message says which."""


def topology() -> tuple[str, str]:
    """``(deploy_mode, instance role)`` under which the installed Motor scores with kv_cache_affinity.

    The Ascend source scores prefill and union instances: ``single_node`` + ``both`` (union).
    3.0.0b2 scores (and registers with the conductor) prefill instances only, and its
    ``single_node`` router asks for prefill while its readiness wants union: ``pd_separate``
    + ``prefill`` (Motor serves a prefill-only set through the same hybrid router).
    """
    from motor.common.resources.instance import Instance

    if "enable_multi_endpoints" in Instance.model_fields:
        return "single_node", "both"
    return "pd_separate", "prefill"


def user_config(
    *,
    adapter_port: int,
    model_name: str,
    model_path: str,
    block_size: int,
    events_port: int,
    replay_port: Union[int, None] = None,
    infer_port: int = 1025,
    mgmt_port: int = 1026,
    obs_port: Union[int, None] = None,
    dp_size: int = 1,
    workers: int = 1,
    host: str = "127.0.0.1",
    scheduler_type: str = "kv_cache_affinity",
    deploy_mode: str = "single_node",
) -> dict[str, Any]:
    """A Motor user config for one SGLang instance (``--plugin sglang_kvpub``) behind the adapter.

    What each key is for (Motor 3.0.0b2 and the Ascend source read the same ones):
    ``kv_conductor_config.http_server_port`` is the adapter's port (the host comes from
    ``KV_CONDUCTOR_SERVICE``); ``engine_config.block-size`` is what Motor sends as
    ``block_size`` and must equal SGLang's ``page-size``; the tokenizer comes from
    ``model_config.model_path`` (3.0.0b2) or ``engine_config.model`` (Ascend source).
    """
    events: dict[str, Any] = {"publisher": "zmq", "endpoint": f"tcp://*:{events_port}", "topic": "kv-events"}
    if replay_port is not None:
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
    api = {
        "coordinator_api_host": host,
        "coordinator_api_infer_port": infer_port,
        "coordinator_api_mgmt_port": mgmt_port,
    }
    if obs_port is not None:
        api["coordinator_obs_port"] = obs_port
    return {
        "motor_deploy_config": {"p_instances_num": 1, "d_instances_num": 0},
        "motor_coordinator_config": {
            "standby_config": {"enable_master_standby": False},
            "scheduler_config": {"deploy_mode": deploy_mode, "scheduler_type": scheduler_type},
            "api_config": api,  # the Ascend source's section
            "http_config": dict(api),  # 3.0.0b2's section for the same host and ports
            "inference_workers_config": {"num_workers": workers},
        },
        "motor_engine_prefill_config": {
            "engine_type": "sglang",
            "model_config": {"model_name": model_name, "model_path": model_path},
            "engine_config": {
                "model": model_path,
                "served-model-name": model_name,
                "dp-size": dp_size,
                "page-size": block_size,
                "block-size": block_size,
                "plugin": "sglang_kvpub",
                "kv-events-config": events,
            },
        },
        "kv_conductor_config": {"http_server_port": adapter_port},
    }


def instance_event(
    *,
    instance_id: int,
    model_name: str,
    http_host: str,
    http_port: int,
    dp_size: int,
    role: str = "both",
    job_name: str = "sglang-0",
) -> Any:
    """``InsEventMsg(add)`` for one SGLang server, from Motor's own classes (needs mindie-motor).

    One endpoint (id 0) for the whole server, as Motor runs SGLang (one HTTP endpoint in
    front of ``dp_size`` ranks); ``parallel_config.dp_size`` says how many ranks it fronts.
    """
    from motor.common.resources.endpoint import Endpoint, EndpointStatus
    from motor.common.resources.http_msg_spec import EventType, InsEventMsg
    from motor.common.resources.instance import InsStatus, Instance, ParallelConfig

    kwargs: dict[str, Any] = {}
    if "enable_multi_endpoints" in Instance.model_fields:  # the Ascend source's switch; 3.0.0b2 has none
        kwargs["enable_multi_endpoints"] = False
    instance = Instance(
        job_name=job_name,
        model_name=model_name,
        id=instance_id,
        role=role,
        status=InsStatus.ACTIVE,
        parallel_config=ParallelConfig(dp_size=dp_size),
        **kwargs,
    )
    endpoint = Endpoint(
        id=0,
        ip=http_host,
        business_port=str(http_port),
        mgmt_port=str(http_port),
        status=EndpointStatus.NORMAL,
        hb_timestamp=time.time(),
    )
    instance.add_endpoints(http_host, {0: endpoint})
    return InsEventMsg(event=EventType.ADD, instances=[instance])


class Coordinator:
    """``python -m motor.coordinator.main`` with ``config``; ``KV_CONDUCTOR_SERVICE`` = ``conductor_host``.

    Its output goes to ``log_path``; :meth:`log` reads it back. Use as a context manager,
    or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        log_path: Union[str, Path],
        *,
        conductor_host: str = "127.0.0.1",
        python: str = sys.executable,
        env: Union[Mapping[str, str], None] = None,
    ) -> None:
        self.config = dict(config)
        api = self.config["motor_coordinator_config"]["api_config"]
        self.host = str(api["coordinator_api_host"])
        self.infer_url = f"http://{self.host}:{api['coordinator_api_infer_port']}"
        self.mgmt_url = f"http://{self.host}:{api['coordinator_api_mgmt_port']}"
        self.log_path = Path(log_path)
        self._python = python
        self._conductor_host = conductor_host
        self._env = dict(env or {})
        self._proc: Union[subprocess.Popen[bytes], None] = None
        self._dir: Union[tempfile.TemporaryDirectory[str], None] = None
        self._lock: Union[Any, None] = None
        self.ready_s: Union[float, None] = None

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout_s: float = 90.0, lock_timeout_s: float = 600.0) -> None:
        """Starts the daemon and waits until its Mgmt port answers (readiness by polling)."""
        self._take_machine_lock(lock_timeout_s)
        started = time.monotonic()
        try:
            self._spawn()
            self._poll(lambda: self._get(self.mgmt_url + "/startup")[0] == 200, timeout_s, "Mgmt /startup")
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started

    def _spawn(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="motor-coordinator-")
        config_path = Path(self._dir.name) / "user_config.json"
        config_path.write_text(json.dumps(self.config, indent=2), encoding="utf-8")
        env = {
            **os.environ,
            "USER_CONFIG_PATH": str(config_path),
            "KV_CONDUCTOR_SERVICE": self._conductor_host,
            "POD_IP": self.host,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self._env,
        }
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                [self._python, "-m", "motor.coordinator.main"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self._dir.name,
                start_new_session=True,  # its own process group: stop() ends every worker it spawned
            )

    def add_instance(self, event: Any, timeout_s: float = 60.0) -> None:
        """POSTs ``event`` (an ``InsEventMsg``) to ``/instances/refresh`` and polls ``/readiness``
        until Motor reports the instance set ready."""
        body = event.model_dump_json().encode() if hasattr(event, "model_dump_json") else json.dumps(event).encode()
        status, text = self._post(self.mgmt_url + "/instances/refresh", body)
        if status != 200:
            raise CoordinatorError(f"/instances/refresh answered {status}: {text[:500]}")
        self._poll(self._instance_ready, timeout_s, "instance readiness")

    @property
    def pid(self) -> Union[int, None]:
        """The daemon's process id while it runs."""
        return None if self._proc is None or self._proc.poll() is not None else self._proc.pid

    def readiness(self) -> tuple[Union[int, None], str]:
        return self._get(self.mgmt_url + "/readiness")

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """Ends the daemon and every process it spawned (its whole process group)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers that outlived the daemon
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        lock, self._lock = self._lock, None
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()

    # ------------------------------------------------------------------ helpers

    def _take_machine_lock(self, timeout_s: float) -> None:
        path = Path(tempfile.gettempdir()) / "motor-coordinator.lock"
        lock = open(path, "a+b")  # noqa: SIM115 - held until stop()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise CoordinatorError(f"another Motor coordinator holds {path} (one per machine)") from None
                time.sleep(0.5)  # polling the lock with a deadline
        self._lock = lock

    def _instance_ready(self) -> bool:
        """Motor's readiness says ready (a union instance in single_node); a prefill-only set
        (3.0.0b2's topology) never reads ready there, so its Mgmt log line is the signal."""
        status, body = self._get(self.mgmt_url + "/readiness")
        if status == 200:
            with contextlib.suppress(ValueError):
                if json.loads(body).get("ready"):
                    return True
        return "Successfully refreshed instances" in self.log()

    def _poll(self, ready: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise CoordinatorError(
                    f"motor.coordinator.main exited ({self._proc.returncode}):\n{self.log()[-4000:]}"
                )
            if ready():
                return
            time.sleep(0.2)  # polling a condition with a deadline
        raise CoordinatorError(f"{what} not reached in {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    @staticmethod
    def _get(url: str) -> tuple[Union[int, None], str]:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return int(response.status), response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return int(exc.code), ""
        except (urllib.error.URLError, OSError):
            return None, ""

    @staticmethod
    def _post(url: str, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10.0) as response:
                return int(response.status), response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode(errors="replace")
