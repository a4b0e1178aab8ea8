"""The SGLang edge: loading through SGLang's real plugin system, --plugin, factory, fan-in, /server_info.

Integration tests run SGLang 0.5.23's own modules (plugin loader, HookRegistry, argument
parsing, publisher factory, describe_kv_events_publisher) in fresh interpreters; see
tests/sglang_real.py for how they load on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from conftest import free_port_block, free_tcp_port
from sglang_real import TESTS_DIR, requires_sglang_full, requires_sglang_kv_events

from sglang_kvpub import wire
from sglang_kvpub.config import ConfigError
from sglang_kvpub.engine import plugin, sglang_compat
from sglang_kvpub.engine.sglang_compat import IncompatibleSGLang, Topology

needs_sglang = requires_sglang_kv_events
PAGE = 128

PRELUDE = f"""
import json, os, sys, time
sys.path[:0] = [{str(TESTS_DIR)!r}, {str(TESTS_DIR.parent)!r}]
import sglang_real
PARAMS = json.loads(os.environ["KVPUB_TEST_PARAMS"])
"""


def run_script(body: str, params: dict[str, Any], env: dict[str, str], timeout: float = 150) -> dict[str, Any]:
    """Runs PRELUDE + body in a fresh interpreter; the script prints one JSON line last."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KVPUB_", "SGLANG_PLUGINS"))}
    full_env.update(env)
    full_env["KVPUB_TEST_PARAMS"] = json.dumps(params)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# =========================================================================== unit


@pytest.mark.unit
def test_parse_version_handles_release_and_post_tags() -> None:
    assert sglang_compat.parse_version("0.5.23") == (0, 5, 23)
    assert sglang_compat.parse_version("0.5.10.post1") == (0, 5, 10)
    assert sglang_compat.parse_version("0.5.22rc1") == (0, 5, 22)
    assert sglang_compat.parse_version("dev") == ()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("version", "ranks", "needle"),
    [
        (None, 1, "not installed"),
        ((0, 5, 9), 1, "0.5.9 has no plugin system"),
        ((0, 5, 21), 4, "0.5.21 does not load plugins in its DataParallelController"),
    ],
)
def test_too_old_sglang_names_version_and_sidecar(version: tuple[int, ...] | None, ranks: int, needle: str) -> None:
    with pytest.raises(IncompatibleSGLang) as info:
        sglang_compat.check_supported(version, ranks)
    assert needle in str(info.value)
    assert "sglang-kvpub fanin" in str(info.value)


@pytest.mark.unit
def test_scheduler_only_versions_run_a_single_rank() -> None:
    sglang_compat.check_supported((0, 5, 11), 1)  # no DP controller needed
    sglang_compat.check_supported((0, 5, 22), 16)
    sglang_compat.check_supported((0, 5, 23), 16)


@pytest.mark.unit
def test_raw_dp_ranks_cover_pure_dp_and_dp_attention() -> None:
    assert sglang_compat.raw_num_dp_ranks(SimpleNamespace(dp_size=4, attn_dp_size=1)) == 4
    assert sglang_compat.raw_num_dp_ranks(SimpleNamespace(dp_size=1, attn_dp_size=16)) == 16
    # deprecated --dp-size 16 --enable-dp-attention: raw attn_dp_size stays 1
    assert sglang_compat.raw_num_dp_ranks(SimpleNamespace(dp_size=16, attn_dp_size=None)) == 16


GOOD = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("config", "kwargs", "needle"),
    [
        (None, {}, "needs --kv-events-config"),
        ('{"publisher": "null"}', {}, "'publisher' = 'null'"),
        ("{not json", {}, "not valid JSON"),
        (json.dumps({"publisher": "zmq", "heartbeat_s": -1}), {}, "heartbeat_s"),
        (json.dumps({"publisher": "zmq", "full_policy": "block"}), {}, "full_policy"),
        (GOOD, {"nnodes": 2}, "internal_channel"),
    ],
)
def test_bad_settings_fail_at_launch_naming_the_key(config: str | None, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        plugin.validate_launch(config, num_dp_ranks=16, version=(0, 5, 23), env={}, **kwargs)
    assert needle in str(info.value)


@pytest.mark.unit
def test_report_deployment_config_validates() -> None:
    config = plugin.validate_launch(GOOD, num_dp_ranks=16, version=(0, 5, 23), env={"SGLANG_KVPUB_HEARTBEAT_S": "0.5"})
    assert (config.endpoint, config.replay_endpoint, config.heartbeat_s) == ("tcp://*:5557", "tcp://*:5600", 0.5)
    multi = json.dumps({"publisher": "zmq", "internal_channel": "tcp://10.0.0.1:5700"})
    assert plugin.validate_launch(multi, num_dp_ranks=16, nnodes=2, version=(0, 5, 23), env={}).internal_channel


@pytest.mark.unit
def test_plugin_flag_is_repeatable_and_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    plugin.add_plugin_argument(parser)
    assert parser.parse_args([]).plugin is None
    assert parser.parse_args(["--plugin", "sglang_kvpub", "--plugin=sglang_kvpub"]).plugin == ["sglang_kvpub"] * 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--plugin", "nonexistent"])
    assert "invalid choice: 'nonexistent'" in capsys.readouterr().err


@pytest.mark.unit
def test_plugin_flag_joins_another_plugins_flag() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", action="append", choices=["other"])
    plugin.add_plugin_argument(parser)
    assert parser.parse_args(["--plugin", "other", "--plugin", "sglang_kvpub"]).plugin == ["other", "sglang_kvpub"]


@pytest.mark.unit
def test_enabled_only_by_the_env_flag() -> None:
    assert not plugin.is_enabled({})
    assert not plugin.is_enabled({"SGLANG_KVPUB_ENABLED": "0"})
    assert plugin.is_enabled({"SGLANG_KVPUB_ENABLED": "1"})
    assert plugin.is_enabled({"SGLANG_KVPUB_ENABLED": " True "})


@pytest.mark.unit
def test_server_info_block_describes_the_instance_stream() -> None:
    sglang_block = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": PAGE,
        "dp_size": 16,
        "replay_endpoint_port_base": 5600,
    }
    described = plugin.describe_instance_stream(sglang_block)
    assert described is not None
    assert described["fanned_in"] is True
    assert described["publisher"] == "sglang_kvpub"
    assert (described["endpoint_port_base"], described["endpoint_port"]) == (5557, 5557)
    assert (described["dp_size"], described["block_size"], described["replay_endpoint_port"]) == (16, PAGE, 5600)
    assert sglang_block["publisher"] == "zmq"  # SGLang's dict is not mutated
    assert plugin.describe_instance_stream(None) is None
    custom = {"publisher": "someone_elses", "endpoint_port_base": 1}
    assert plugin.describe_instance_stream(custom) == custom


@pytest.mark.unit
@pytest.mark.parametrize(
    ("enabled", "topology", "config"),
    [
        ("", Topology(4, True, PAGE), GOOD),  # not enabled
        ("1", Topology(4, True, PAGE, node_rank=1), GOOD),  # node 0 serves the instance
        ("1", Topology(4, True, PAGE), '{"publisher": "null"}'),  # nothing to serve
        ("1", Topology(4, True, PAGE), None),
    ],
)
def test_controller_hook_starts_no_fanin_where_none_belongs(
    monkeypatch: pytest.MonkeyPatch, enabled: str, topology: Topology, config: str | None
) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, enabled)
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: topology)
    calls: list[tuple[Any, ...]] = []
    controller = SimpleNamespace()
    server_args = SimpleNamespace(kv_events_config=config)
    plugin._controller_init_hook(lambda self, *a: calls.append(a), controller, server_args, "port_args")
    assert calls == [(server_args, "port_args")]  # SGLang's __init__ ran with its arguments
    assert getattr(controller, "kvpub_fanin", None) is None


# =========================================================================== integration: loading


@pytest.mark.integration
@needs_sglang
def test_entry_point_is_discoverable_from_the_installed_distribution() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_kvpub") == "sglang_kvpub.plugin:register"


LOADER_BODY = """
sglang_real.prepare("light", server_args_placeholder=True)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
load_plugins()  # idempotent
from sglang.srt.disaggregation.kv_events import EventPublisherFactory
def outcome(config):
    try:
        return type(EventPublisherFactory.create(config, 3)).__name__
    except Exception as exc:  # SGLang 0.5.23 itself raises for "null" (kwargs to a no-arg class)
        return type(exc).__name__
print(json.dumps({
    "plugin_imported": "sglang_kvpub.plugin" in sys.modules,
    "hooks": sorted(HookRegistry._hooks),
    "patched": sorted(HookRegistry._patched),
    "counts": {k: len(v) for k, v in HookRegistry._hooks.items()},
    "factory_wrapped": hasattr(EventPublisherFactory.create, "__wrapped__"),
    "null_publisher": outcome('{"publisher": "null"}'),
    "no_config": outcome(None),
}))
"""


@pytest.mark.integration
@needs_sglang
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("allowlist", "enabled", "expect"),
    [("other_plugin", "1", "nothing"), ("", "", "cli_only"), ("sglang_kvpub,other", "1", "runtime")],
)
def test_sglang_loader_applies_the_plugin_in_a_fresh_interpreter(allowlist: str, enabled: str, expect: str) -> None:
    env = {"SGLANG_KVPUB_ENABLED": enabled}
    if allowlist:
        env["SGLANG_PLUGINS"] = allowlist
    out = run_script(LOADER_BODY, {}, env)
    cli = {sglang_compat.TARGET_ADD_CLI_ARGS, sglang_compat.TARGET_FROM_CLI_ARGS}
    runtime = {sglang_compat.TARGET_FACTORY_CREATE, sglang_compat.TARGET_DESCRIBE}
    runtime.add(sglang_compat.TARGET_CHECK_SERVER_ARGS)
    if expect == "nothing":  # SGLANG_PLUGINS excludes us: not even imported
        assert not out["plugin_imported"]
        assert out["hooks"] == []
        assert not out["factory_wrapped"]
        return
    assert out["plugin_imported"]
    assert out["patched"] == out["hooks"]  # SGLang's apply_hooks() applied every one
    assert all(count == 1 for count in out["counts"].values()), out["counts"]
    if expect == "cli_only":  # installed, not enabled: only the --plugin flag
        assert set(out["hooks"]) == cli
        assert not out["factory_wrapped"]
    else:
        assert set(out["hooks"]) == cli | runtime  # no DP controller loaded here: not hooked
        assert out["factory_wrapped"]
    # Whatever the state, configs the plugin does not serve get SGLang's own outcome.
    assert (out["null_publisher"], out["no_config"]) == ("TypeError", "NullEventPublisher")


CLI_BODY = """
import contextlib, io, runpy
sglang_real.prepare("full")
out = {}
# `python -m sglang.launch_server --help` in this fresh interpreter: its __main__ calls
# load_plugins() before parsing, so the help lists --plugin.
sys.argv, help_text = ["sglang.launch_server", "--help"], io.StringIO()
try:
    with contextlib.redirect_stdout(help_text):
        runpy.run_module("sglang.launch_server", run_name="__main__")
except SystemExit as exc:
    out["help_exit"] = exc.code
out["help_has_plugin"] = "--plugin NAME" in help_text.getvalue()
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import prepare_server_args
load_plugins()
out["patched_at_load"] = sorted(HookRegistry._patched)

def parse(config, extra):
    err = io.StringIO()
    argv = ["--model-path", "dummy", "--kv-events-config", config, "--dp-size", "16",
            "--page-size", str(PARAMS["page"]), *extra]
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv), {"ok": True}
    except SystemExit as exc:
        return None, {"exit": exc.code, "stderr": err.getvalue()[-800:]}
    except Exception as exc:
        return None, {"error": type(exc).__name__, "message": str(exc)}

from sglang.srt.runtime_context import describe_kv_events_publisher
plain_args, out["plain"] = parse(PARAMS["config"], [])
out["plain_enabled"] = os.environ.get("SGLANG_KVPUB_ENABLED")
out["plain_describe"] = describe_kv_events_publisher(plain_args)
from sglang.srt.disaggregation.kv_events import EventPublisherFactory
pub = EventPublisherFactory.create(PARAMS["local_config"], attn_dp_rank=0)
out["plain_publisher"] = type(pub).__name__
pub.shutdown()
_, out["unknown"] = parse(PARAMS["config"], ["--plugin", "nonexistent"])
_, out["bad_key"] = parse(PARAMS["bad_config"], ["--plugin", "sglang_kvpub"])
out["enabled_after_errors"] = os.environ.get("SGLANG_KVPUB_ENABLED")
args, out["enabled"] = parse(PARAMS["config"], ["--plugin", "sglang_kvpub"])
out["env"] = os.environ.get("SGLANG_KVPUB_ENABLED")
out["patched"] = sorted(HookRegistry._patched)
out["describe"] = describe_kv_events_publisher(args)
# `sglang serve --model-type llm ... --plugin sglang_kvpub`: SGLang's serve() up to run_server.
import sglang.launch_server
from sglang.cli.serve import serve
served = []
sglang.launch_server.run_server = served.append
serve(None, ["--model-type", "llm", "--model-path", "dummy", "--kv-events-config", PARAMS["config"],
             "--plugin", "sglang_kvpub"])
out["serve_parsed"] = [type(a).__name__ for a in served]
print(json.dumps(out))
"""


@pytest.mark.integration
@needs_sglang
@requires_sglang_full
@pytest.mark.timeout(200)
def test_plugin_flag_through_sglang_real_argument_parsing() -> None:
    config = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"})
    local = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_tcp_port()}", "bind": True})
    bad = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "event_encoding": "protobuf"})
    params = {"config": config, "local_config": local, "bad_config": bad, "page": PAGE}
    out = run_script(CLI_BODY, params, {}, timeout=190)

    assert out["help_exit"] == 0
    assert out["help_has_plugin"]
    # Loaded, not enabled: the flag exists, nothing else is hooked, SGLang's own publisher.
    assert set(out["patched_at_load"]) == {sglang_compat.TARGET_ADD_CLI_ARGS, sglang_compat.TARGET_FROM_CLI_ARGS}
    assert out["plain"] == {"ok": True}
    assert out["plain_enabled"] is None
    assert out["plain_publisher"] == "ZmqEventPublisher"
    assert out["plain_describe"]["publisher"] == "zmq"
    assert "fanned_in" not in out["plain_describe"]
    # Unknown plugin name: argparse's error, exit 2.
    assert out["unknown"]["exit"] == 2
    assert "invalid choice: 'nonexistent'" in out["unknown"]["stderr"]
    # Bad plugin key: the launcher fails before anything starts, naming the key.
    assert out["bad_key"]["error"] == "ConfigError"
    assert "event_encoding" in out["bad_key"]["message"]
    assert out["enabled_after_errors"] is None
    # Enabled: env for the spawned children, runtime hooks applied, /server_info rewritten.
    assert out["enabled"] == {"ok": True}
    assert out["env"] == "1"
    assert sglang_compat.TARGET_FACTORY_CREATE in out["patched"]
    assert sglang_compat.TARGET_DESCRIBE in out["patched"]
    described = out["describe"]
    assert described["fanned_in"] is True
    assert described["publisher"] == "sglang_kvpub"
    assert (described["endpoint_port_base"], described["dp_size"], described["block_size"]) == (5557, 16, PAGE)
    assert described["replay_endpoint_port_base"] == 5600
    assert out["serve_parsed"] == ["ServerArgs"]


# =========================================================================== integration: stream

RANK_BODY = """
sglang_real.prepare("light", server_args_placeholder=True)
import sglang_kvpub.engine.sglang_compat as compat
p = PARAMS
# The scheduler's runtime context needs a loaded model; state what it would say.
compat.scheduler_topology = lambda: compat.Topology(
    num_dp_ranks=p["dp_size"], uses_dp_controller=p["dp_size"] > 1, block_size=p["page"])
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch, BlockStored, BlockRemoved
import zmq
rank = p["rank"]
pub = EventPublisherFactory.create(p["config"], attn_dp_rank=rank)  # as SchedulerKvEventsPublisher does
rank_port_free = True
if rank > 0:
    probe = zmq.Context.instance().socket(zmq.PUB)
    try:
        probe.bind(f"tcp://127.0.0.1:{p['base'] + rank}")
    except zmq.ZMQError:
        rank_port_free = False
    probe.close(linger=0)
print(json.dumps({"ready": True}), flush=True)
if p["wait"]:
    sys.stdin.readline()
for k in range(p["batches"]):
    h = rank * 1_000_000 + k
    events = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(p["page"])),
                          block_size=p["page"], lora_id=None)]
    if k % 3 == 2:
        events.append(BlockRemoved(block_hashes=[h - 1]))
    pub.publish(KVEventBatch(ts=time.time(), events=events))
if p["wait"]:
    sys.stdin.readline()
pub.shutdown()
print(json.dumps({"type": type(pub).__name__, "block_size": pub.rank.block_size,
                  "serves_stream": pub.fanin is not None, "rank_port_free": rank_port_free}))
"""


@pytest.fixture
def private_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # The internal ipc channel lives in <XDG_RUNTIME_DIR>/sglang-kvpub-<uid>/: keep ours apart,
    # under a short path (ipc socket paths are limited to ~107 bytes).
    path = Path(tempfile.mkdtemp(prefix="kvp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sub_context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe_until_live(context: zmq.Context[Any], endpoint: str, deadline_s: float = 20.0) -> zmq.Socket[bytes]:
    """SUB connected and proven live by receiving one (heartbeat) message."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    assert sub.poll(int(deadline_s * 1000)), "no heartbeat from the instance stream"
    sub.recv_multipart()
    return sub


def collect(
    sub: zmq.Socket[bytes], want: dict[int, int], deadline_s: float = 40.0
) -> list[tuple[int, wire.EventBatch]]:
    """(seq, batch) of non-heartbeat batches until every rank delivered its count."""
    decoder = wire.BatchDecoder()
    got: list[tuple[int, wire.EventBatch]] = []
    counts = dict.fromkeys(want, 0)
    end = time.monotonic() + deadline_s
    while any(counts[r] < n for r, n in want.items()) and time.monotonic() < end:
        if not sub.poll(200):
            continue
        _topic, seq, payload = wire.parse_live_frames(sub.recv_multipart())
        batch = decoder.decode(payload)
        if batch.events:
            got.append((seq, batch))
            if batch.dp_rank is not None:
                counts[batch.dp_rank] = counts.get(batch.dp_rank, 0) + 1
    return got


def check_rank_stream(got: list[tuple[int, wire.EventBatch]], dp_size: int, batches: int) -> None:
    per_rank: dict[int, list[int]] = {r: [] for r in range(dp_size)}
    for _seq, batch in got:
        assert batch.dp_rank is not None
        stored = [e for e in batch.events if isinstance(e, wire.BlockStored)]
        assert stored, batch
        for event in batch.events:
            assert not isinstance(event, wire.AllBlocksCleared)
            assert event.medium == wire.MEDIUM_GPU  # SGLang left it empty
        for event in stored:
            assert event.block_size == PAGE
            assert event.block_hashes[0] // 1_000_000 == batch.dp_rank  # batches never mix ranks
            per_rank[batch.dp_rank].append(event.block_hashes[0] % 1_000_000)
    for rank in range(dp_size):
        assert per_rank[rank] == list(range(batches)), f"rank {rank}: {per_rank[rank]}"
    seqs = [seq for seq, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


@pytest.mark.integration
@needs_sglang
@pytest.mark.timeout(120)
def test_ranks_through_sglang_factory_fan_in_to_one_instance_stream(
    private_runtime_dir: Path, sub_context: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    dp_size, batches = 4, 12
    base = free_port_block(dp_size + 1)
    config = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{base}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{free_tcp_port()}",
            "heartbeat_s": 0.2,
        }
    )
    # The DataParallelController hook, as SGLang would call it (the real controller
    # module needs a GPU stack to import): it starts the fan-in before the schedulers.
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: Topology(dp_size, True, PAGE))
    launched: list[bool] = []
    controller = SimpleNamespace()
    plugin._controller_init_hook(
        lambda self, *a, **k: launched.append(True), controller, SimpleNamespace(kv_events_config=config), None
    )
    fanin = controller.kvpub_fanin
    assert launched == [True] and fanin is not None
    try:
        sub = subscribe_until_live(sub_context, f"tcp://127.0.0.1:{base}")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", PRELUDE + textwrap.dedent(RANK_BODY)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    **os.environ,
                    "KVPUB_TEST_PARAMS": json.dumps(
                        {
                            "config": config,
                            "rank": r,
                            "dp_size": dp_size,
                            "page": PAGE,
                            "batches": batches,
                            "base": base,
                            "wait": False,
                        }
                    ),
                },
            )
            for r in range(dp_size)
        ]
        try:
            got = collect(sub, dict.fromkeys(range(dp_size), batches))
            reports = []
            for proc in procs:
                stdout, stderr = proc.communicate(timeout=60)
                assert proc.returncode == 0, stderr[-3000:]
                reports.append(json.loads(stdout.strip().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for report in reports:
            assert report == {
                "type": "KvPubEventPublisher",
                "block_size": PAGE,
                "serves_stream": False,
                "rank_port_free": True,
            }
        check_rank_stream(got, dp_size, batches)
        stats = fanin.stats()
        assert stats["never_seen"] == []
        assert all(rank["gaps"] == 0 for rank in stats["ranks"].values())
    finally:
        fanin.stop()


@pytest.mark.integration
@needs_sglang
@pytest.mark.timeout(120)
def test_single_rank_without_dp_controller_serves_the_stream_itself(
    private_runtime_dir: Path, sub_context: zmq.Context[Any]
) -> None:
    batches = 9
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = json.dumps({"publisher": "zmq", "endpoint": endpoint, "bind": True, "heartbeat_s": 0.2})
    params = {"config": config, "rank": 0, "dp_size": 1, "page": PAGE, "batches": batches, "base": 0, "wait": True}
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(RANK_BODY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SGLANG_KVPUB_ENABLED": "1", "KVPUB_TEST_PARAMS": json.dumps(params)},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line and json.loads(line) == {"ready": True}, proc.stderr.read() if proc.stderr else ""
        sub = subscribe_until_live(sub_context, endpoint)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        got = collect(sub, {0: batches})
        proc.stdin.write("done\n")
        proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["type"] == "KvPubEventPublisher" and report["serves_stream"] is True
    check_rank_stream(got, 1, batches)
