"""Registrations outlive the adapter, with real processes and no mocks.

The adapter is ``motor-kv-adapter serve`` in its own process, killed with SIGKILL and started
again with the same command; etcd is the real etcd 3.5 server; hits come from the simulator's
real rank publishers and fan-in, so "answers the same" is a real prefix hit. Each recovery
prints one JSON line (``-s``) with what it took; docs/operations.md quotes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from registry_procs import (
    BS,
    AdapterProcess,
    Engine,
    EtcdServer,
    http,
    matched,
    prompt,
    require_etcd,
    wait_for,
)

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.timeout(120)]

RESTART_DEADLINE_S = 10.0  # the promised bound on hits coming back after a restart


def report(**figures: Any) -> None:
    print(json.dumps(figures, sort_keys=True), flush=True)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(dp_size: int = 2) -> Engine:
        engine = Engine(dp_size)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def adapters(tmp_path: Path) -> Iterator[Callable[..., AdapterProcess]]:
    made: list[AdapterProcess] = []

    def make(registry: str, config: dict[str, Any] | None = None, start: bool = True) -> AdapterProcess:
        adapter = AdapterProcess(registry, tmp_path / f"adapter{len(made)}.log", config)
        made.append(adapter)
        if start:
            adapter.start()
        return adapter

    yield make
    for adapter in made:
        adapter.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(require_etcd(), tmp_path / "etcd-data", tmp_path / "etcd.log")
    server.start()
    yield server
    server.stop()


def hit(adapter: AdapterProcess, tokens: list[int], instance: str, tokens_held: int) -> Any:
    """The adapter's whole /query answer once ``instance`` holds ``tokens_held`` of the prompt."""
    status, answer = adapter.query(tokens)
    return answer if status == 200 and matched(answer, instance) == tokens_held else None


# --------------------------------------------------------------------------- one adapter, local file


def test_kill9_and_restart_with_the_same_command_brings_hits_back(
    tmp_path: Path, engines: Callable[..., Engine], adapters: Callable[..., AdapterProcess]
) -> None:
    state_file = tmp_path / "state" / "registrations.json"
    engine = engines()
    adapter = adapters(f"file:{state_file}")
    assert adapter.register(engine, "vllm-prefill-0")["durable"] is True
    tokens = prompt(1)
    engine.prefill(tokens, rank=1)
    before = wait_for(lambda: hit(adapter, tokens, "vllm-prefill-0", 8 * BS), "the hit before the crash")

    adapter.kill9()
    started = time.monotonic()
    adapter.start()  # the same command; nobody registers anything
    up = time.monotonic() - started
    after = wait_for(lambda: hit(adapter, tokens, "vllm-prefill-0", 8 * BS), "hits after restart", RESTART_DEADLINE_S)
    recovered = time.monotonic() - started
    assert after == before  # the same instance, rank and tiers: the index was rebuilt from the snapshot
    metrics = adapter.metrics()
    assert 'motor_kv_adapter_registry_restored_total{result="ok"} 1' in metrics
    assert 'path="/register"' not in metrics  # no /register reached the new process
    # the restored subscription is live: a new prefill shows up as usual
    more = prompt(2)
    engine.prefill(more, rank=0)
    wait_for(lambda: hit(adapter, more, "vllm-prefill-0", 8 * BS), "a hit on a prefill after the restart")
    report(fault="adapter_kill9_restart", registry="file", up_s=round(up, 3), hits_back_s=round(recovered, 3))


def test_instance_removed_while_the_adapter_was_down_is_dropped_and_the_drop_written(
    tmp_path: Path, engines: Callable[..., Engine], adapters: Callable[..., AdapterProcess]
) -> None:
    state_file = tmp_path / "registrations.json"
    alive, removed = engines(), engines()
    adapter = adapters(f"file:{state_file}", {"registry_dead_after_s": 1.0})
    adapter.register(alive, "vllm-prefill-0")
    adapter.register(removed, "vllm-prefill-1")
    tokens = prompt(3)
    alive.prefill(tokens, rank=0)
    wait_for(lambda: hit(adapter, tokens, "vllm-prefill-0", 8 * BS), "the hit before the crash")

    adapter.kill9()
    removed.close()  # Motor removed the instance meanwhile; its /unregister found nobody
    started = time.monotonic()
    adapter.start()
    wait_for(lambda: "motor_kv_adapter_registry_dropped_total 1" in adapter.metrics(), "the dead instance dropped")
    dropped = time.monotonic() - started
    assert adapter.instances() == ["vllm-prefill-0"]

    def stored() -> list[str]:
        return [entry["key"]["instance_id"] for entry in json.loads(state_file.read_text())["registrations"]]

    wait_for(lambda: stored() == ["vllm-prefill-0"], "the drop written through to the state file")
    assert "dropped restored registration vllm-prefill-1" in adapter.log()
    assert hit(adapter, tokens, "vllm-prefill-0", 8 * BS)
    report(fault="removed_while_down", dead_after_s=1.0, dropped_after_s=round(dropped, 3))


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"format": "motor-kv-adapter/registrations", "version": 1, "registrations": [', "is not valid JSON"),
        (b'{"workers": []}', "is not a motor-kv-adapter registry file"),
    ],
    ids=["corrupted", "foreign"],
)
def test_a_corrupted_state_file_fails_the_start_naming_the_file_and_the_fix(
    tmp_path: Path, adapters: Callable[..., AdapterProcess], content: bytes, why: str
) -> None:
    state_file = tmp_path / "registrations.json"
    state_file.write_bytes(content)
    adapter = adapters(f"file:{state_file}", start=False)
    proc = adapter.spawn()
    assert proc.wait(30) == 2
    log = adapter.log()
    assert f"registry state file {state_file} {why}" in log and "left untouched" in log
    assert f"fix: look at it; then repair it, or move it aside and start with no registrations: mv {state_file}" in log
    assert state_file.read_bytes() == content  # kept: never overwritten, never deleted


# --------------------------------------------------------------------------- replicas on etcd


def test_two_replicas_answer_the_same_and_survive_each_other(
    tmp_path: Path, etcd: EtcdServer, engines: Callable[..., Engine], adapters: Callable[..., AdapterProcess]
) -> None:
    registry = f"etcd://127.0.0.1:{etcd.client_port}/kvtest?lease_ttl=2"
    engine = engines()
    replica_a, replica_b = adapters(registry), adapters(registry)
    tokens = prompt(4)
    engine.prefill(tokens, rank=1)

    registered = time.monotonic()
    assert replica_a.register(engine, "vllm-prefill-0")["durable"] is True
    on_a = wait_for(lambda: hit(replica_a, tokens, "vllm-prefill-0", 8 * BS), "the hit on A")
    wait_for(lambda: replica_b.query(tokens) == (200, on_a), "B answering what A answers")
    b_same = time.monotonic() - registered
    assert etcd.keys("/kvtest/registrations/") == ["/kvtest/registrations/default/dsv4-flash/vllm-prefill-0/0"]
    assert wait_for(lambda: replica_b.registry()["replicas_alive"] == 2, "two live replicas")

    replica_a.kill9()
    killed = time.monotonic()
    assert replica_b.query(tokens) == (200, on_a)  # B never depended on A
    # A's lease runs out: its presence key goes, the registration it wrote stays
    wait_for(lambda: replica_b.registry()["replicas_alive"] == 1, "A's lease expired")
    lease_gone = time.monotonic() - killed
    assert etcd.keys("/kvtest/registrations/") == ["/kvtest/registrations/default/dsv4-flash/vllm-prefill-0/0"]
    assert replica_b.query(tokens) == (200, on_a)

    # a replica started now (A's replacement) restores from etcd and answers the same
    started = time.monotonic()
    replica_c = adapters(registry)
    wait_for(lambda: replica_c.query(tokens) == (200, on_a), "the new replica answering the same")
    c_same = time.monotonic() - started

    # Motor removes the instance through whichever replica it reaches: every replica drops it
    status, _ = http(replica_c.url + "/unregister", {"instance_id": "vllm-prefill-0"})
    assert status == 200
    wait_for(lambda: replica_b.instances() == [], "B dropping the registration removed on C")
    assert etcd.keys("/kvtest/registrations/") == [] and replica_b.query(tokens)[0] == 404
    report(
        fault="replicas",
        b_answers_same_s=round(b_same, 3),
        a_lease_gone_s=round(lease_gone, 3),
        new_replica_answers_same_s=round(c_same, 3),
    )


def test_etcd_down_replicas_keep_serving_and_catch_up_when_it_returns(
    tmp_path: Path, etcd: EtcdServer, engines: Callable[..., Engine], adapters: Callable[..., AdapterProcess]
) -> None:
    registry = f"etcd://127.0.0.1:{etcd.client_port}/kvtest?lease_ttl=3&timeout=0.5"
    first, second = engines(), engines()
    replica_a, replica_b = adapters(registry), adapters(registry)
    tokens_1, tokens_2 = prompt(5), prompt(6)
    first.prefill(tokens_1, rank=0)
    second.prefill(tokens_2, rank=1)
    replica_a.register(first, "vllm-prefill-0")
    on_a = wait_for(lambda: hit(replica_a, tokens_1, "vllm-prefill-0", 8 * BS), "the first hit on A")
    wait_for(lambda: replica_b.query(tokens_1) == (200, on_a), "B answering the same")

    etcd.kill()
    wait_for(lambda: not replica_a.registry()["connected"], "A noticing etcd is gone")
    for _ in range(5):  # both keep serving what they know
        assert replica_a.query(tokens_1) == (200, on_a) and replica_b.query(tokens_1) == (200, on_a)
    answered = time.monotonic()
    result = replica_a.register(second, "vllm-prefill-1")  # answered at once, served by A, queued for etcd
    register_s = time.monotonic() - answered
    assert result["durable"] is False and any("not stored yet" in w for w in result["warnings"])
    assert hit(replica_a, tokens_2, "vllm-prefill-1", 8 * BS) or wait_for(
        lambda: hit(replica_a, tokens_2, "vllm-prefill-1", 8 * BS), "A serving the queued registration"
    )
    assert replica_a.registry()["pending"] == 1
    assert matched(replica_b.query(tokens_2)[1], "vllm-prefill-1") == 0  # B cannot know it yet
    replica_c = adapters(registry)  # a replica starting while etcd is down: serves what it knows (nothing)
    assert replica_c.query(tokens_1)[0] == 404 and not replica_c.registry()["connected"]

    etcd.start()  # same data directory, same ports
    back = time.monotonic()
    on_a_2 = wait_for(lambda: hit(replica_a, tokens_2, "vllm-prefill-1", 8 * BS), "A's second hit")
    wait_for(lambda: replica_b.query(tokens_2) == (200, on_a_2), "B catching up with the queued registration")
    caught_up = time.monotonic() - back
    wait_for(lambda: replica_c.query(tokens_2) == (200, on_a_2), "the replica started during the outage catching up")
    c_caught_up = time.monotonic() - back
    assert wait_for(lambda: replica_a.registry()["pending"] == 0 and replica_a.registry()["connected"], "A flushed")
    assert etcd.keys("/kvtest/registrations/") == [
        "/kvtest/registrations/default/dsv4-flash/vllm-prefill-0/0",
        "/kvtest/registrations/default/dsv4-flash/vllm-prefill-1/0",
    ]
    assert replica_b.query(tokens_1) == replica_a.query(tokens_1)
    report(
        fault="etcd_down",
        register_answer_s=round(register_s, 3),
        catch_up_s=round(caught_up, 3),
        started_during_outage_catch_up_s=round(c_caught_up, 3),
    )
