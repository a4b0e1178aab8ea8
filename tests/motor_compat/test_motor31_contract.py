"""Motor 3.1 (MindIE Motor, ``Ascend/MindIE-Motor``) against the adapter, started as its deployer starts it.

Motor 3.1 is not on PyPI and its code stays out of this repository: every request below is a
FACT read from its sources (docs/testing.md names the commit each test follows), sent by hand
to a real adapter process.  The process is started exactly as Motor 3.1's role script starts
its conductor: ``./kv-conductor --host H --port P`` (the console script this package
installs, found where the role script looks), every other setting from the environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sglang_kvpub.core.hashing import local_block_hashes
from tests.conftest import free_tcp_port, wait_for

pytestmark = pytest.mark.integration

MODEL = "dsv4-flash"
BS = 4
MSGPACK = "application/msgpack"
SCRIPT = Path(sys.executable).parent / "kv-conductor"  # as installed: the venv's bin


def http(url: str, body: Any = None, *, msgpack: bool = False, accept: str | None = None) -> tuple[int, str, Any]:
    """``(status, Content-Type, decoded body)``; the body read by its Content-Type, as Motor 3.1's client reads."""
    headers = {"Content-Type": MSGPACK if msgpack else "application/json"}
    if accept is not None:
        headers["Accept"] = accept
    if body is None or isinstance(body, bytes):
        data = body
    else:
        data = msgspec.msgpack.encode(body) if msgpack else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, kind, raw = response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        status, kind, raw = exc.code, exc.headers.get("Content-Type", ""), exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, "", str(exc)
    if kind.lower().startswith(MSGPACK):
        return status, kind, msgspec.msgpack.decode(raw)
    text = raw.decode()
    return status, kind, json.loads(text) if text[:1] in "{[" else text


class Conductor:
    """``./kv-conductor --host 127.0.0.1 --port P`` from a directory holding the installed script
    under the name the role script looks for (its third place, ``./kv-conductor``)."""

    def __init__(self, workdir: Path, port: int, env: dict[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.env = env
        link = workdir / "kv-conductor"
        if not link.exists():
            link.symlink_to(SCRIPT)
        self.log_path = workdir / f"kv-conductor-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                ["./kv-conductor", "--host", "127.0.0.1", "--port", str(port)],
                cwd=workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        wait_for(lambda: self.proc.poll() is not None or http(self.url + "/health")[0] == 200, "/health")
        assert self.proc.poll() is None, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SCRIPT.exists():
        pytest.fail(f"{SCRIPT} is not installed: pip install -e . (pyproject's [project.scripts] kv-conductor)")
    return tmp_path_factory.mktemp("motor31")


@pytest.fixture(scope="module")
def conductor(workdir: Path) -> Iterator[Conductor]:
    config = workdir / "adapter.json"
    config.write_text(json.dumps({"kv_affinity": {"w_cpu": 0.0}}), encoding="utf-8")
    env = {**os.environ, "MOTOR_KV_ADAPTER_CONFIG": str(config), "RUST_LOG": "info"}
    server = Conductor(workdir, free_tcp_port(), env)
    yield server
    server.stop()


# -- Motor 3.1's registration bodies (conductor_api_client.py) ---------------------------------


def hbm_dp(instance: int, dp: int, npu: str | None, role: str = "prefill") -> dict[str, Any]:
    """``_register_hbm_dp``'s body: pool mode (store_backend Mooncake, the default), one per endpoint."""
    body: dict[str, Any] = {
        "instance_id": f"vllm-{role}-{instance}",
        "type": "vLLM",
        "store_backend": "Mooncake",
        "modelname": MODEL,
        "block_size": BS,
        "dp_rank": dp,
    }
    if npu:
        body["medium_endpoints"] = {"npu": npu}
    return body


def stored(tokens: list[int], dp: int = 0, event_id: int = 1) -> dict[str, Any]:
    """A vLLM-style stored event as Motor 3.1's conductor takes on ``/events`` (flat, typed BlockStored)."""
    hashes = [
        hash(("engine", dp, i, tuple(tokens[: (i + 1) * BS]))) & ((1 << 63) - 1) for i in range(len(tokens) // BS)
    ]
    return {
        "event_id": event_id,
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "medium": "GPU",
    }


def test_a_bad_config_fails_the_start_naming_the_key(workdir: Path) -> None:
    bad = workdir / "bad.json"
    bad.write_text(json.dumps({"query_by_hash_units": "bytes"}), encoding="utf-8")
    port = free_tcp_port()
    env = {**os.environ, "MOTOR_KV_ADAPTER_CONFIG": str(bad)}
    link = workdir / "kv-conductor"
    if not link.exists():
        link.symlink_to(SCRIPT)
    done = subprocess.run(
        ["./kv-conductor", "--host", "127.0.0.1", "--port", str(port)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "query_by_hash_units" in done.stderr and "use tokens or blocks" in done.stderr
    assert str(bad) in done.stderr and "MOTOR_KV_ADAPTER_CONFIG" in done.stderr
    assert http(f"http://127.0.0.1:{port}/health")[0] == 0  # never listened


def test_the_role_script_command_line_serves_motor31s_api(conductor: Conductor) -> None:
    status, _, text = http(conductor.url + "/health")
    assert (status, text) == (200, "OK")
    assert f"serving on http://127.0.0.1:{conductor.port}" in conductor.log()


def test_motor31_registrations_are_accepted_and_pool_explained(conductor: Conductor) -> None:
    # the cluster's pool, once (_register_pool): modelname is model_path or "default"
    pool = {
        "instance_id": "mooncake-pool",
        "endpoint": "tcp://127.0.0.1:50001",
        "type": "vLLM",
        "store_backend": "Mooncake",
        "modelname": "default",
        "block_size": BS,
        "dp_rank": 0,
    }
    status, _, answer = http(conductor.url + "/register", pool)
    assert status == 200 and answer["status"] == "ok"
    assert any("pool registration" in w and "not followed" in w and "HiCache" in w for w in answer["warnings"])
    # an instance whose npu pattern resolves (ZMQ+HTTP) and one without any endpoint (HTTP-only)
    assert http(conductor.url + "/register", hbm_dp(0, 0, "tcp://127.0.0.1:50002"))[0] == 200
    assert http(conductor.url + "/register", hbm_dp(1, 0, None))[0] == 200
    # re-registration (register_post) in pool mode repeats the URL under cpu/disk: one engine stream
    again = {**hbm_dp(0, 0, None), "medium_endpoints": dict.fromkeys(("npu", "cpu", "disk"), "tcp://127.0.0.1:50002")}
    status, _, answer = http(conductor.url + "/register", again)
    assert status == 200 and any("ONE engine stream" in w for w in answer["warnings"])


def test_events_fill_the_index_and_a_msgpack_query_is_answered_in_msgpack(conductor: Conductor) -> None:
    tokens = list(range(100, 100 + 6 * BS))
    batch = {"instance_id": "vllm-prefill-1", "block_size": BS, "events": [stored(tokens)], "shutdown": False}
    status, _, answer = http(conductor.url + "/events", batch)
    assert status == 200 and answer["events_applied"] == 1 and answer["ignored"] == {}
    query = {"model": MODEL, "block_size": BS, "token_ids": [*tokens, 7, 7]}
    # Motor 3.1's post_bytes: Content-Type and Accept both msgpack; the answer read by its Content-Type
    status, kind, rsp = http(conductor.url + "/query", query, msgpack=True, accept=MSGPACK)
    assert status == 200 and kind.startswith(MSGPACK)
    tenant = rsp["default"]
    hot, cold = tenant["vllm-prefill-1"], tenant["vllm-prefill-0"]
    assert hot["DP"]["0"] == 6 * BS and hot["longest_matched"] == 6 * BS
    assert hot["dp_detail"]["0"]["npu_blocks"] == 6
    assert cold["DP"]["0"] == 0  # a cold instance stays listed: Motor 3.1 scores only what is listed
    # Motor 3.1's unified cost (kv_cache_affinity.py): an int DP is tokens, min(matched, isl)
    isl = len(query["token_ids"])
    cost = {name: isl - min(entry["DP"]["0"], isl) for name, entry in tenant.items()}
    assert min(cost, key=cost.__getitem__) == "vllm-prefill-1" and cost["vllm-prefill-1"] == 2
    assert "mooncake-pool" not in tenant  # another model's registration
    # /explain reads the pushed blocks as it reads a stream's
    report = http(conductor.url + "/explain", {"model": MODEL, "block_size": BS, "token_ids": tokens})[2]
    assert report["verdict"] == "hit", report
    # an older client (Accept: application/json) gets JSON, which Motor 3.1 reads by Content-Type too
    status, kind, again = http(conductor.url + "/query", query, msgpack=True, accept="application/json")
    assert status == 200 and kind.startswith("application/json") and again == rsp
    # no Accept at all: JSON, as before Motor 3.1
    assert http(conductor.url + "/query", query, msgpack=True)[1].startswith("application/json")


def test_an_hbm_registration_follows_the_plugins_instance_stream(conductor: Conductor) -> None:
    """What Motor 3.1's own conductor cannot read: the plugin's tagged-map instance stream, each
    batch tagged with its rank.  Here a real fan-in and real rank publishers (only the scheduler is
    simulated), registered with the body Motor 3.1 sends for the instance's one endpoint."""
    from sglang_kvpub.config import PluginConfig
    from sglang_kvpub.tools.simulator import SimulatedInstance

    events, replay = free_tcp_port(), free_tcp_port()
    config = PluginConfig(
        endpoint=f"tcp://127.0.0.1:{events}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        heartbeat_s=0.5,
        topic="kv-events",
        bind=True,
    )
    instance = SimulatedInstance(config, 2, 4096, BS)
    try:
        body = {**hbm_dp(7, 0, f"tcp://127.0.0.1:{events}"), "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        assert http(conductor.url + "/register", body)[0] == 200
        tokens = list(range(5000, 5000 + 8 * BS))
        instance.dispatch(tokens, routed_dp_rank=1)
        query = {"model": MODEL, "block_size": BS, "token_ids": tokens}

        def held() -> Any:
            status, _, rsp = http(conductor.url + "/query", query, msgpack=True, accept=MSGPACK)
            entry = rsp["default"].get("vllm-prefill-7") if status == 200 else None
            return entry if entry and entry["DP"]["0"] == 8 * BS else None

        entry = wait_for(held, "the instance stream's blocks")
        assert entry["dp_detail"]["0"]["engine_dp_rank"] == 1  # the batch's rank kept, not the registered dp
        assert entry["dp_detail"]["0"]["npu_blocks"] == 8
    finally:
        instance.close()
        http(conductor.url + "/unregister", {"instance_id": "vllm-prefill-7", "dp_rank": 0, "modelname": MODEL})


def test_query_by_hash_in_each_versions_units(conductor: Conductor) -> None:
    tokens = list(range(100, 100 + 6 * BS))  # stored by the test above
    hashes = local_block_hashes(tokens, BS)
    body = {"model": MODEL, "block_size": BS, "block_hashes": hashes, "tenant_id": "default"}
    status, _, by_tokens = http(conductor.url + "/query_by_hash", body)
    assert status == 200 and by_tokens["default"]["vllm-prefill-1"]["DP"]["0"] == 6 * BS
    status, _, by_blocks = http(conductor.url + "/query_by_hash", {**body, "units": "blocks"})
    assert status == 200
    assert by_blocks["default"]["vllm-prefill-1"] == {
        "longest_matched": 6,
        "DP": {"0": {"matched_tokens": 6, "npu_blocks": 6, "cpu_blocks": 0, "disk_blocks": 0}},
    }
    assert by_blocks["default"]["vllm-prefill-0"]["longest_matched"] == 0
    status, _, refused = http(conductor.url + "/query_by_hash", {**body, "units": "pages"})
    assert status == 400 and refused["error"] == "bad_field"


def test_workers_serve_motor31s_re_registration(conductor: Conductor) -> None:
    status, _, listed = http(conductor.url + "/workers")
    assert status == 200
    # re_register_kv_instances: (instance_id, int(dp)) from each worker's endpoints; what is missing is registered
    seen = {(w["instance_id"], int(dp)) for w in listed["workers"] for dp in w["endpoints"]}
    assert {("vllm-prefill-0", 0), ("vllm-prefill-1", 0), ("mooncake-pool", 0)} <= seen
    (index,) = [i for i in listed["indexer"] if i["model_name"] == MODEL]
    assert index["tenant_id"] == "default" and index["block_size"] == BS
    assert index["total_blocks"] >= 6 and index["worker_count"] >= 1


def test_events_with_only_hashes_are_ignored_with_the_reason(conductor: Conductor) -> None:
    pool_style = {"event_id": 9, "dp_rank": 0, "event_type": "stored", "seq_hashes": [1, 2], "medium": "cpu"}
    batch = {"instance_id": "vllm-prefill-1", "events": [pool_style, {"event_id": 10, "type": "AllBlocksCleared"}]}
    status, _, answer = http(conductor.url + "/events", batch)
    assert status == 200 and answer["events_applied"] == 1
    assert answer["ignored"] == {"stored without token_ids (the index keys blocks by their tokens)": 1}
    tokens = list(range(100, 100 + 6 * BS))
    rsp = http(conductor.url + "/query", {"model": MODEL, "block_size": BS, "token_ids": tokens})[2]
    assert rsp["default"]["vllm-prefill-1"]["DP"]["0"] == 0  # the clear emptied that rank
    metrics = http(conductor.url + "/metrics")[2]
    assert 'motor_kv_adapter_http_events_total{result="applied"} 2' in metrics
    assert 'motor_kv_adapter_http_events_total{result="ignored"} 1' in metrics
    status, _, refused = http(conductor.url + "/events", {"instance_id": "vllm-prefill-9", "events": []})
    assert status == 404 and refused["error"] == "InstanceNotFound" and "register it first" in refused["detail"]
    status, _, bad = http(conductor.url + "/events", {"instance_id": "vllm-prefill-1", "events": [{"dp_rank": -1}]})
    assert status == 400 and "events[0].dp_rank" in bad["detail"]
    status, _, _ = http(conductor.url + "/query", b"\xc1", msgpack=True)
    assert status == 400


def test_unregister_and_an_unknown_instance(conductor: Conductor) -> None:
    # unregister_post's body: type, modelname, block_size, instance_id, dp_rank
    body = {"type": "vLLM", "modelname": MODEL, "block_size": BS, "instance_id": "vllm-prefill-1", "dp_rank": 0}
    assert http(conductor.url + "/unregister", body)[0] == 200
    status, _, answer = http(conductor.url + "/unregister", body)
    assert status == 404 and answer["error"] == "InstanceNotFound"


class Breaker:
    """Motor 3.1's /query circuit breaker, as facts: a failure is any exception (refused,
    timeout - 3 s -, a non-2xx status such as 404 NoIndexer); 3 in a row open it for 30 s, during
    which every query is answered {} (load_balance) without a request; then one probe."""

    THRESHOLD, COOLDOWN_S = 3, 30.0

    def __init__(self) -> None:
        self.failures = 0
        self.open_until = 0.0

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.THRESHOLD:
            self.open_until = now + self.COOLDOWN_S

    def is_open(self, now: float) -> bool:
        return self.failures >= self.THRESHOLD and now < self.open_until


def test_an_adapter_restart_keeps_registrations_and_what_the_breaker_sees(conductor: Conductor) -> None:
    query = {"model": MODEL, "block_size": BS, "token_ids": list(range(100, 100 + 6 * BS))}
    breaker = Breaker()
    conductor.stop()
    for _ in range(2):  # queries while the adapter is down: refused, each a failure
        status = http(conductor.url + "/query", query, msgpack=True, accept=MSGPACK)[0]
        assert status == 0
        breaker.record(False, time.monotonic())
    assert not breaker.is_open(time.monotonic())  # two failures: still closed; a third would open it for 30 s
    restarted = Conductor(conductor.workdir, conductor.port, conductor.env)
    conductor.proc = restarted.proc  # the module fixture stops whichever runs
    # registrations come back from the registry file with no /register: Motor 3.1's
    # re_register_kv_instances finds nothing missing in /workers
    seen = wait_for(
        lambda: (
            {
                (w["instance_id"], int(dp))
                for w in http(conductor.url + "/workers")[2]["workers"]
                for dp in w["endpoints"]
            }
            >= {("vllm-prefill-0", 0), ("mooncake-pool", 0)}
        ),
        "registrations restored",
    )
    assert seen
    status, kind, rsp = http(conductor.url + "/query", query, msgpack=True, accept=MSGPACK)
    breaker.record(status == 200, time.monotonic())
    assert status == 200 and kind.startswith(MSGPACK) and "vllm-prefill-0" in rsp["default"]
    assert breaker.failures == 0  # the first answer after the restart closes the count
