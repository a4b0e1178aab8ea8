"""Motor 3.1's native SGLang launcher brings the plugin up through the env config, on SGLang 0.5.23's real parse.

Motor 3.1's node manager starts SGLang natively (``motor/node_manager/core/services/native_engine/
backends/sglang/``, commits in docs/testing.md): the argv is ``python3 -m sglang.launch_server``
plus every ``engine_config`` key as a flag (``_`` -> ``-``, ``true`` -> a bare flag, a list ->
its items, a dict -> JSON; ``engine_type`` and ``kv_transfer_config`` skipped), then
``--enable-metrics``, ``--host``, ``--port`` and the role's ``--disaggregation-mode``
(``prefill``, ``decode``, else ``null``).  Before launching it parses that argv with SGLang's
``ServerArgs.add_cli_args`` (plugins not loaded yet), and the process gets the env config's
environment (plus ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=true``).  Facts, re-stated here;
none of Motor's code is in this repository.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine.test_pd_dispatch import EXAMPLES, LAUNCH_BODY, ROUND_ROBIN_ON, model_dir
from engine.test_plugin import run_script
from sglang_real import requires_sglang_full

__all__ = ["model_dir"]

PREFIX = ("python3", "-m", "sglang.launch_server")
_SKIPPED = ("engine_type", "kv_transfer_config")
_MODES = {"prefill": "prefill", "decode": "decode"}


def native_argv(engine_config: dict[str, Any], role: str, host: str = "127.0.0.1", port: int = 30000) -> list[str]:
    """The argv Motor 3.1's native SGLang backend builds for one endpoint (its prefix included)."""
    config = {**engine_config, "enable-metrics": True, "host": host, "port": port}
    config["disaggregation-mode"] = _MODES.get(role, "null")
    argv = list(PREFIX)
    for key, value in config.items():
        if key in _SKIPPED or value is None:
            continue
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [name] if value else []
        elif isinstance(value, list):
            argv += [name, *map(str, value)] if value else []
        elif isinstance(value, dict):
            argv += [name, json.dumps(value)]
        else:
            argv += [name, str(value)]
    return argv


def native_env(env_config: dict[str, Any], section: str) -> dict[str, str]:
    """The launched process's extra environment: the env config's section, /health pinned on."""
    return {**{k: str(v) for k, v in env_config[section].items()}, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}


@pytest.mark.unit
def test_the_native_argv_of_the_documented_prefill() -> None:
    example = json.loads((EXAMPLES / "motor_user_config.json").read_text())
    argv = native_argv(example["motor_engine_prefill_config"]["engine_config"], "prefill")
    assert tuple(argv[:3]) == PREFIX
    assert "--enable-metrics" in argv and argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert "--plugin" not in argv and "--block-size" not in argv  # SGLang's pre-plugin parse refuses both
    assert native_argv({}, "union")[-2:] == ["--disaggregation-mode", "null"]


@pytest.mark.integration
@requires_sglang_full
@pytest.mark.timeout(300)
def test_motor31s_native_launch_brings_the_plugin_up_by_the_env_config(model_dir: Path) -> None:
    example = json.loads((EXAMPLES / "motor_user_config.json").read_text())
    env_config = json.loads((EXAMPLES / "motor_env_config.json").read_text())
    documented = native_argv(example["motor_engine_prefill_config"]["engine_config"], "prefill")[3:]
    # the same keys a CPU box can start: a dummy model, dp 2, the documented events config
    events = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}
    cpu_config = {
        "model-path": str(model_dir),
        "load-format": "dummy",
        "device": "cpu",
        "dp-size": 2,
        "page-size": 16,
        "kv-events-config": events,
        "disaggregation_bootstrap_port": 8998,
    }
    argv = native_argv(cpu_config, "prefill")[3:]
    params = {"cases": [("native", argv)], "argv": argv, "serve": False, "motor": True, "documented": documented}
    env = native_env(env_config, "motor_engine_prefill_env")
    assert env["SGLANG_KVPUB_ENABLED"] == "1"
    out = run_script(LAUNCH_BODY, params, env, timeout=280)
    # the launcher's own parse (plugins not loaded yet) takes the documented engine_config as it is
    assert out["documented_parse"] == "", out["documented_parse"]
    assert out["documented_args"]["disaggregation_mode"] == "prefill"
    assert out["documented_args"]["disaggregation_bootstrap_port"] == 8998
    assert out["motor_parse"] == ""
    assert "unrecognized arguments: --plugin sglang_kvpub" in out["motor_plugin_flag"]
    # what `python3 -m sglang.launch_server <argv>` then runs, with the env config's environment:
    # the plugin is up (its launcher hook resolved the PD prefill's method and published dispatch on)
    for path in ("native", "motor"):
        assert {k: out[path][k] for k in ("method", "raw")} == ROUND_ROBIN_ON, path
        assert out[path]["dispatch"]["on"] is True, path
