"""Cache-aware dispatch on a PD prefill: which load-balance method SGLang runs.

Unit: :func:`sglang_kvpub.core.load_balance.plan_dispatch` and ``sglang-kvpub check-config``.
Integration: SGLang 0.5.23's real argument parsing, resolution and ``check_server_args`` in
fresh interpreters, on every launch path (``--plugin``, ``sglang serve``, the env var,
Motor's engine-server parse), reading back what SGLang's processes will be published.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from sglang_real import requires_sglang_full

from engine.test_plugin import run_script
from sglang_kvpub.core.load_balance import FOLLOW_BOOTSTRAP_ROOM, plan_dispatch
from sglang_kvpub.engine import guard, plugin, sglang_compat

BENCH = Path(__file__).resolve().parents[2] / "bench"


# =========================================================================== unit


def plan(method: str | None = "auto", mode: str = "prefill", ranks: int = 2, dispatch: str = "cache_aware") -> Any:
    return plan_dispatch(dp_dispatch=dispatch, requested_method=method, disaggregation_mode=mode, num_dp_ranks=ranks)


@pytest.mark.unit
def test_a_pd_prefill_on_auto_switches_to_round_robin_and_dispatches() -> None:
    got = plan("auto")
    assert (got.on, got.method, got.switch_to) == (True, "round_robin", "round_robin")
    assert "bootstrap server" in got.reason and "decode queries" in got.reason
    assert plan(None).switch_to == "round_robin"  # unset is auto
    # Once switched (the controller reads the declared method), it reads as on, nothing more to do.
    again = plan_dispatch(
        dp_dispatch="cache_aware",
        requested_method="auto",
        resolved_method="round_robin",
        disaggregation_mode="prefill",
        num_dp_ranks=16,
    )
    assert (again.on, again.switch_to, again.method) == (True, None, "round_robin")
    assert "auto resolved to round_robin" in again.reason


@pytest.mark.unit
def test_an_explicit_follow_bootstrap_room_turns_dispatch_off_and_says_so() -> None:
    got = plan(FOLLOW_BOOTSTRAP_ROOM)
    assert (got.on, got.method, got.switch_to) == (False, FOLLOW_BOOTSTRAP_ROOM, None)
    assert "was asked for" in got.reason
    assert got.line().startswith("cache-aware DP dispatch off (--load-balance-method follow_bootstrap_room)")
    # A controller that still runs follow_bootstrap_room (the launcher did not switch it) is off too.
    stuck = plan_dispatch(
        dp_dispatch="cache_aware",
        requested_method="auto",
        resolved_method=FOLLOW_BOOTSTRAP_ROOM,
        disaggregation_mode="prefill",
        num_dp_ranks=2,
        switchable=False,
    )
    assert not stuck.on and stuck.switch_to is None and "did not switch" in stuck.reason


@pytest.mark.unit
@pytest.mark.parametrize(
    ("method", "mode", "ranks", "dispatch", "on", "resolved"),
    [
        ("auto", "null", 2, "cache_aware", True, "round_robin"),  # no PD: SGLang's auto is round robin
        ("auto", "decode", 2, "cache_aware", True, "round_robin"),
        ("total_tokens", "prefill", 2, "cache_aware", True, "total_tokens"),
        ("round_robin", "prefill", 2, "cache_aware", True, "round_robin"),
        ("auto", "prefill", 2, "default", False, FOLLOW_BOOTSTRAP_ROOM),  # opted out: SGLang's own
        ("auto", "prefill", 1, "cache_aware", False, FOLLOW_BOOTSTRAP_ROOM),  # one rank: no controller
        ("shortest_queue", "null", 2, "cache_aware", False, "shortest_queue"),  # a method the hook does not wrap
    ],
)
def test_every_other_case_keeps_sglangs_method(
    method: str, mode: str, ranks: int, dispatch: str, on: bool, resolved: str
) -> None:
    got = plan(method, mode, ranks, dispatch)
    assert (got.on, got.method, got.switch_to) == (on, resolved, None)
    assert got.as_dict() == {"on": on, "load_balance_method": resolved, "reason": got.reason}


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_check_config_says_whether_a_prefill_dispatches() -> None:
    cmd = [sys.executable, "-m", "sglang_kvpub.cli", "check-config", "--kv-events-config", '{"publisher": "zmq"}']
    cmd += ["--dp-size", "16", "--disaggregation-mode", "prefill"]

    def run(*extra: str) -> dict[str, Any]:
        done = subprocess.run([*cmd, *extra, "--json"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout)["dispatch"])

    assert run() == {"on": True, "load_balance_method": "round_robin", "reason": plan("auto", ranks=16).reason}
    off = run("--load-balance-method", FOLLOW_BOOTSTRAP_ROOM)
    assert not off["on"] and off["load_balance_method"] == FOLLOW_BOOTSTRAP_ROOM
    text = subprocess.run(
        [*cmd, "--load-balance-method", FOLLOW_BOOTSTRAP_ROOM], capture_output=True, text=True, timeout=30
    )
    assert "cache-aware DP dispatch off (--load-balance-method follow_bootstrap_room)" in text.stdout


@pytest.mark.unit
@pytest.mark.parametrize(("running", "attached"), [("FOLLOW_BOOTSTRAP_ROOM", False), ("ROUND_ROBIN", True)])
def test_the_controller_attaches_only_under_a_method_it_hooks(
    running: str, attached: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the DP controller really runs decides, whatever the launcher did: never "on" when off."""
    guard.reset()
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    topology = sglang_compat.Topology(num_dp_ranks=2, uses_dp_controller=True, block_size=16)
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: topology)
    monkeypatch.setattr(plugin, "start_controller_fanin", lambda config, topo: None)
    controller = types.SimpleNamespace(workers=[1, 2], load_balance_method=types.SimpleNamespace(name=running))
    server_args = types.SimpleNamespace(kv_events_config='{"publisher": "zmq"}', disaggregation_mode="prefill")
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        plugin._controller_init_hook(lambda self, *a: None, controller, server_args)
    assert (getattr(controller, "kvpub_dispatcher", None) is not None) is attached
    lines = [r.getMessage() for r in caplog.records if "cache-aware DP dispatch" in r.getMessage()]
    state = "on" if attached else "off"
    assert lines and all(f"cache-aware DP dispatch {state} (--load-balance-method" in line for line in lines), lines
    assert not any(guard.stats()["failures"].values())


@pytest.mark.unit
def test_the_launcher_hook_switches_once_and_a_failure_never_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    guard.reset()
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    args = types.SimpleNamespace(
        load_balance_method="auto", disaggregation_mode="prefill", dp_size=2, kv_events_config='{"publisher": "zmq"}'
    )
    declared: list[str] = []
    monkeypatch.setattr(sglang_compat, "declare_load_balance_method", lambda a, method: declared.append(method))
    assert plugin._check_server_args_hook(lambda self: "checked", args) == "checked"
    assert declared == ["round_robin"]

    def broken(a: Any, method: str) -> None:
        raise RuntimeError("published already")

    monkeypatch.setattr(sglang_compat, "declare_load_balance_method", broken)
    assert plugin._check_server_args_hook(lambda self: "checked", args) == "checked"  # SGLang's check still ran
    assert guard.stats()["failures"][guard.DISPATCH] == 1 and guard.disabled(guard.DISPATCH)
    guard.reset()


# =========================================================================== integration

LAUNCH_BODY = """
import argparse, contextlib, io
sglang_real.prepare("full")
out = {}

def parse_like_motor(argv):
    # Motor's engine server (motor/engine_server/core/sglang/sglang_config.py): engine_config as
    # flags, parsed with ServerArgs.add_cli_args before SGLang's load_plugins() has run.
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(prog="serve")
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return ServerArgs.from_cli_args(parser.parse_args(argv)), ""
    except SystemExit:
        return None, err.getvalue()[-600:]

if PARAMS["motor"]:
    documented, out["documented_parse"] = parse_like_motor(PARAMS["documented"])
    out["documented_args"] = None if documented is None else {
        "disaggregation_mode": documented.disaggregation_mode,
        "disaggregation_bootstrap_port": documented.disaggregation_bootstrap_port,
        "load_balance_method": documented.load_balance_method,
    }
    _, out["motor_plugin_flag"] = parse_like_motor([*PARAMS["argv"], "--plugin", "sglang_kvpub"])
    _, out["motor_block_size"] = parse_like_motor([*PARAMS["argv"], "--block-size", "128"])
    motor_args, out["motor_parse"] = parse_like_motor(PARAMS["argv"])

from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.runtime_context import describe_kv_events_publisher
load_plugins()

def launch(server_args):
    # What Engine._launch_subprocesses does before it publishes the config to any process.
    server_args.resolve_once()
    load_plugins()
    server_args.check_server_args()
    return {"method": resolution_result(server_args, "load_balance_method"),
            "raw": server_args.load_balance_method,
            "dispatch": (describe_kv_events_publisher(server_args) or {}).get("dp_dispatch")}

for name, argv in PARAMS["cases"]:
    out[name] = launch(prepare_server_args(argv))
if PARAMS["serve"]:
    import sglang.launch_server
    from sglang.cli.serve import serve
    served = []
    sglang.launch_server.run_server = served.append
    serve(None, ["--model-type", "llm", *PARAMS["argv"], "--plugin", "sglang_kvpub"])
    out["serve"] = launch(served[0])
if PARAMS["motor"]:
    out["motor"] = launch(motor_args)
print(json.dumps(out))
"""


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def motor_engine_flags(engine_config: dict[str, Any], role: str) -> list[str]:
    """What Motor's engine launcher makes of an engine_config (the 3.1 line's
    ``motor/engine_server/core/sglang/sglang_config.py``: ``_`` -> ``-``, ``true`` -> a bare
    flag, a dict -> JSON, plus its own ``--host``/``--port`` and the role's
    ``--disaggregation-mode``)."""
    flags: list[str] = []
    config = {**engine_config, "host": "127.0.0.1", "port": 30000, "disaggregation-mode": role}
    for key, value in config.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags += [name] if value else []
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    return flags


def _argv(model: Path, *extra: str) -> list[str]:
    events = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"})
    return [
        "--model-path",
        str(model),
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--dp-size",
        "2",
        "--page-size",
        "16",
        "--kv-events-config",
        events,
        "--disaggregation-mode",
        "prefill",
        *extra,
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(BENCH))
    import sglang_server

    return Path(sglang_server.make_model_dir(tmp_path_factory.mktemp("pd-model")))


ROUND_ROBIN_ON = {"method": "round_robin", "raw": "auto"}


@pytest.mark.integration
@requires_sglang_full
@pytest.mark.timeout(300)
def test_launch_paths_with_the_plugin_flag_switch_a_pd_prefill_to_round_robin(model_dir: Path) -> None:
    argv = _argv(model_dir)
    cases = [
        ("no_plugin", argv),  # first: nothing enabled yet in this interpreter
        ("plugin", [*argv, "--plugin", "sglang_kvpub"]),
        ("explicit_follow", [*argv, "--plugin", "sglang_kvpub", "--load-balance-method", FOLLOW_BOOTSTRAP_ROOM]),
    ]
    params = {"cases": cases, "argv": argv, "serve": True, "motor": False, "documented": []}
    out = run_script(LAUNCH_BODY, params, {}, timeout=280)
    assert out["no_plugin"] == {"method": FOLLOW_BOOTSTRAP_ROOM, "raw": "auto", "dispatch": None}
    for path in ("plugin", "serve"):
        got = out[path]
        assert {k: got[k] for k in ("method", "raw")} == ROUND_ROBIN_ON, path
        assert got["dispatch"]["on"] is True and got["dispatch"]["load_balance_method"] == "round_robin"
    explicit = out["explicit_follow"]
    assert explicit["method"] == explicit["raw"] == FOLLOW_BOOTSTRAP_ROOM
    assert explicit["dispatch"]["on"] is False and "was asked for" in explicit["dispatch"]["reason"]


@pytest.mark.integration
@requires_sglang_full
@pytest.mark.timeout(300)
def test_the_env_var_path_and_motors_engine_parse_switch_it_too(model_dir: Path) -> None:
    argv = _argv(model_dir)
    cases = [("env", argv), ("env_decode", [*_argv(model_dir)[:-2], "--disaggregation-mode", "decode"])]
    example = json.loads((EXAMPLES / "motor_user_config.json").read_text())
    env_config = json.loads((EXAMPLES / "motor_env_config.json").read_text())
    documented = motor_engine_flags(example["motor_engine_prefill_config"]["engine_config"], "prefill")
    params = {"cases": cases, "argv": argv, "serve": False, "motor": True, "documented": documented}
    engine_env = {k: str(v) for k, v in env_config["motor_engine_prefill_env"].items()}
    assert engine_env["SGLANG_KVPUB_ENABLED"] == "1"  # the documented env config enables the plugin
    out = run_script(LAUNCH_BODY, params, engine_env, timeout=280)
    # The documented prefill engine_config passes Motor's engine-server parse as it is.
    assert out["documented_parse"] == "", out["documented_parse"]
    assert out["documented_args"] == {
        "disaggregation_mode": "prefill",
        "disaggregation_bootstrap_port": 8998,
        "load_balance_method": "auto",  # left to SGLang: the plugin switches it
    }
    for path in ("env", "motor"):
        assert {k: out[path][k] for k in ("method", "raw")} == ROUND_ROBIN_ON, path
        assert out[path]["dispatch"]["on"] is True
    assert out["env_decode"]["method"] == "round_robin" and out["env_decode"]["dispatch"]["on"] is True
    # Motor's engine server parses before load_plugins(): the plugin's flag does not exist yet,
    # and --block-size is no SGLang flag at all.  So engine_config carries neither.
    assert out["motor_parse"] == ""
    assert "unrecognized arguments: --plugin sglang_kvpub" in out["motor_plugin_flag"]
    assert "unrecognized arguments: --block-size 128" in out["motor_block_size"]
