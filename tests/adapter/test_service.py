"""The conductor-compatible service over real HTTP, fed by real ZMQ publishers.

Requests are made the way Motor's conductor client makes them (motor-conductor.md
sections 3-4): registration payloads of ``_register_hbm_dp``, msgpack ``/query`` bodies,
a 3 s timeout and a circuit breaker that opens after 3 consecutive failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
from aiohttp import web

from motor_adapter import service
from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.service import AdapterState, ServiceConfig, build_app
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import local_block_hashes
from tests.conftest import free_port_block, free_tcp_endpoint, free_tcp_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BS = 128
MODEL = "dsv4-flash"
DEADLINE_S = 10.0


# --------------------------------------------------------------------------- helpers


class Server:
    """The app on a free loopback port, in its own event-loop thread."""

    def __init__(self, config: ServiceConfig) -> None:
        self.state = AdapterState(config)
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(build_app(self.state), access_log=None)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def http(
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    use_msgpack: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One request with Motor's 3 s timeout; returns (status, decoded JSON or text)."""
    data = raw
    hdrs = dict(headers or {})
    if body is not None:
        data = msgpack.packb(body) if use_msgpack else json.dumps(body).encode()
    if data is not None:
        hdrs.setdefault("Content-Type", "application/msgpack" if use_msgpack else "application/json")
    request = urllib.request.Request(url, data=data, headers=hdrs, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=3.0) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


class MotorClient:
    """What Motor's ConductorApiClient does, reduced to the parts the service must satisfy."""

    def __init__(self, base: str, model: str = MODEL) -> None:
        self.base = base
        self.model = model
        self.failures = 0
        self.open_until = 0.0

    def register_hbm_dp(self, instance: str, ip_endpoint: str, dp: int = 0, **extra: Any) -> tuple[int, Any]:
        body = {
            "instance_id": instance,
            "dp_rank": dp,
            "medium_endpoints": {"npu": ip_endpoint},
            "type": "sglang",
            "store_backend": "",
            "modelname": self.model,
            "block_size": BS,
            "tenant_id": "default",
            **extra,
        }
        return http(self.base + "/register", body)

    def query(self, token_ids: list[int]) -> dict[str, Any]:
        """``rsp["default"]`` or ``{}`` (Motor's fallback), counting failures like its breaker."""
        if time.monotonic() < self.open_until:
            return {}
        body = {"model": self.model, "block_size": BS, "token_ids": token_ids, "tenant_id": "default"}
        try:
            status, rsp = http(self.base + "/query", body, use_msgpack=True)
        except OSError:
            status, rsp = 0, None
        if status != 200:
            self.failures += 1
            if self.failures >= 3:
                self.open_until = time.monotonic() + 30
            return {}
        self.failures = 0
        return dict(rsp.get("default", {}))


class Publisher:
    """An instance stream (our fan-in's shape) or one plain SGLang rank (compat), over real ZMQ."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, plain: bool = False) -> None:
        self.endpoint = endpoint
        self.plain = plain
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.counter = 0
        self.encoder = wire.BatchEncoder("map")
        self.lock = threading.Lock()

    def publish(self, events: list[Any], rank: int | None) -> None:
        with self.lock:
            seq = self.counter if self.plain else wire.make_seq(1, self.counter)
            self.counter += 1
            payload = self.encoder.encode(wire.EventBatch(ts=time.time(), events=events, dp_rank=rank))
            self.sock.send_multipart(wire.live_frames(b"", seq, payload))

    def store(self, tokens: list[int], rank: int | None, salt: int = 0) -> None:
        blocks = len(tokens) // BS
        hashes = [(salt << 32) + (rank or 0) * 1000 + i + 1 for i in range(blocks)]
        event = wire.BlockStored(
            block_hashes=hashes, token_ids=tokens[: blocks * BS], block_size=BS, medium=wire.MEDIUM_GPU
        )
        self.publish([event], rank)


def wait_for(predicate: Callable[[], Any], what: str, publish: Callable[[], None] | None = None) -> Any:
    """Polls a real condition; ``publish`` is re-sent while waiting (PUB/SUB slow joiner)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if publish is not None:
            publish()
        result = predicate()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(blocks * BS)]


def batches_seen(server: Server, stream: str) -> int:
    total = 0
    for key, healths in server.state.stream_health().items():
        if stream in (key[3], *[h.endpoint for h in healths]):
            total += sum(h.batches for h in healths if h.endpoint == stream or key[3] == stream)
    return total


def connect(server: Server, pub: Publisher, rank: int | None = None) -> None:
    """Heartbeats until the subscriber has applied one: from then on nothing is lost."""
    wait_for(
        lambda: batches_seen(server, pub.endpoint) > 0, f"subscriber on {pub.endpoint}", lambda: pub.publish([], rank)
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def make_server() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(**overrides: Any) -> Server:
        values: dict[str, Any] = {"kv_affinity": KvAffinityConfig(block_size=BS), "max_body_bytes": 256 << 10}
        values.update(overrides)
        server = Server(ServiceConfig(**values))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server: Callable[..., Server]) -> Server:
    return make_server()


# --------------------------------------------------------------------------- tests


def test_health_and_unknown_model_counts_toward_motors_breaker(server: Server) -> None:
    assert http(server.url + "/health") == (200, "OK")
    client = MotorClient(server.url, model="nobody-registered-this")
    for _ in range(3):
        assert client.query(prompt(1, 2)) == {}
    assert client.open_until > time.monotonic()  # 404 NoIndexer is a failure for Motor
    status, body = http(server.url + "/query", {"model": "nope", "block_size": BS, "token_ids": [1]})
    assert status == 404 and body["error"] == "NoIndexer"


def test_fanned_in_instance_folds_ranks_into_registered_dp(server: Server, zctx: zmq.Context[Any]) -> None:
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    status, reg = client.register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True, dp_size=4)
    assert status == 200 and reg["changed"] is True
    connect(server, pub)
    tokens = prompt(3, 20)
    pub.store(tokens[: 5 * BS], rank=1)
    pub.store(tokens, rank=2)
    pub.store(prompt(9, 8), rank=3)

    def hot() -> Any:
        dp = client.query(tokens).get("vllm-prefill-0", {}).get("dp_detail", {}).get("0", {})
        return dp if dp.get("npu_blocks") == 20 else None

    dp0 = wait_for(hot, "20 npu blocks")
    assert dp0 == {"matched_tokens": 20 * BS, "npu_blocks": 20, "cpu_blocks": 0, "disk_blocks": 0, "engine_dp_rank": 2}
    full = client.query(tokens)["vllm-prefill-0"]
    assert full["longest_matched"] == 20 * BS and full["DP"] == {"0": 20 * BS} and full["GPU"] == 20 * BS
    assert client.failures == 0

    # Motor re-registers every 30 s: idempotent, the index survives.
    status, again = client.register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True, dp_size=4)
    assert status == 200 and again["changed"] is False
    assert client.query(tokens)["vllm-prefill-0"]["dp_detail"]["0"]["npu_blocks"] == 20

    # query_by_hash with the conductor's local hashes (i64 spelling accepted).
    hashes = [h - (1 << 64) if h >= 1 << 63 else h for h in local_block_hashes(tokens, BS)]
    body = {"model": MODEL, "block_size": BS, "block_hashes": hashes, "tenant_id": "default"}
    status, by_hash = http(server.url + "/query_by_hash", body)
    assert status == 200 and by_hash["default"]["vllm-prefill-0"]["dp_detail"]["0"]["engine_dp_rank"] == 2
    assert by_hash["default"]["vllm-prefill-0"]["dp_detail"]["0"]["npu_blocks"] == 20

    status, workers = http(server.url + "/workers")
    assert status == 200
    (worker,) = workers["workers"]
    assert worker["instance_id"] == "vllm-prefill-0" and worker["model_name"] == MODEL and worker["block_size"] == BS
    assert worker["endpoints"]["0"]["medium_endpoints"] == {"npu": pub.endpoint}
    assert worker["endpoints"]["0"]["mode"] == "engine" and worker["health"]["0"][0]["events"] >= 3

    status, text = http(server.url + "/metrics")
    assert status == 200
    assert 'motor_kv_adapter_stream_events_total{dp_rank="all"' in text
    assert 'engine_dp_rank="2",instance="vllm-prefill-0",tier="npu"' in text
    assert "motor_kv_adapter_query_seconds_bucket" in text and "motor_kv_adapter_query_hit_ratio" in text
    assert "motor_kv_adapter_stream_gaps_total" in text and "motor_kv_adapter_stream_decode_errors_total" in text


def test_same_url_registrations_share_one_subscription_and_cpu_disk_repeat_is_engine(
    server: Server, zctx: zmq.Context[Any]
) -> None:
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    assert client.register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
    connect(server, pub)
    tokens = prompt(5, 4)
    pub.store(tokens, rank=0)
    wait_for(lambda: client.query(tokens).get("vllm-prefill-0", {}).get("longest_matched") == 4 * BS, "hit")
    # Motor's pool-mode re-registration (risk R3): the engine URL under npu, cpu and disk.
    body = {
        "instance_id": "vllm-prefill-0",
        "dp_rank": 0,
        "medium_endpoints": {"npu": pub.endpoint, "cpu_pinned": pub.endpoint, "ssd": pub.endpoint},
        "type": "sglang",
        "store_backend": "Mooncake",
        "modelname": MODEL,
        "block_size": BS,
        "fanned_in": True,
    }
    status, rsp = http(server.url + "/register", body)
    assert status == 200 and any("repeats the engine URL" in w for w in rsp["warnings"])
    aff = server.state.affinity(MODEL, "default", BS)
    assert aff is not None and aff.instances() == [pub.endpoint]
    # still an engine stream: the HBM blocks are still there, new ones still land on npu
    assert client.query(tokens)["vllm-prefill-0"]["dp_detail"]["0"]["npu_blocks"] == 4
    # a second instance naming the same URL shares the subscriber
    assert client.register_hbm_dp("vllm-prefill-9", pub.endpoint, fanned_in=True)[0] == 200
    assert aff.instances() == [pub.endpoint]
    assert client.query(tokens)["vllm-prefill-9"]["dp_detail"]["0"]["npu_blocks"] == 4
    # unregister one: the other keeps the subscription
    status, _ = http(server.url + "/unregister", {"instance_id": "vllm-prefill-9", "dp_rank": 0, "modelname": MODEL})
    assert status == 200 and aff.instances() == [pub.endpoint]
    assert http(server.url + "/unregister", {"instance_id": "vllm-prefill-9"})[0] == 404


def test_compat_mode_subscribes_base_plus_rank(server: Server, zctx: zmq.Context[Any]) -> None:
    base = free_port_block(4)
    pubs = [Publisher(zctx, f"tcp://127.0.0.1:{base + r}", plain=True) for r in range(4)]
    client = MotorClient(server.url)
    status, rsp = client.register_hbm_dp("vllm-prefill-2", f"tcp://127.0.0.1:{base}", dp_size=4)
    assert status == 200 and any("compatibility mode" in w for w in rsp["warnings"])
    for rank, pub in enumerate(pubs):
        connect(server, pub, rank=None)
        assert batches_seen(server, pub.endpoint) > 0, rank
    tokens = prompt(11, 6)
    pubs[3].store(tokens, rank=None)  # plain SGLang: no dp_rank in the batch, the port says it
    dp0 = wait_for(
        lambda: (
            client.query(tokens).get("vllm-prefill-2", {}).get("dp_detail", {}).get("0", {}).get("npu_blocks") == 6
            and client.query(tokens)["vllm-prefill-2"]["dp_detail"]["0"]
        ),
        "compat hit",
    )
    assert dp0["engine_dp_rank"] == 3
    assert http(server.url + "/workers")[1]["workers"][0]["endpoints"]["0"]["compat_dp_size"] == 4


@pytest.mark.parametrize(
    ("kwargs", "status", "reason"),
    [
        ({"raw": b"{not json"}, 400, "invalid_json"),
        ({"raw": b"\xc1\xc1", "headers": {"Content-Type": "application/msgpack"}}, 400, "invalid_msgpack"),
        ({"body": [1, 2, 3]}, 400, "bad_body"),
        ({"body": {"model": MODEL, "block_size": BS, "token_ids": "abc"}}, 400, "bad_field"),
        ({"body": {"model": MODEL, "block_size": -1, "token_ids": [1]}}, 400, "bad_field"),
        ({"body": {"model": MODEL, "block_size": BS, "token_ids": [1, -5]}}, 400, "bad_field"),
        ({"body": {"block_size": BS, "token_ids": [1]}}, 400, "bad_field"),
        ({"body": {"model": MODEL, "block_size": BS, "prompt": "hi"}}, 400, "no_tokenizer"),
        ({"raw": b"[" + b"1," * 200_000 + b"1]"}, 413, "body_too_large"),
    ],
)
def test_bad_query_bodies_get_4xx_and_are_counted(
    server: Server, kwargs: dict[str, Any], status: int, reason: str
) -> None:
    use_msgpack = kwargs.get("headers", {}).get("Content-Type") == "application/msgpack"
    headers = kwargs.get("headers") or {"Content-Type": "application/json"}
    got, body = http(server.url + "/query", kwargs.get("body"), raw=kwargs.get("raw"), headers=headers)
    del use_msgpack
    assert got == status and body["error"] == reason and body["detail"]
    metrics = http(server.url + "/metrics")[1]
    assert f'motor_kv_adapter_bad_requests_total{{path="/query",reason="{reason}"}} 1' in metrics


def test_bad_registrations(server: Server) -> None:
    cases = [
        {"dp_rank": 0},
        {"instance_id": "x", "dp_rank": "zero"},
        {"instance_id": "x", "medium_endpoints": {"tape": "tcp://127.0.0.1:1"}},
        {"instance_id": "x", "medium_endpoints": {"npu": "not a url"}},
        {"instance_id": "x", "fanned_in": "yes"},
    ]
    for body in cases:
        status, rsp = http(server.url + "/register", body)
        assert status == 400 and rsp["error"] == "bad_registration", body
    assert http(server.url + "/nowhere")[0] == 404


def test_bearer_token_guards_register_and_unregister(make_server: Callable[..., Server]) -> None:
    server = make_server(auth_token="s3cret")
    body = {"instance_id": "vllm-prefill-0", "modelname": MODEL, "block_size": BS}
    status, rsp = http(server.url + "/register", body)
    assert status == 401 and rsp["error"] == "unauthorized"
    assert http(server.url + "/register", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http(server.url + "/register", body, headers={"Authorization": "Bearer s3cret"})[0] == 200
    assert http(server.url + "/unregister", {"instance_id": "vllm-prefill-0"})[0] == 401
    # queries stay open, as Motor sends no token
    status, rsp = http(server.url + "/query", {"model": MODEL, "block_size": BS, "token_ids": [1] * BS})
    assert status == 200 and rsp["default"]["vllm-prefill-0"]["longest_matched"] == 0


def test_a_registration_slower_than_motors_timeout_is_logged(
    make_server: Callable[..., Server], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Motor gives up on a slow ``/register`` and never sends it again: the operator is told the
    instance is registered anyway.  (The timeout is set to 0 here: every registration is late.)"""
    server = make_server()
    monkeypatch.setattr(service, "MOTOR_REGISTER_TIMEOUT_S", 0.0)
    body = {"instance_id": "vllm-prefill-1", "endpoint": free_tcp_endpoint(), "modelname": MODEL, "block_size": BS}
    with caplog.at_level(logging.WARNING, logger="motor_adapter.service"):
        assert http(server.url + "/register", body)[0] == 200
    assert "/register of vllm-prefill-1 dp 0 took" in caplog.text
    assert "registered here (GET /workers lists it)" in caplog.text


def test_report_scenario_cold_load_balance_then_hot_affinity_on_the_right_rank(
    server: Server, zctx: zmq.Context[Any]
) -> None:
    pubs = [Publisher(zctx, free_tcp_endpoint()) for _ in range(2)]
    client = MotorClient(server.url)
    for i, pub in enumerate(pubs):
        assert client.register_hbm_dp(f"vllm-prefill-{i}", pub.endpoint, fanned_in=True, dp_size=16)[0] == 200
        connect(server, pub)
    tokens = prompt(42, 20) + [7] * 40  # ~2.6k tokens, 20 full blocks
    candidates = [{"instance_id": "vllm-prefill-0", "load": 600.0}, {"instance_id": "vllm-prefill-1", "load": 100.0}]
    select = {"model": MODEL, "block_size": BS, "token_ids": tokens, "candidates": candidates, "req_id": "r1"}

    status, cold = http(server.url + "/select", select)
    assert status == 200
    assert cold["policy"] == "load_balance" and cold["instance_id"] == "vllm-prefill-1" and cold["matched"] is None
    assert "policy=load_balance matched=None" in cold["log_line"]

    pubs[0].store(tokens, rank=7)  # instance 0 prefilled it on engine rank 7
    wait_for(lambda: client.query(tokens).get("vllm-prefill-0", {}).get("longest_matched") == 20 * BS, "hot")
    rsp = client.query(tokens)
    assert (
        rsp["vllm-prefill-0"]["dp_detail"]["0"]["npu_blocks"] == 20
        and rsp["vllm-prefill-0"]["dp_detail"]["0"]["engine_dp_rank"] == 7
    )
    assert rsp["vllm-prefill-1"]["longest_matched"] == 0

    status, hot = http(server.url + "/select", {**select, "req_id": "r2"})
    assert status == 200
    assert hot["policy"] == "kv_cache_affinity" and hot["instance_id"] == "vllm-prefill-0" and hot["dp_rank"] == 7
    assert hot["matched"] == 2560 and hot["hbm"] == 2560
    assert "policy=kv_cache_affinity matched=2560 hbm=2560 cpu=0 disk=0 dp_rank=7" in hot["log_line"]


def test_explain_over_http(server: Server, zctx: zmq.Context[Any]) -> None:
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    client.register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)
    connect(server, pub)
    engine_tokens = [1, *prompt(8, 6)]  # the engine prefilled with a BOS (id 1)
    pub.store(engine_tokens, rank=5)
    wait_for(lambda: client.query(engine_tokens).get("vllm-prefill-0", {}).get("longest_matched") == 6 * BS, "hot")

    def explain(tokens: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "block_size": BS, "token_ids": tokens, **extra}
        status, report = http(server.url + "/explain", body)
        assert status == 200, report
        return dict(report)

    hit = explain(engine_tokens)
    assert hit["verdict"] == "hit" and "rank 5" in hit["summary"]
    (inst,) = hit["instances"]
    assert inst["ranks"] == [
        {
            "engine_dp_rank": 5,
            "npu_blocks": 6,
            "cpu_blocks": 0,
            "disk_blocks": 0,
            "matched_blocks": 6,
            "first_missed_block": None,
            "reason": None,
        }
    ]
    # the router forgot the BOS: every block shifts by one token
    shifted = explain(engine_tokens[1:])
    assert shifted["verdict"] == "miss" and "tokens differ from the engine's" in shifted["summary"]
    assert (
        shifted["token_check"]["matched_blocks"] == 6 and shifted["instances"][0]["ranks"][0]["first_missed_block"] == 0
    )
    # the router added a second BOS
    assert "tokens differ" in explain([1, *engine_tokens])["summary"]
    partial = explain(engine_tokens[: 3 * BS + 1] + [9] * (3 * BS))
    assert partial["verdict"] == "partial" and partial["instances"][0]["ranks"][0]["first_missed_block"] == 3
    assert "block_size mismatch" in explain(engine_tokens, block_size=64)["instances"][0]["reason"]
    assert "shorter than one block" in explain(engine_tokens[:10])["summary"]
    assert "no subscription" in explain(engine_tokens, model="other")["summary"]
    assert "tokenizer gave nothing" in explain([])["summary"]
