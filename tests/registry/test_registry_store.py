"""The registry stores on their own: the state file's format, refusals, lock and group commit;
choosing a store from ``--registry``; etcd keys; the body ``motor-kv-adapter register`` sends."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from motor_adapter.registry.etcd import EtcdStore
from motor_adapter.registry.file import FORMAT, VERSION, FileStore
from motor_adapter.registry.spec import open_store
from motor_adapter.registry.store import (
    MemoryStore,
    Record,
    RegistryError,
    default_registry_spec,
    default_state_file,
)
from motor_adapter.tools.register_cli import motor_body

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "motor_user_config.json"


def record(instance: str, dp: int = 0, model: str = "m", endpoint: str = "tcp://127.0.0.1:5557") -> Record:
    body = {"instance_id": instance, "dp_rank": dp, "modelname": model, "medium_endpoints": {"npu": endpoint}}
    return Record(("default", model, instance, dp), body, written_at=1.0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _open_put(path: Path, *records: Record) -> FileStore:
    store = FileStore(path)
    await store.open()
    for r in records:
        await store.put(r)
    return store


def test_file_round_trip_in_the_versioned_format(tmp_path: Path) -> None:
    path = tmp_path / "state" / "reg.json"

    async def scenario() -> list[Record]:
        store = await _open_put(path, record("a"), record("b", 1), record("c"))
        assert await store.delete(("default", "m", "c", 0)) is True
        assert await store.delete(("default", "m", "c", 0)) is False
        await store.close()
        again = FileStore(path)
        found = await again.open()
        await again.close()
        return found

    found = run(scenario())
    assert sorted(r.key for r in found) == [("default", "m", "a", 0), ("default", "m", "b", 1)]
    assert found[0].body["medium_endpoints"] == {"npu": "tcp://127.0.0.1:5557"}
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    assert data["registrations"][1]["key"] == {"tenant": "default", "model": "m", "instance_id": "b", "dp_rank": 1}
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in path.parent.iterdir() if ".tmp" in p.name] == []  # replaced atomically


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "is not valid JSON"),
        (b"", "is not valid JSON"),
        (json.dumps({"workers": []}).encode(), "is not a motor-kv-adapter registry file"),
        (json.dumps({"format": FORMAT, "version": 99, "registrations": []}).encode(), "newer motor-kv-adapter"),
        (json.dumps({"format": FORMAT, "version": "1", "registrations": []}).encode(), "unknown format version"),
        (json.dumps({"format": FORMAT, "version": 1}).encode(), 'no "registrations" list'),
    ],
)
def test_bad_or_foreign_file_is_refused_naming_file_and_fix_and_left_untouched(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "reg.json"
    path.write_bytes(content)
    with pytest.raises(RegistryError) as info:
        run(FileStore(path).open())
    message = str(info.value)
    assert str(path) in message and why in message and "fix:" in message and f"mv {path} {path}.bad" in message
    assert path.read_bytes() == content  # never overwritten, never deleted


def test_unusable_entries_are_kept_in_the_rejected_list(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    good = {"key": {"tenant": "default", "model": "m", "instance_id": "a", "dp_rank": 0}, "body": {"instance_id": "a"}}
    bad = {"key": {"tenant": "default"}, "body": {}}
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "registrations": [good, bad]}))

    async def scenario() -> list[Record]:
        store = FileStore(path)
        found = await store.open()
        await store.put(record("b"))
        await store.close()
        return found

    assert [r.key for r in run(scenario())] == [("default", "m", "a", 0)]
    data = json.loads(path.read_text())
    assert data["rejected"] == [bad] and len(data["registrations"]) == 2


def test_a_second_adapter_on_the_same_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"

    async def scenario() -> str:
        first = FileStore(path)
        await first.open()
        try:
            with pytest.raises(RegistryError) as info:
                await FileStore(path).open()
        finally:
            await first.close()
        second = FileStore(path)  # the lock goes with its holder
        await second.open()
        await second.close()
        return str(info.value)

    message = run(scenario())
    assert f"in use by another running motor-kv-adapter (pid {os.getpid()})" in message and "fix:" in message


def test_concurrent_changes_share_writes(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"

    async def scenario() -> FileStore:
        store = FileStore(path)
        await store.open()
        await asyncio.gather(*(store.put(record(f"i{n}")) for n in range(40)))
        await store.close()
        return store

    store = run(scenario())
    assert len(json.loads(path.read_text())["registrations"]) == 40
    assert 1 <= store.writes < 40  # group commit: a write covers every change made before it started


def test_memory_store_and_delete_only_if() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        assert await store.open() == []
        await store.put(record("a"))
        assert await store.delete(("default", "m", "a", 0), only_if=record("a", endpoint="tcp://other:1")) is False
        assert await store.delete(("default", "m", "a", 0), only_if=record("a")) is True
        assert store.changes() is None and store.status()["durable"] is False

    run(scenario())


def test_choosing_a_store(tmp_path: Path) -> None:
    assert isinstance(open_store("memory"), MemoryStore)
    store = open_store(f"file:{tmp_path}/x.json")
    assert isinstance(store, FileStore) and store.path == tmp_path / "x.json"
    assert isinstance(open_store(f"file://{tmp_path}/y.json"), FileStore)
    etcd = open_store("etcd://127.0.0.1:2379,127.0.0.2:2380/team/kv?lease_ttl=4")
    assert isinstance(etcd, EtcdStore)
    assert etcd.prefix == "/team/kv" and etcd.lease_ttl_s == 4
    assert etcd.endpoints == ["http://127.0.0.1:2379", "http://127.0.0.2:2380"]
    assert isinstance(open_store("etcd://127.0.0.1:2379"), EtcdStore)
    for bad in ("redis://x", "file:", "etcd://nohost/p", "etcd://h:1/p?ttl=3", "etcd://h:1/p?lease_ttl=1"):
        with pytest.raises(RegistryError):
            open_store(bad)


def test_default_state_file_follows_xdg(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path), "HOME": "/home/u"}
    assert default_state_file(13333, env) == tmp_path / "motor-kv-adapter" / "registrations-13333.json"
    relative = {"XDG_STATE_HOME": "state", "HOME": "/home/u"}  # the spec: a relative value is ignored
    assert default_state_file(1, relative) == Path("/home/u/.local/state/motor-kv-adapter/registrations-1.json")
    assert default_registry_spec(1, {**env, "MOTOR_KV_ADAPTER_REGISTRY": "memory"}) == "memory"
    assert default_registry_spec(1, env) == f"file:{tmp_path}/motor-kv-adapter/registrations-1.json"


def test_etcd_keys_round_trip_any_name() -> None:
    store = EtcdStore.from_url("etcd://127.0.0.1:2379/p")
    key = ("ten/ant", "org/model:v1", "vllm prefill/0%", 7)
    raw = store._key(key)
    assert raw.startswith(b"/p/registrations/") and raw.count(b"/") == 6
    assert store._reg_key(raw) == key


def test_register_body_is_what_motor_sends_for_the_documented_config() -> None:
    config = json.loads(EXAMPLE.read_text())
    recorded = json.loads((EXAMPLE.parent / "register_motor.json").read_text())  # mindie-motor 3.0.0b2
    assert motor_body(config, "10.0.0.11", "vllm-prefill-0") == recorded
    body = motor_body(config, "10.0.0.5", "vllm-prefill-3", endpoint_id=2)
    assert body == {
        "endpoint": "tcp://10.0.0.5:5559",
        "type": "vLLM",
        "modelname": "dsv4-flash",
        "block_size": 128,
        "instance_id": "vllm-prefill-3",
        "dp_rank": 2,
        "replay_endpoint": "tcp://10.0.0.5:6669",
    }
