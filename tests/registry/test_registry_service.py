"""The service with a durable registry, over real HTTP and real ZMQ (in-process server).

Write-through on /register and /unregister, restore into a new service state without any
/register, the missed-registration counter and its log, ``motor-kv-adapter register`` and
``unregister`` from the command line, and check-config's start-order note.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from motor_adapter.config_check import check_config
from motor_adapter.registry.durable import DurableRegistrations
from motor_adapter.registry.file import FileStore
from motor_adapter.registry.store import Record
from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.service import AdapterState, ServiceConfig
from motor_adapter.tools.cli import main
from sglang_kvpub import wire
from tests.adapter.test_service import (  # noqa: F401  (pytest fixtures shared with test_service)
    BS,
    MODEL,
    MotorClient,
    Publisher,
    Server,
    connect,
    http,
    make_server,
    prompt,
    wait_for,
)
from tests.conftest import free_tcp_endpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "motor_user_config.json"


def stored(path: Path) -> list[tuple[str, int]]:
    data = json.loads(path.read_text())
    return [(e["key"]["instance_id"], e["key"]["dp_rank"]) for e in data["registrations"]]


def test_file_registry_follows_register_and_unregister_and_restores_without_register(
    tmp_path: Path, make_server: Callable[..., Server], zctx: zmq.Context[Any]
) -> None:
    path = tmp_path / "reg.json"
    server = Server(ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BS), registry=f"file:{path}"))
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    for dp in (0, 1):
        status, answer = client.register_hbm_dp("vllm-prefill-0", pub.endpoint, dp=dp, fanned_in=True)
        assert status == 200 and answer["durable"] is True
    assert client.register_hbm_dp("vllm-prefill-5", pub.endpoint, fanned_in=True)[1]["durable"] is True
    assert stored(path) == [("vllm-prefill-0", 0), ("vllm-prefill-0", 1), ("vllm-prefill-5", 0)]
    # Motor's repeat of the same registration: answered, nothing rewritten
    writes = http(server.url + "/registry")[1]["writes"]
    assert client.register_hbm_dp("vllm-prefill-5", pub.endpoint, fanned_in=True)[1]["changed"] is False
    assert http(server.url + "/registry")[1]["writes"] == writes
    # an unregister without dp_rank removes every dp of the instance, from the file too
    assert http(server.url + "/unregister", {"instance_id": "vllm-prefill-0", "modelname": MODEL})[1]["removed"] == 2
    assert stored(path) == [("vllm-prefill-5", 0)]
    server.close()

    again = make_server(registry=f"file:{path}")  # a new state: only the file knows the registration
    wait_for(lambda: http(again.url + "/workers")[1]["workers"], "the restored registration")
    (worker,) = http(again.url + "/workers")[1]["workers"]
    assert (
        worker["instance_id"] == "vllm-prefill-5"
        and worker["endpoints"]["0"]["medium_endpoints"]["npu"] == pub.endpoint
    )
    connect(again, pub)
    tokens = prompt(21, 4)
    pub.store(tokens, rank=3)
    wait_for(
        lambda: MotorClient(again.url).query(tokens).get("vllm-prefill-5", {}).get("longest_matched") == 4 * BS, "hit"
    )
    assert 'path="/register"' not in http(again.url + "/metrics")[1]


def test_queries_for_an_unregistered_model_are_counted_and_logged_once_per_interval(
    make_server: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server()
    client = MotorClient(server.url, model="never-registered")
    with caplog.at_level(logging.WARNING, logger="motor_adapter.service"):
        for _ in range(3):
            assert client.query(prompt(1, 2)) == {}  # 404 NoIndexer: Motor falls back to load_balance
    text = http(server.url + "/metrics")[1]
    assert 'motor_kv_adapter_unregistered_queries_total{model="never-registered",tenant="default"} 3' in text
    warnings = [r.getMessage() for r in caplog.records if "found no registration" in r.getMessage()]
    assert len(warnings) == 1 and "'never-registered'" in warnings[0] and "motor-kv-adapter register" in warnings[0]


def test_register_and_unregister_from_the_command_line(
    make_server: Callable[..., Server], zctx: zmq.Context[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    server = make_server()
    pub = Publisher(zctx, free_tcp_endpoint())
    args = ["register", "--url", server.url, "--instance-id", "vllm-prefill-7", "--endpoint", pub.endpoint]
    assert main([*args, "--model", MODEL, "--block-size", str(BS), "--engine-type", "sglang", "--fanned-in"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is True
    (worker,) = http(server.url + "/workers")[1]["workers"]
    assert worker["instance_id"] == "vllm-prefill-7" and worker["endpoints"]["0"]["stream"] == pub.endpoint
    connect(server, pub)
    tokens = prompt(22, 3)
    pub.store(tokens, rank=1)
    wait_for(lambda: MotorClient(server.url).query(tokens).get("vllm-prefill-7", {}).get("longest_matched"), "hit")

    assert main(["unregister", "--url", server.url, "--instance-id", "vllm-prefill-7"]) == 0
    assert http(server.url + "/workers")[1]["workers"] == []
    assert main(["unregister", "--url", server.url, "--instance-id", "vllm-prefill-7"]) == 1  # 404 said so
    assert "InstanceNotFound" in capsys.readouterr().err


def test_register_derives_motors_body_from_its_user_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["register", "--url", "http://127.0.0.1:1", "--instance-id", "vllm-prefill-1", "--dry-run"]
    assert main([*args, "--motor-config", str(EXAMPLE), "--ip", "10.0.0.5", "--fanned-in", "--dp-size", "16"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["endpoint"] == "tcp://10.0.0.5:5557" and body["replay_endpoint"] == "tcp://10.0.0.5:6667"
    assert body["type"] == "vLLM" and body["modelname"] == "dsv4-flash" and body["block_size"] == 128
    assert body["fanned_in"] is True and body["dp_size"] == 16
    assert main(["register", "--url", "http://127.0.0.1:1", "--instance-id", "x"]) == 2  # nothing to subscribe to
    assert "--endpoint" in capsys.readouterr().err
    assert main(["register", "--url", "http://127.0.0.1:1", "--instance-id", "x", "--endpoint", "tcp://h:1"]) == 1


def test_check_config_names_the_start_order_and_the_recovery() -> None:
    notes = [f for f in check_config(json.loads(EXAMPLE.read_text()), {}) if "ONCE" in f.message]
    assert len(notes) == 1 and notes[0].severity == "note"
    assert "start order" in notes[0].fix and "motor-kv-adapter register" in notes[0].fix


class SlowReplayEndpoints:
    """Replay ROUTERs that answer each snapshot request only after ``delay_s`` (an engine under load),
    counting how many requests are outstanding at once across all of them."""

    def __init__(self, ctx: zmq.Context[Any], count: int, delay_s: float) -> None:
        self.endpoints = [free_tcp_endpoint() for _ in range(count)]
        self.sockets = []
        for endpoint in self.endpoints:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            self.sockets.append(sock)
        self.delay_s = delay_s
        self.requests = 0
        self.max_outstanding = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        due: list[tuple[float, zmq.Socket[bytes], bytes]] = []
        while not self.stop.is_set():
            for sock, _ in poller.poll(10):
                identity, _, _ = wire.parse_replay_request(sock.recv_multipart())
                self.requests += 1
                due.append((time.monotonic() + self.delay_s, sock, identity))
                self.max_outstanding = max(self.max_outstanding, len(due))
            now = time.monotonic()
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                item[1].send_multipart(wire.replay_end_frames(item[2]))  # an empty snapshot

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.sockets:
            sock.close(linger=0)


def test_restore_asks_at_most_a_window_of_engines_at_once(tmp_path: Path, zctx: zmq.Context[Any]) -> None:
    engines = SlowReplayEndpoints(zctx, count=9, delay_s=0.3)
    path = tmp_path / "reg.json"
    records = []
    for n, replay in enumerate(engines.endpoints):
        body = {
            "instance_id": f"vllm-prefill-{n}",
            "medium_endpoints": {"npu": free_tcp_endpoint()},
            "replay_endpoint": replay,
            "modelname": MODEL,
            "block_size": BS,
            "fanned_in": True,
        }
        records.append(Record(("default", MODEL, f"vllm-prefill-{n}", 0), body))

    async def write() -> None:
        store = FileStore(path)
        await store.open()
        for record in records:
            await store.put(record)
        await store.close()

    async def restore() -> DurableRegistrations:
        registry = DurableRegistrations(state, FileStore(path), restore_window=3, sync_wait_s=10.0, dead_after_s=0)
        await registry.start()
        while registry.restore_done is None:
            await asyncio.sleep(0.05)  # the restore runs in the background: poll its end
        await registry.close()
        return registry

    asyncio.run(write())
    state = AdapterState(ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BS)))
    try:
        registry = asyncio.run(restore())
        assert len(state.registrations()) == 9 and engines.requests == 9
        assert registry.status()["restoring"] == 0 and registry.status()["unrestored"] == {}
        assert 1 < engines.max_outstanding <= 3  # a window of 3: never all nine engines at once
    finally:
        state.close()
        engines.close()


def test_a_stored_registration_that_cannot_be_served_is_kept_until_unregistered(
    tmp_path: Path, make_server: Callable[..., Server]
) -> None:
    path = tmp_path / "reg.json"
    bad = {"instance_id": "vllm-prefill-9", "modelname": MODEL, "medium_endpoints": {"tape": "tcp://127.0.0.1:1"}}
    entry = {"key": {"tenant": "default", "model": MODEL, "instance_id": "vllm-prefill-9", "dp_rank": 0}, "body": bad}
    path.write_text(json.dumps({"format": "motor-kv-adapter/registrations", "version": 1, "registrations": [entry]}))
    server = make_server(registry=f"file:{path}")
    status = wait_for(lambda: http(server.url + "/registry")[1]["unrestored"], "the restore attempt")
    assert "unknown medium 'tape'" in status["default/dsv4-flash/vllm-prefill-9/0"]
    assert stored(path) == [("vllm-prefill-9", 0)]  # never dropped on its own
    assert "motor_kv_adapter_registry_unrestored" in http(server.url + "/metrics")[1]
    status, answer = http(server.url + "/unregister", {"instance_id": "vllm-prefill-9"})
    assert status == 200 and answer["removed"] == 1
    assert stored(path) == [] and http(server.url + "/registry")[1]["unrestored"] == {}
