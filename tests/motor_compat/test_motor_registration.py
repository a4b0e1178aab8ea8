"""The registration Motor really sends (``type: vLLM``, ``endpoint``, ``dp_rank`` 0, no dp_size,
no fanned_in) against a real fan-in with 4 ranks, and against a plain per-rank SGLang publisher."""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

import pytest
import zmq

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.simulator import SimulatedInstance
from tests.adapter.test_service import (
    BS,
    MODEL,
    MotorClient,
    Publisher,
    Server,
    connect,
    http,
    make_server,
    prompt,
    server,
    wait_for,
)
from tests.conftest import free_tcp_endpoint

pytestmark = pytest.mark.integration

__all__ = ["make_server", "server"]  # fixtures, re-bound by name


def _register(url: str, body: dict[str, Any]) -> int:
    """POST /register with a roomy timeout: this tier checks what registration finds, not its
    latency (test_service's helper keeps Motor's 3 s, which a 2-core box under load can exceed)."""
    request = urllib.request.Request(
        url + "/register", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30.0) as response:
        return int(response.status)


def _motor_registration(endpoint: str, replay: str | None = None) -> dict[str, Any]:
    body = {"endpoint": endpoint, "type": "vLLM", "modelname": MODEL, "block_size": BS}
    body.update({"instance_id": "vllm-prefill-0", "dp_rank": 0})
    if replay is not None:
        body["replay_endpoint"] = replay
    return body


def test_motors_registration_finds_the_instance_stream_and_its_dp_size(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    config = PluginConfig(
        endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), heartbeat_s=0.5, topic="", bind=True
    )
    instance = SimulatedInstance(config, 4, 1024, BS)
    try:
        with caplog.at_level(logging.INFO, logger="motor_adapter.stream"):
            assert _register(server.url, _motor_registration(config.endpoint, config.replay_endpoint)) == 200
            wait_for(lambda: "instance stream with dp_size 4" in caplog.text, "dp_size found from the snapshot")
        (worker,) = http(server.url + "/workers")[1]["workers"]
        assert worker["endpoints"]["0"]["mode"] == "engine" and worker["health"]["0"][0]["dp_size"] == 4
        tokens = prompt(5, 12)
        instance.dispatch(tokens, routed_dp_rank=3)  # the last rank holds it: folded into Motor's dp 0
        client = MotorClient(server.url)
        entry = wait_for(lambda: client.query(tokens).get("vllm-prefill-0", {}).get("DP", {}).get("0"), "hit")
        assert entry == 12 * BS
        assert client.query(tokens)["vllm-prefill-0"]["dp_detail"]["0"]["engine_dp_rank"] == 3
        assert "plain engine stream" not in caplog.text
    finally:
        instance.close()


def test_motors_registration_of_a_plain_sglang_rank_says_only_that_rank_is_visible(
    server: Server, zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    pub = Publisher(zctx, free_tcp_endpoint(), plain=True)
    with caplog.at_level(logging.WARNING, logger="motor_adapter.stream"):
        assert _register(server.url, _motor_registration(pub.endpoint)) == 200
        connect(server, pub, rank=None)
        tokens = prompt(9, 6)
        pub.store(tokens, rank=None)
        client = MotorClient(server.url)
        assert wait_for(lambda: client.query(tokens).get("vllm-prefill-0", {}).get("DP", {}).get("0"), "hit") == 6 * BS
        wait_for(lambda: "plain engine stream" in caplog.text, "the plain-stream warning")
