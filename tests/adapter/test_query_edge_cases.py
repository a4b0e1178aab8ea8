"""Regression tests for the router review: /select scoring, 500s, bounds, and lock stalls.

Real HTTP on loopback through ``tests.adapter.test_service``'s server and helpers; subscribers are
real ZMQ ones except where a test needs to hold a subscriber in ``stop()`` or make one fail.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from motor_adapter import affinity as affinity_module
from motor_adapter import state as state_module
from motor_adapter.affinity import KvAffinity
from motor_adapter.registration import MAX_COMPAT_DP
from motor_adapter.scoring import ConfigError
from motor_adapter.service import MAX_STREAMS_ENV, AdapterState, ServiceConfig
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
from tests.conftest import free_tcp_endpoint, free_tcp_port

pytestmark = [pytest.mark.timeout(60)]


class FakeSubscriber:
    """A subscriber double: ``start`` fails for URLs in ``failing``; ``stop`` may be held."""

    failing: set[str] = set()
    hold: threading.Event | None = None  # stop() waits on it when set
    stopping = threading.Event()
    log: list[tuple[str, str]] = []

    def __init__(self, instance_id: str, endpoint: str, index: Any, **kwargs: Any) -> None:
        self.endpoint = endpoint

    def start(self) -> None:
        if self.endpoint in self.failing:
            raise RuntimeError(f"cannot follow {self.endpoint}")

    def request_stop(self) -> None:
        self.log.append(("request_stop", self.endpoint))

    def stop(self) -> None:
        self.log.append(("stop", self.endpoint))
        FakeSubscriber.stopping.set()
        if self.hold is not None:
            assert self.hold.wait(20)

    def health(self) -> Any:
        return types.SimpleNamespace(endpoint=self.endpoint, batches=0)


@pytest.fixture
def fake_subscribers(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeSubscriber]]:
    """Every AdapterState built from now on follows streams with :class:`FakeSubscriber`."""
    FakeSubscriber.failing = set()
    FakeSubscriber.hold = None
    FakeSubscriber.stopping = threading.Event()
    FakeSubscriber.log = []
    monkeypatch.setattr(state_module, "KvAffinity", functools.partial(KvAffinity, subscriber_factory=FakeSubscriber))
    yield FakeSubscriber
    if FakeSubscriber.hold is not None:
        FakeSubscriber.hold.set()


def metrics_text(server: Server) -> str:
    return str(http(server.url + "/metrics")[1])


# --------------------------------------------------------------------------- 1. /select scores zero hits


@pytest.mark.integration
def test_select_scores_an_idle_cold_instance_against_a_loaded_warm_one(
    make_server: Callable[..., Server], zctx: zmq.Context[Any]
) -> None:
    server = make_server()
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    assert client.register_hbm_dp("A", pub.endpoint, fanned_in=True)[0] == 200
    assert client.register_hbm_dp("B", free_tcp_endpoint(), fanned_in=True)[0] == 200
    connect(server, pub)
    tokens = prompt(3, 8)
    candidates = [{"instance_id": "A", "load": 10_000}, {"instance_id": "B", "load": 0}]
    body = {"model": MODEL, "block_size": BS, "token_ids": tokens, "candidates": candidates}

    status, cold = http(server.url + "/select", body)  # nobody holds anything: the report's cold line
    assert status == 200 and cold["policy"] == "load_balance" and cold["matched"] is None
    assert cold["reason"] == "no prefix hit on any candidate"

    pub.store(tokens[:BS], rank=0)  # A holds one block
    wait_for(lambda: client.query(tokens).get("A", {}).get("longest_matched") == BS, "A's block")
    status, warm = http(server.url + "/select", body)
    assert status == 200, warm
    assert warm["policy"] == "kv_cache_affinity" and warm["instance_id"] == "B"  # idle beats loaded + 1 block
    scored = {c["instance_id"]: c for c in warm["candidates"]}
    assert set(scored) == {"A", "B"} and scored["B"]["matched"] == 0 and scored["A"]["matched"] == BS


# --------------------------------------------------------------------------- 2. no uncounted 500s


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra",
    [
        {"dp_size": 4, "medium_endpoints": {"npu": "tcp://127.0.0.1:65534"}},
        {"dp_size": 4, "medium_endpoints": {"npu": "ipc:///tmp/h25-nope"}},
        {"dp_size": 4, "medium_endpoints": {"npu": "tcp://127.0.0.1"}},
        {"dp_size": 4, "endpoint": "tcp://127.0.0.1:x"},
        {"dp_size": 4, "medium_endpoints": {"npu": "tcp://127.0.0.1:5557"}, "replay_endpoint": "ipc:///tmp/r"},
        {"dp_size": 4, "medium_endpoints": {"npu": "tcp://127.0.0.1:5557"}, "replay_endpoint": "tcp://h:65533"},
        {"dp_size": MAX_COMPAT_DP + 1, "medium_endpoints": {"npu": "tcp://127.0.0.1:5557"}},
    ],
)
def test_bad_compat_registrations_are_400_and_leave_nothing(
    make_server: Callable[..., Server], extra: dict[str, Any]
) -> None:
    server = make_server()
    body = {"instance_id": "x", "type": "sglang", "modelname": MODEL, **extra}
    for _ in range(2):  # the same again: refused again, never a silent "changed": false
        status, rsp = http(server.url + "/register", body)
        assert status == 400 and rsp["error"] == "bad_registration", rsp
    assert server.state.registrations() == []
    assert http(server.url + "/workers") == (200, {"workers": [], "indexer": []})
    assert 'motor_kv_adapter_bad_requests_total{path="/register",reason="bad_registration"} 2' in metrics_text(server)


@pytest.mark.integration
def test_compat_at_the_port_limit_and_at_the_dp_cap_is_accepted(make_server: Callable[..., Server]) -> None:
    server = make_server()
    body = {"instance_id": "x", "type": "sglang", "modelname": MODEL, "dp_size": 2}
    ok = http(server.url + "/register", {**body, "medium_endpoints": {"npu": "tcp://127.0.0.1:65534"}})
    assert ok[0] == 200 and ok[1]["changed"] is True
    fanned = {**body, "instance_id": "y", "dp_size": 4096, "fanned_in": True}  # not compat: no cap
    assert http(server.url + "/register", {**fanned, "medium_endpoints": {"npu": free_tcp_endpoint()}})[0] == 200


@pytest.mark.integration
def test_failed_subscription_rolls_back_and_is_a_counted_json_500(
    make_server: Callable[..., Server], fake_subscribers: type[FakeSubscriber]
) -> None:
    server = make_server()
    good, bad = free_tcp_endpoint(), free_tcp_endpoint()
    fake_subscribers.failing = {bad}
    client = MotorClient(server.url)
    assert client.register_hbm_dp("A", good)[0] == 200

    status, rsp = client.register_hbm_dp("B", bad)  # new registration: nothing kept
    assert status == 500 and rsp["error"] == "internal_error" and "RuntimeError" in rsp["detail"]
    status, rsp = client.register_hbm_dp("A", bad)  # replacement: the previous one is restored
    assert status == 500 and rsp["error"] == "internal_error"

    regs = {(r.instance_id, r.stream) for r in server.state.registrations()}
    assert regs == {("A", good)}
    aff = server.state.affinity(MODEL, "default", BS)
    assert aff is not None and aff.instances() == [good]
    text = metrics_text(server)
    assert 'motor_kv_adapter_bad_requests_total{path="/register",reason="internal_error"} 2' in text
    assert 'motor_kv_adapter_requests_total{path="/register",status="500"} 2' in text
    # retried after the stream came back: accepted (no stale "changed": false)
    fake_subscribers.failing = set()
    status, rsp = client.register_hbm_dp("B", bad)
    assert status == 200 and rsp["changed"] is True
    assert sorted(aff.instances()) == sorted([good, bad])


# --------------------------------------------------------------------------- 3. candidate load


@pytest.mark.integration
def test_select_load_must_be_a_finite_number_at_least_zero(make_server: Callable[..., Server]) -> None:
    server = make_server()
    base = '{"model":"m","token_ids":[1,2,3],"candidates":[{"instance_id":"a","load":%s}]}'
    for load in ("9" * 400, "-1", '"1"', "true"):
        status, rsp = http(server.url + "/select", raw=base.replace("%s", load).encode())
        assert status == 400 and rsp["error"] == "bad_field" and "load" in rsp["detail"], load
    for value in (float("nan"), float("inf"), -float("inf")):  # msgpack carries them
        body = {"model": "m", "token_ids": [1, 2, 3], "candidates": [{"instance_id": "a", "load": value}]}
        status, rsp = http(server.url + "/select", raw=msgpack.packb(body), use_msgpack=True)
        assert status == 400 and rsp["error"] == "bad_field", value
    ok = {"model": "m", "token_ids": [1, 2, 3], "candidates": [{"instance_id": "a", "load": 2**60}]}
    assert http(server.url + "/select", ok)[0] == 200
    assert 'motor_kv_adapter_bad_requests_total{path="/select",reason="bad_field"} 7' in metrics_text(server)


# --------------------------------------------------------------------------- 4. bounds


@pytest.mark.unit
def test_scoring_config_cache_is_bounded() -> None:
    state = AdapterState(ServiceConfig())
    try:
        for block_size in range(1, 1000):
            assert state.scoring_config(block_size).block_size == block_size
        assert 0 < len(state._configs) <= 64
    finally:
        state.close()


@pytest.mark.unit
def test_max_streams_from_config_file_and_env(tmp_path: Any) -> None:
    assert ServiceConfig().max_streams == 1024
    assert ServiceConfig.from_mapping({"max_streams": 8}, env={}).max_streams == 8
    assert ServiceConfig.from_mapping({}, env={MAX_STREAMS_ENV: "16"}).max_streams == 16
    assert ServiceConfig.from_mapping({"max_streams": 8}, env={MAX_STREAMS_ENV: "16"}).max_streams == 8
    path = tmp_path / "adapter.json"
    path.write_text('{"max_streams": 3}')
    assert ServiceConfig.from_file(str(path), env={}).max_streams == 3
    for bad in ({"max_streams": 0}, {"max_streams": "many"}, {"max_streams": True}):
        with pytest.raises(ConfigError):
            ServiceConfig.from_mapping(bad, env={})
    with pytest.raises(ConfigError):
        ServiceConfig.from_mapping({}, env={MAX_STREAMS_ENV: "lots"})


@pytest.mark.integration
def test_max_streams_refuses_new_subscriptions_with_429(
    make_server: Callable[..., Server], fake_subscribers: type[FakeSubscriber]
) -> None:
    server = make_server(max_streams=4)
    client = MotorClient(server.url)
    urls = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(3)]
    for i, url in enumerate(urls):
        assert client.register_hbm_dp(f"i{i}", url)[0] == 200
    assert client.register_hbm_dp("shared", urls[0], dp=1)[0] == 200  # same URL: no new subscription
    compat: dict[str, Any] = {"type": "sglang", "dp_size": 2}
    status, rsp = client.register_hbm_dp("c", "tcp://127.0.0.1:20000", **compat)  # 3 + 2 > 4
    assert status == 429 and rsp["error"] == "too_many_streams"
    assert client.register_hbm_dp("i3", "tcp://127.0.0.1:20010")[0] == 200  # the 4th
    status, rsp = client.register_hbm_dp("i4", "tcp://127.0.0.1:20020")
    assert status == 429 and rsp["error"] == "too_many_streams"
    assert client.register_hbm_dp("i3", "tcp://127.0.0.1:20010")[1]["changed"] is False  # re-registration
    assert client.register_hbm_dp("i3", "tcp://127.0.0.1:20011")[0] == 200  # a move keeps the count
    assert {r.instance_id for r in server.state.registrations()} == {"i0", "i1", "i2", "i3", "shared"}
    assert http(server.url + "/unregister", {"instance_id": "i2"})[0] == 200
    assert client.register_hbm_dp("i4", "tcp://127.0.0.1:20020")[0] == 200  # room again
    assert 'reason="too_many_streams"} 2' in metrics_text(server)


# --------------------------------------------------------------------------- 5. no stall on the lock


@pytest.mark.unit
def test_stop_all_signals_every_subscriber_before_joining_any(fake_subscribers: type[FakeSubscriber]) -> None:
    subs = [FakeSubscriber("x", f"tcp://127.0.0.1:{i}", None) for i in range(1, 5)]
    affinity_module._stop_all(subs)
    kinds = [kind for kind, _ in FakeSubscriber.log]
    assert kinds == ["request_stop"] * 4 + ["stop"] * 4


@pytest.mark.integration
def test_queries_answer_while_unregister_joins_subscribers(
    make_server: Callable[..., Server], fake_subscribers: type[FakeSubscriber]
) -> None:
    server = make_server()
    client = MotorClient(server.url)
    held, other = free_tcp_endpoint(), free_tcp_endpoint()
    assert client.register_hbm_dp("held", held)[0] == 200
    assert client.register_hbm_dp("other", other)[0] == 200
    fake_subscribers.hold = threading.Event()
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(http(server.url + "/unregister", {"instance_id": "held"})))
    worker.start()
    try:
        assert fake_subscribers.stopping.wait(10)  # the unregister is now inside stop()
        # A view-cache miss (the registration change cleared it) and /metrics both need the
        # state lock: answered while the subscriber is still being joined.
        status, rsp = http(server.url + "/query", {"model": MODEL, "block_size": BS, "token_ids": prompt(1, 2)})
        assert status == 200 and set(rsp["default"]) == {"other"}
        assert http(server.url + "/metrics")[0] == 200
        assert result == []  # still joining
    finally:
        fake_subscribers.hold.set()
        worker.join(10)
    assert result and result[0][0] == 200 and result[0][1]["removed"] == 1
