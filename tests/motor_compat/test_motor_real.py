"""The released Motor (``mindie-motor==3.0.0b2``, installed by .ci/run) against ``motor-kv-adapter serve``.

Motor's REAL ``ConductorApiClient`` and ``KvCacheAffinityPolicy`` (in a child process, see
``tests/motor_real_child.py``) and Motor's REAL coordinator (``python -m motor.coordinator.main``
via ``motor_adapter.tools.motor_coordinator``) talk HTTP to the adapter as a real server process;
hits come from real rank publishers and the real fan-in (``SimulatedInstance``: only the
scheduler's prefix cache is simulated). Two SGLang instances sit on 127.0.0.1 and 127.0.0.2
(Motor derives each instance's stream URL from its endpoint IP and one configured port).
No part of Motor is stubbed. Skipped without mindie-motor, except in CI (``KVPUB_REQUIRE_MOTOR=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_procs import AdapterProcess

from motor_adapter.tools.motor_coordinator import Coordinator, instance_event, topology, user_config
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.simulator import SimulatedInstance
from tests.adapter.test_tokenize import _build_tokenizer
from tests.conftest import free_tcp_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
BS = 4
HOSTS = ("127.0.0.1", "127.0.0.2")

_MISSING = importlib.util.find_spec("motor") is None
if _MISSING and os.environ.get("KVPUB_REQUIRE_MOTOR") == "1":
    raise RuntimeError("KVPUB_REQUIRE_MOTOR=1 but mindie-motor is not installed (see .ci/requirements-motor.txt)")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(_MISSING, reason="mindie-motor not installed (pip install --no-deps mindie-motor==3.0.0b2)"),
]


def _port_on_all_hosts() -> int:
    """A free port bindable on every loopback address the instances use."""
    for _ in range(200):
        port = free_tcp_port()
        ok = True
        for host in HOSTS:
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no port free on every loopback host")


def _http(url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.startswith(("{", "[")) else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def _adapter(log: Path) -> AdapterProcess:
    """``motor-kv-adapter serve`` as a real server process on loopback, its registrations in a file."""
    adapter = AdapterProcess(None, log)
    adapter.start()
    return adapter


class MotorChild:
    """Motor's client and policy in their own process (tests/motor_real_child.py)."""

    def __init__(self, config: dict[str, Any], tmp: Path) -> None:
        path = tmp / "user_config.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        env = {**os.environ, "USER_CONFIG_PATH": str(path), "KV_CONDUCTOR_SERVICE": "127.0.0.1"}
        env["PYTHONPATH"] = str(ROOT)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "motor_real_child.py"), MODEL],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    def call(self, **command: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
            self.lines.append(line.rstrip("\n"))
        raise AssertionError("Motor's child exited:\n" + "\n".join(self.lines[-40:]))

    def logged(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, OSError, ValueError):
                self.call(op="stop")
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tokenizer(tmp_path_factory.mktemp("motor-tok"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))  # what Motor's TokenizerManager loads


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[SimulatedInstance], int, int]]:
    """Two instances of 2 DP ranks with the plugin, on 127.0.0.1 and 127.0.0.2, same ports."""
    events, replay = _port_on_all_hosts(), _port_on_all_hosts()
    instances: list[SimulatedInstance] = []
    try:
        for host in HOSTS:
            config = PluginConfig(
                endpoint=f"tcp://{host}:{events}",
                replay_endpoint=f"tcp://{host}:{replay}",
                heartbeat_s=0.5,
                topic="kv-events",
                bind=True,
            )
            instances.append(SimulatedInstance(config, 2, 4096, BS))
        yield instances, events, replay
    finally:
        for instance in instances:
            instance.close()


def _hit(adapter: AdapterProcess, tok: Any, prompt: str, instance: str) -> Any:
    body = {"model": MODEL, "block_size": BS, "token_ids": tok.encode(prompt)}
    status, answer = _http(adapter.url + "/query", body)
    entry = answer["default"].get(instance) if status == 200 else None
    return entry if entry and entry["DP"]["0"] > 0 else None


def test_motors_client_and_policy_pick_the_instance_and_endpoint_that_hold_the_prefix(
    tmp_path: Path, tokenizer_dir: Path, tok: Any, cluster: tuple[list[SimulatedInstance], int, int]
) -> None:
    instances, events, replay = cluster
    adapter = _adapter(tmp_path / "adapter.log")
    mode, _role = topology()
    config = user_config(
        adapter_port=adapter.port,
        model_name=MODEL,
        model_path=str(tokenizer_dir),
        block_size=BS,
        events_port=events,
        replay_port=replay,
        deploy_mode=mode,
    )
    motor = MotorChild(config, tmp_path)
    try:
        # Registration exactly as Motor sends it: type vLLM, endpoint, dp_rank 0, no dp_size.
        motor.call(op="register", instances=[{"id": 0, "ip": HOSTS[0]}, {"id": 1, "ip": HOSTS[1]}], role="prefill")
        sent = motor.logged("register_data")
        assert len(sent) == 2 and "'type': 'vLLM'" in sent[0] and "dp_size" not in sent[0]
        assert f"tcp://{HOSTS[1]}:{events}" in sent[1] and f"'block_size': {BS}" in sent[1]
        workers = wait_for(lambda: len(_http(adapter.url + "/workers")[1]["workers"]) == 2, "2 workers")
        assert workers

        # The adapter found each instance stream and its dp_size by itself.
        wait_for(lambda: adapter.log().count("instance stream with dp_size 2") == 2, "stream discovery logged")
        health = [w["health"]["0"][0] for w in _http(adapter.url + "/workers")[1]["workers"]]
        assert [h["dp_size"] for h in health] == [2, 2] and "plain engine stream" not in adapter.log()

        hot_1 = "instance one holds this long shared system prompt, " * 12
        instances[1].dispatch(tok.encode(hot_1), routed_dp_rank=1)  # rank 1 of instance 1 prefilled it
        entry = wait_for(lambda: _hit(adapter, tok, hot_1, "vllm-prefill-1"), "instance 1's hit")
        assert entry["dp_detail"]["0"]["engine_dp_rank"] == 1  # every rank folds into Motor's dp 0
        assert motor.call(op="select", prompt=hot_1) == {"instance": 1, "endpoint": 0}
        assert motor.logged("query success!") and motor.logged("select_endpoint: 1-0  max_kv_gpu:")
        assert not motor.logged("max_kv_gpu:0")  # scored on a real hit, not a tie broken by order

        hot_0 = "a different document that instance zero has cached already; " * 10
        instances[0].dispatch(tok.encode(hot_0), routed_dp_rank=0)
        wait_for(lambda: _hit(adapter, tok, hot_0, "vllm-prefill-0"), "instance 0's hit")
        assert motor.call(op="select", prompt=hot_0) == {"instance": 0, "endpoint": 0}
        assert motor.logged("select_endpoint: 0-0")

        # A miss: the answer lists both instances at 0 and Motor still picks an endpoint, no error.
        cold = "nobody has seen this prompt before, so every rank misses it. " * 8
        answer = motor.call(op="query", prompt=cold)
        assert {k: v["DP"] for k, v in answer["default"].items()} == {
            "vllm-prefill-0": {"0": 0},
            "vllm-prefill-1": {"0": 0},
        }
        assert motor.call(op="select", prompt=cold)["instance"] in (0, 1)

        motor.call(op="unregister")
        wait_for(lambda: _http(adapter.url + "/workers")[1]["workers"] == [], "unregistered")
        # No registration: 404 NoIndexer -> Motor's client returns {} -> the policy gives up
        # (None), and Motor's scheduler falls back to load_balance.
        assert motor.call(op="select", prompt=hot_1) == {"instance": None}
        assert not motor.logged("Traceback")
    finally:
        motor.stop()
        adapter.stop()


class _Engine:
    """An OpenAI /v1/completions stub in front of a SimulatedInstance (SGLang's DP controller:
    round robin over ranks), for Motor's coordinator to forward to."""

    def __init__(self, instance: SimulatedInstance, tok: Any) -> None:
        from aiohttp import web

        self.instance, self.tok = instance, tok
        self.port = free_tcp_port()
        self.served: list[tuple[int, int]] = []  # (rank, cached tokens) per request
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        ids = self.tok.encode(body["prompt"])
        done = self.instance.dispatch(ids)
        self.served.append((done.dp_rank, done.result.cached_tokens))
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        choice = {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}
        return web.json_response(
            {"id": "x", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": usage}
        )

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_motors_real_coordinator_scores_the_instance_through_the_adapter(
    tmp_path: Path, tokenizer_dir: Path, tok: Any, cluster: tuple[list[SimulatedInstance], int, int]
) -> None:
    instances, events, replay = cluster
    adapter = _adapter(tmp_path / "adapter.log")
    engine = _Engine(instances[0], tok)
    mode, role = topology()
    ports = [free_tcp_port() for _ in range(3)]
    config = user_config(
        adapter_port=adapter.port,
        model_name=MODEL,
        model_path=str(tokenizer_dir),
        block_size=BS,
        events_port=events,
        replay_port=replay,
        infer_port=ports[0],
        mgmt_port=ports[1],
        obs_port=ports[2],
        dp_size=2,
        deploy_mode=mode,
    )
    coordinator = Coordinator(config, tmp_path / "coordinator.log")
    try:
        coordinator.start()
        coordinator.add_instance(
            instance_event(
                instance_id=0, model_name=MODEL, http_host="127.0.0.1", http_port=engine.port, dp_size=2, role=role
            )
        )
        wait_for(lambda: "registered vllm-prefill-0 dp 0" in adapter.log(), "Motor's registration")
        prompt = "the same long prompt, twice through Motor's coordinator. " * 12
        completion = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert _http(coordinator.infer_url + "/v1/completions", completion)[0] == 200
        wait_for(lambda: _hit(adapter, tok, prompt, "vllm-prefill-0"), "the adapter sees request 1's blocks")
        assert _http(coordinator.infer_url + "/v1/completions", completion)[0] == 200
        scored = [line for line in coordinator.log().splitlines() if "select_endpoint" in line]
        assert scored and "max_kv_gpu:0" in scored[0] and "max_kv_gpu:0" not in scored[-1], scored
        assert any("query success!" in line and "'GPU': " in line for line in coordinator.log().splitlines())
        assert len(engine.served) == 2  # both forwarded unchanged to the instance's one endpoint
        assert "Traceback" not in coordinator.log()
    finally:
        coordinator.stop()
        engine.stop()
        adapter.stop()


def test_the_documented_motor_config_loads_in_motors_own_loader(tmp_path: Path) -> None:
    """docs/examples/motor_user_config.json through Motor's CoordinatorConfig.from_json (a fresh process)."""
    probe = (
        "import json\n"
        "from motor.config.coordinator import CoordinatorConfig\n"
        "c = CoordinatorConfig.from_json()\n"
        "k = c.prefill_kv_event_config\n"
        "print('@@ ' + json.dumps({'conductor': k.conductor_service, 'port': k.http_server_port,\n"
        "    'block_size': k.block_size, 'endpoint': k.endpoint, 'replay': k.replay_endpoint,\n"
        "    'model_path': k.model_path, 'type': k.engine_type,\n"
        "    'scheduler': c.scheduler_config.scheduler_type.value}))\n"
    )
    env = {
        **os.environ,
        "USER_CONFIG_PATH": str(ROOT / "docs" / "examples" / "motor_user_config.json"),
        "KV_CONDUCTOR_SERVICE": "127.0.0.1",
    }
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    (line,) = [line for line in out.splitlines() if line.startswith("@@ ")]
    assert json.loads(line[3:]) == {
        "conductor": "127.0.0.1",
        "port": 13333,
        "block_size": 128,
        "endpoint": "tcp://*:5557",
        "replay": "tcp://*:6667",
        "model_path": "/models/DeepSeek-V4-Flash",
        "type": "vLLM",
        "scheduler": "kv_cache_affinity",
    }
