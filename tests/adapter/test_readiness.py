"""Readiness and liveness: ``/ready`` is 503 with the reason until every followed stream is heard
and caught up, 200 after; ``/health`` answers OK throughout (a real ``motor-kv-adapter serve``
process, a real ZMQ publisher process, real HTTP)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import free_tcp_endpoint
from fanin.test_stream import Pub  # the publisher process the stream tests drive
from registry_procs import AdapterProcess, http, wait_for

from motor_adapter.readiness import readiness

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4  # stream_publisher.py's block size (Pub passes it)


def _registration(endpoint: str, replay: str) -> dict[str, Any]:
    return {
        "instance_id": "vllm-prefill-0",
        "dp_rank": 0,
        "medium_endpoints": {"npu": endpoint},
        "replay_endpoint": replay,
        "type": "sglang",
        "modelname": "m",
        "block_size": BLOCK_SIZE,
        "fanned_in": True,
        "dp_size": 2,
    }


def _ready(adapter: AdapterProcess) -> tuple[int, Any]:
    return http(adapter.url + "/ready")


def test_ready_goes_from_503_to_200_when_the_stream_is_heard(tmp_path: Path) -> None:
    adapter = AdapterProcess(f"file:{tmp_path / 'registry.json'}", tmp_path / "adapter.log")
    pub: Pub | None = None
    try:
        adapter.start()
        wait_for(lambda: _ready(adapter)[0] == 200, "/ready with nothing registered")  # nothing to follow

        endpoint, replay = free_tcp_endpoint(), free_tcp_endpoint()
        status, body = http(adapter.url + "/register", _registration(endpoint, replay))
        assert status == 200, body

        # registered, its engine not up yet: not ready, and the answer says which stream and why
        status, body = _ready(adapter)
        assert status == 503, body
        assert body["ready"] is False
        assert any(endpoint in reason and "not connected" in reason for reason in body["reasons"]), body
        assert http(adapter.url + "/health")[0] == 200  # liveness is not readiness

        pub = Pub(endpoint, replay, "--heartbeat", "0.05")
        pub.cmd("store", rank=1, hashes=[1, 2, 3])
        status, body = wait_for(lambda: (r := _ready(adapter))[0] == 200 and r, "/ready after the stream is heard")
        assert body == {"ready": True, "reasons": [], "streams": 1, "unverifiable_streams": []}

        # the engine goes away: heartbeats stop, the stream is no longer connected, not ready again
        pub.kill()
        pub = None
        status, body = wait_for(lambda: (r := _ready(adapter))[0] == 503 and r, "/ready after the engine died")
        assert any("not connected" in reason for reason in body["reasons"]), body
        assert http(adapter.url + "/health")[0] == 200

        # kill -9 and the same command: the registration comes back from the state file (no
        # /register), unready while its engine is still down, ready once the engine is back
        adapter.kill9()
        adapter.start()
        status, body = _ready(adapter)
        assert status == 503, body
        assert any(endpoint in reason or "registry" in reason for reason in body["reasons"]), body
        pub = Pub(endpoint, replay, "--heartbeat", "0.05")
        wait_for(lambda: _ready(adapter)[0] == 200, "/ready after the restore and the engine's return")
        status, text = http(adapter.url + "/metrics")
        assert 'path="/register"' not in text  # restored, not re-sent
    finally:
        if pub is not None:
            pub.close()
        adapter.stop()


def _health(**kw: Any) -> SimpleNamespace:
    fields = {"endpoint": "tcp://e:1", "instance_id": "i", "dp_rank_override": None}
    fields |= {"connected": True, "syncing": False, "provable": True}
    return SimpleNamespace(**(fields | kw))


@pytest.mark.unit
def test_each_reason_is_named() -> None:
    status = {"registrations": 3, "restoring": 0}
    assert readiness(status, True, {}).ready
    assert readiness(status, False, {}).reasons == ["registry: restoring 3 stored registration(s)"]
    syncing = readiness(status, True, {"k": [_health(syncing=True)]})
    assert not syncing.ready and "catching up" in syncing.reasons[0]
    # a plain rank stream without replay or heartbeats cannot be proven alive: listed, not blocking
    plain = readiness(status, True, {"k": [_health(connected=False, provable=False, dp_rank_override=1)]})
    assert plain.ready and plain.unverifiable == ["stream tcp://e:1 (i rank 1)"]
