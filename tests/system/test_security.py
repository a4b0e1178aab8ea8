"""Security: CURVE on the instance stream and replay, keygen, bind defaults, bearer token, rate
limit, no pickle on network input (docs/security.md)."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.service import ServiceConfig
from motor_adapter.stream import StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.config import ConfigError, PluginConfig
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.core.ratelimit import RateLimiter
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.tools import keygen
from sglang_kvpub.transport import curve as security
from tests.adapter.test_service import Server, http
from tests.conftest import free_tcp_endpoint

BS = 4
ROOT = Path(__file__).resolve().parents[2]


def _store(fanin: FanIn, rank_seq: int, block: int) -> None:
    event = wire.BlockStored(block_hashes=[block], token_ids=[block % 1000] * BS, block_size=BS)
    fanin.ingest(0, 1, rank_seq, wire.EventBatch(ts=time.time(), events=[event]))


@pytest.mark.unit
def test_keygen_writes_a_private_pair_and_config_validates(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    keygen.add_parser(parser.add_subparsers())
    args = parser.parse_args(["keygen", "--dir", str(tmp_path), "--name", "fanin"])
    assert args.run(args) == 0
    public, secret = tmp_path / "fanin.key", tmp_path / "fanin.key_secret"
    assert (secret.stat().st_mode & 0o777) == 0o600
    keys = security.server_keys_from_files(str(secret), str(public))
    assert keys is not None and keys.public == security.load_public_key(public)
    assert security.server_keys_from_files(None) is None
    other_public, _ = security.generate_keypair(tmp_path, "other")
    with pytest.raises(security.SecurityError, match="not one key pair"):
        security.server_keys_from_files(str(secret), str(other_public))
    with pytest.raises(security.SecurityError, match="no secret key"):
        security.load_secret_key(public)
    secret.chmod(0o644)
    with pytest.raises(security.SecurityError, match="chmod 600"):
        security.load_secret_key(secret)
    config = PluginConfig.from_mapping({}, env={"SGLANG_KVPUB_CURVE_SECRET_KEY_FILE": str(secret)})
    assert config.curve_secret_key_file == str(secret)
    with pytest.raises(ConfigError, match="curve_public_key_file"):
        PluginConfig(curve_public_key_file="")


@pytest.mark.unit
def test_rate_limiter_token_bucket_is_bounded() -> None:
    limiter = RateLimiter(rate=2.0, burst=3, max_clients=100)
    assert [limiter.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", 0.0)  # per client
    assert not limiter.allow("a", 0.2) and limiter.allow("a", 0.6)  # refills at 2/s
    for i in range(1000):
        limiter.allow(f"ip{i}", 1.0)
    assert len(limiter) <= 100 and limiter.refused == 2


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_curve_stream_only_for_clients_with_the_server_key(tmp_path: Path, zctx: zmq.Context[Any]) -> None:
    server_public, server_secret = security.generate_keypair(tmp_path, "server")
    config = PluginConfig(
        endpoint=free_tcp_endpoint(),
        replay_endpoint=free_tcp_endpoint(),
        bind=True,
        heartbeat_s=0.1,
        curve_secret_key_file=str(server_secret),
        curve_public_key_file=str(server_public),
    )
    fanin = FanIn(config, 1, listen_channel=False)
    fanin.start()
    plain = zctx.socket(zmq.SUB)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(config.endpoint)
    wrong = zctx.socket(zmq.SUB)
    wrong.setsockopt(zmq.LINGER, 0)
    wrong.setsockopt(zmq.SUBSCRIBE, b"")
    impostor_public, _ = zmq.curve_keypair()
    security.apply_client(wrong, security.client_keys(impostor_public))
    wrong.connect(config.endpoint)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(config.replay_endpoint or "")
    dealer.send_multipart(wire.replay_request_frames(0, snapshot=True))
    index = PrefixIndex(BS)
    options = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, poll_s=0.02, curve_server_key=str(server_public))
    sub = StreamSubscriber(
        "inst", config.endpoint, index, replay_endpoint=config.replay_endpoint, context=zctx, options=options
    )
    sub.start()
    try:
        _store(fanin, 0, 11)
        assert sub.wait_for(lambda _h: index.resident("inst", 0, wire.MEDIUM_GPU) == {11}, 15)  # via snapshot
        _store(fanin, 1, 12)
        assert sub.wait_for(lambda _h: index.resident("inst", 0, wire.MEDIUM_GPU) == {11, 12}, 15)  # live
        health = sub.health()
        assert health.snapshots >= 1 and health.connected
        # By now >= 10 heartbeats went out: none reached the unauthenticated sockets.
        assert sub.wait_for(lambda h: h.batches >= 10, 15)
        assert plain.poll(200) == 0 and wrong.poll(200) == 0 and dealer.poll(200) == 0
    finally:
        sub.stop()
        for sock in (plain, wrong, dealer):
            sock.close(linger=0)
        fanin.stop()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_curve_authorized_client_keys(tmp_path: Path, zctx: zmq.Context[Any]) -> None:
    server_public, server_secret = security.generate_keypair(tmp_path / "server", "server")
    allowed_dir = tmp_path / "clients"
    _, allowed_secret = security.generate_keypair(tmp_path / "own", "router1")
    (allowed_dir).mkdir()
    (allowed_dir / "router1.key").write_text((tmp_path / "own" / "router1.key").read_text())
    config = PluginConfig(
        endpoint=free_tcp_endpoint(),
        bind=True,
        heartbeat_s=0.1,
        curve_secret_key_file=str(server_secret),
        curve_authorized_keys=str(allowed_dir),
    )
    fanin = FanIn(config, 1, listen_channel=False, context=zctx)
    fanin.start()
    try:
        subs = {}
        for name, secret_file in (("allowed", str(allowed_secret)), ("unknown", None)):
            sock = zctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            security.apply_client(sock, security.client_keys(str(server_public), secret_file))
            sock.connect(config.endpoint)
            subs[name] = sock
        assert subs["allowed"].poll(5000), "the authorized client got nothing"
        assert subs["unknown"].poll(500) == 0  # a valid CURVE client whose key is not listed
        for sock in subs.values():
            sock.close(linger=0)
    finally:
        fanin.stop()


@pytest.fixture
def limited_server() -> Iterator[Server]:
    srv = Server(ServiceConfig(kv_affinity=KvAffinityConfig(block_size=128), rate_limit_rps=5.0, rate_limit_burst=5))
    yield srv
    srv.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_rate_limit_answers_429_counts_and_spares_health(limited_server: Server) -> None:
    url = limited_server.url
    statuses = [http(url + "/query", {"model": "m", "token_ids": [1]})[0] for _ in range(20)]
    assert statuses.count(429) >= 10 and statuses[0] == 404  # over the burst: refused, cheaply
    status, body = http(url + "/query", {"model": "m", "token_ids": [1]})
    assert status == 429 and body["error"] == "rate_limited" and body["detail"]
    assert all(http(url + "/health")[0] == 200 for _ in range(10))
    metrics = http(url + "/metrics")[1]
    assert re.search(r'motor_kv_adapter_bad_requests_total\{path="/query",reason="rate_limited"\} \d+', metrics)


@pytest.mark.unit
def test_defaults_bind_loopback_and_rate_limit_off() -> None:
    config = ServiceConfig()
    assert config.host == "127.0.0.1" and config.rate_limit_rps is None and config.auth_token is None
    assert ServiceConfig.from_mapping({}, env={"MOTOR_KV_ADAPTER_TOKEN": "t"}).auth_token == "t"


@pytest.mark.unit
def test_no_pickle_anywhere_in_the_packages() -> None:
    """Network input is decoded by msgspec/json only; no module can unpickle anything."""
    banned = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|shelve|marshal|joblib)\b|\bpickle\.|\.loads\(")
    offenders = []
    for package in ("sglang_kvpub", "motor_adapter"):
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                if banned.search(line) and "json.loads(" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert offenders == []
