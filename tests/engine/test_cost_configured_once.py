"""One rank cost, configured once, for both halves: the engine's dispatcher takes the adapter's
weights and hot-spot guard from the plugin config, a bad value fails at launch naming the key,
both ``check-config`` commands fail on a mismatch (run as real CLI processes), and the
controller's per-decision log line has a level and a sampling switch.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import offline_adapter

from motor_adapter.settings import ServiceConfig
from sglang_kvpub import wire
from sglang_kvpub.config import COST_KEYS, ConfigError, PluginConfig
from sglang_kvpub.core.dispatch import CacheAwareDispatcher, DispatchDecision
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.engine import dispatch_hook, guard, plugin, sglang_compat

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
BS = 16
RANKS = 4
MODEL = "m"
STREAM = "tcp://127.0.0.1:5557"
# A cost far from the defaults: CPU hits count little, load counts half, the guard is on.
COST = {"w_cpu": 0.25, "load_weight": 0.5, "overlap_credit": 0.9, "hotspot_spread": 2000.0, "hotspot_relative": None}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KVPUB_")}


# =========================================================================== plugin config


@pytest.mark.unit
def test_the_plugin_reads_the_cost_from_its_json_and_the_environment() -> None:
    config = PluginConfig.from_kv_events_json(
        json.dumps({"publisher": "zmq", "w_cpu": 0.0, "hotspot_spread": 16384}),
        env={"SGLANG_KVPUB_W_CPU": "0.5", "SGLANG_KVPUB_LOAD_WEIGHT": "2", "SGLANG_KVPUB_HOTSPOT_RELATIVE": "null"},
    )
    assert config.cost() == {
        "w_npu": 1.0,
        "w_cpu": 0.0,  # the JSON wins over the environment
        "w_disk": 0.0,
        "prefill_load_scale": 1.0,
        "overlap_credit": 1.0,
        "load_weight": 2.0,
        "hotspot_spread": 16384,
        "hotspot_relative": None,
    }
    assert set(config.cost()) == set(COST_KEYS)
    assert (config.dispatch_log, config.dispatch_log_every) == ("debug", 1)  # quiet by default


@pytest.mark.unit
@pytest.mark.parametrize(
    ("json_text", "env", "named"),
    [
        ('{"publisher": "zmq", "w_cpu": -1}', {}, "key 'w_cpu' (env SGLANG_KVPUB_W_CPU) = -1"),
        ('{"publisher": "zmq"}', {"SGLANG_KVPUB_LOAD_WEIGHT": "heavy"}, "SGLANG_KVPUB_LOAD_WEIGHT) = 'heavy'"),
        ('{"publisher": "zmq", "hotspot_spread": "big"}', {}, "key 'hotspot_spread'"),
        ('{"publisher": "zmq", "dispatch_log": "loud"}', {}, "use one of 'debug', 'info', 'off'"),
        ('{"publisher": "zmq"}', {"SGLANG_KVPUB_DISPATCH_LOG_EVERY": "0"}, "key 'dispatch_log_every'"),
    ],
)
def test_a_bad_cost_value_stops_the_launch_naming_the_key_and_the_fix(
    json_text: str, env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        plugin.validate_launch(json_text, num_dp_ranks=16, version=(0, 5, 23), env=env)
    assert named in str(caught.value)
    assert "use " in str(caught.value)  # the fix


@pytest.mark.unit
def test_the_controller_builds_its_dispatcher_with_the_configured_cost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    guard.reset()
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    topology = sglang_compat.Topology(num_dp_ranks=RANKS, uses_dp_controller=True, block_size=BS)
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: topology)
    monkeypatch.setattr(plugin, "start_controller_fanin", lambda config, topo: None)
    method = types.SimpleNamespace(name="ROUND_ROBIN")
    controller = types.SimpleNamespace(workers=[1] * RANKS, load_balance_method=method)
    events = json.dumps({"publisher": "zmq", **COST, "dispatch_log": "info", "dispatch_log_every": 10})
    server_args = types.SimpleNamespace(kv_events_config=events, disaggregation_mode="null")
    with caplog.at_level(logging.INFO, logger=dispatch_hook.__name__):
        plugin._controller_init_hook(lambda self, *a: None, controller, server_args)
    dispatcher = controller.kvpub_dispatcher
    params = dispatcher.params
    assert (params.w_cpu, params.load_weight, params.overlap_credit) == (0.25, 0.5, 0.9)
    assert (params.hotspot_spread, params.hotspot_relative) == (2000.0, None)
    dlog = getattr(controller, dispatch_hook.LOG_ATTR)
    assert (dlog.level, dlog.every) == (logging.INFO, 10)
    assert any("w_cpu=0.25" in r.getMessage() and "load_weight=0.5" in r.getMessage() for r in caplog.records)
    assert not any(guard.stats()["failures"].values())


@pytest.mark.unit
def test_a_bad_cost_in_the_controller_switches_dispatch_off_and_never_stops_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The launcher refuses a bad value; a controller that gets one anyway (the env-only path)
    runs on with SGLang's own dispatch, the failure logged and counted."""
    guard.reset()
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    monkeypatch.setenv("SGLANG_KVPUB_W_CPU", "-1")
    topology = sglang_compat.Topology(num_dp_ranks=RANKS, uses_dp_controller=True, block_size=BS)
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: topology)
    monkeypatch.setattr(plugin, "start_controller_fanin", lambda config, topo: None)
    method = types.SimpleNamespace(name="ROUND_ROBIN")
    controller = types.SimpleNamespace(workers=[1] * RANKS, load_balance_method=method)
    server_args = types.SimpleNamespace(kv_events_config='{"publisher": "zmq"}', disaggregation_mode="null")
    with caplog.at_level(logging.WARNING):
        assert plugin._controller_init_hook(lambda self, *a: "built", controller, server_args) == "built"
    assert getattr(controller, "kvpub_dispatcher", None) is None
    assert guard.stats()["failures"][guard.DISPATCH] == 1
    assert any("SGLANG_KVPUB_W_CPU" in r.getMessage() for r in caplog.records)
    guard.reset()


# =========================================================================== one answer


class Halves:
    """The adapter (its state, as /query answers) and one instance's dispatcher, both configured
    from files as an operator would: the adapter's serve --config, the plugin's JSON."""

    def __init__(self, tmp_path: Path, engine_cost: dict[str, Any], adapter_cost: dict[str, Any]) -> None:
        adapter_file = tmp_path / "adapter.json"
        adapter_file.write_text(json.dumps({"kv_affinity": {**adapter_cost, "block_size": BS}}))
        config = ServiceConfig.from_file(str(adapter_file), env={})
        self.state, self.affinity = offline_adapter(config, [("vllm-prefill-0", STREAM)], BS, MODEL)
        config = PluginConfig.from_kv_events_json(json.dumps({"publisher": "zmq", **engine_cost}), env={})
        self.dispatcher = CacheAwareDispatcher(RANKS, BS, **config.cost())
        self.codec = wire.LoadReportCodec()

    def store(self, rank: int, tokens: list[int], medium: str) -> None:
        keys = sequence_keys(tokens, BS)
        event = wire.BlockStored(keys, None, tokens[: len(keys) * BS], BS, medium=medium)
        batch = wire.EventBatch(0.0, [event], rank)
        self.affinity.index.apply_batch(STREAM, batch)
        self.dispatcher.observe(batch, rank)

    def both(self, tokens: list[int], loads: list[float], now: float) -> tuple[int, int]:
        figures = wire.RankLoads([wire.RankLoad(r, load) for r, load in enumerate(loads)], {}, 0.1)
        report = self.codec.decode(self.codec.encode(now, figures))
        assert report is not None
        self.affinity.loads.apply(STREAM, report)
        entry = self.state.query(MODEL, "default", BS, tokens)["default"]["vllm-prefill-0"]
        chosen = self.dispatcher.choose(tokens, loads)
        assert chosen.rank is not None
        return int(entry["dp_detail"]["0"]["scored_rank"]), chosen.rank


def _cases(seed: int) -> list[tuple[list[int], list[float]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(60):
        tokens = [rng.randrange(1, 50_000) for _ in range(rng.randint(4, 12) * BS)]
        cases.append((tokens, [rng.uniform(0, 300) for _ in range(RANKS)]))
    return cases


def _run(halves: Halves, seed: int) -> tuple[int, int]:
    """Each prompt held on CPU by one rank and (a shorter prefix) on the device by another;
    returns (requests on which both halves agree, requests)."""
    agreed = total = 0
    for n, (tokens, loads) in enumerate(_cases(seed)):
        halves.store(n % RANKS, tokens, wire.MEDIUM_CPU)
        halves.store((n + 1) % RANKS, tokens[: len(tokens) // 2], wire.MEDIUM_GPU)
        scored, chosen = halves.both(tokens, loads, float(n))
        agreed += int(scored == chosen)
        total += 1
    return agreed, total


@pytest.mark.unit
def test_configured_the_same_the_dispatcher_picks_the_adapters_rank(tmp_path: Path) -> None:
    agreed, total = _run(Halves(tmp_path, COST, COST), seed=3)
    assert agreed == total


@pytest.mark.unit
def test_configured_differently_the_halves_part(tmp_path: Path) -> None:
    """The control: the engine left at the defaults disagrees with that adapter on these inputs,
    so the agreement above comes from the configured cost, not from easy inputs."""
    agreed, total = _run(Halves(tmp_path, {}, COST), seed=3)
    assert agreed < total


# =========================================================================== check-config


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env or _clean_env()
    )


@pytest.mark.unit
def test_motor_check_config_fails_on_an_engine_adapter_weight_mismatch(tmp_path: Path) -> None:
    env_config = json.loads((EXAMPLES / "motor_env_config.json").read_text())
    del env_config["motor_engine_prefill_env"]["SGLANG_KVPUB_W_CPU"]  # the engine at w_cpu=1
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps(env_config))
    common = ["-m", "motor_adapter.cli", "check-config", str(EXAMPLES / "motor_user_config.json")]
    adapter = ["--adapter-config", str(EXAMPLES / "adapter_config.json")]
    bad = _cli(*common, "--env-config", str(env_file), *adapter)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "problem: cost.w_cpu: motor_engine_prefill_config dispatches with w_cpu=1" in bad.stdout
    assert "adapter scores with w_cpu=0" in bad.stdout
    assert "SGLANG_KVPUB_W_CPU=0 in motor_engine_prefill_env of Motor's env config" in bad.stdout
    shipped = _cli(*common, "--env-config", str(EXAMPLES / "motor_env_config.json"), *adapter)
    assert "cost." not in shipped.stdout  # the shipped examples configure both halves alike
    assert shipped.returncode == 0, shipped.stdout


@pytest.mark.unit
def test_sglang_kvpub_check_config_fails_on_an_engine_adapter_weight_mismatch() -> None:
    common = ["-m", "sglang_kvpub.cli", "check-config", "--kv-events-config", '{"publisher": "zmq"}']
    common += ["--dp-size", "16", "--adapter-config", str(EXAMPLES / "adapter_config.json")]
    bad = _cli(*common)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "problem: cost.w_cpu: the engine dispatches with w_cpu=1 (default; SGLANG_KVPUB_W_CPU unset)" in bad.stdout
    assert "1 key(s)" in bad.stdout
    good = _cli(*common, env={**_clean_env(), "SGLANG_KVPUB_W_CPU": "0.0"})
    assert good.returncode == 0, good.stdout + good.stderr
    assert "rank cost: the same as the adapter's" in good.stdout
    report = json.loads(_cli(*common, "--json").stdout)
    assert report["cost"]["w_cpu"] == 1.0 and len(report["cost_mismatches"]) == 1


# =========================================================================== the log switch


def _decision(rank: int) -> DispatchDecision:
    return DispatchDecision(rank, "no_hit", 64, 0, 0, 0, 0, 0.0, 64.0)


def _controller(dlog: dispatch_hook.DecisionLog) -> tuple[Any, CacheAwareDispatcher]:
    dispatcher = CacheAwareDispatcher(2, BS)
    controller = types.SimpleNamespace(
        dp_budget=None, _active_workers=[0, 1], status=[True, True], workers=[object(), object()]
    )
    setattr(controller, dispatch_hook.LOG_ATTR, dlog)
    return controller, dispatcher


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "dp_dispatch policy=" in r.getMessage()]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("level", "every", "capture", "expected"),
    [
        ("debug", 1, logging.INFO, 0),  # the default: nothing at SGLang's usual info level
        ("debug", 1, logging.DEBUG, 9),
        ("info", 1, logging.INFO, 9),
        ("info", 4, logging.INFO, 3),  # decisions 1, 5, 9
        ("off", 1, logging.DEBUG, 0),
    ],
)
def test_the_per_decision_log_has_a_level_and_a_sample_switch(
    caplog: pytest.LogCaptureFixture, level: str, every: int, capture: int, expected: int
) -> None:
    controller, dispatcher = _controller(dispatch_hook.DecisionLog(level, every))
    with caplog.at_level(capture, logger=dispatch_hook.__name__):
        for n in range(9):
            req = types.SimpleNamespace(input_ids=list(range(n, n + 3 * BS)), rid=f"r{n}", lora_name=None)
            assert dispatch_hook._choose_rank(controller, dispatcher, req) in (0, 1)
    lines = _lines(caplog)
    assert len(lines) == expected
    if expected:
        assert {r.levelno for r in lines} == {logging.INFO if level == "info" else logging.DEBUG}
        assert lines[0].getMessage().endswith("rid=r0")


@pytest.mark.unit
def test_the_decision_log_refuses_a_bad_switch() -> None:
    with pytest.raises(ValueError, match="dispatch_log"):
        dispatch_hook.DecisionLog("loud")
    with pytest.raises(ValueError, match="dispatch_log_every"):
        dispatch_hook.DecisionLog("info", 0)
    dlog = dispatch_hook.DecisionLog("off")
    dlog(_decision(0), "x")
    assert dlog.decisions == 0


@pytest.mark.unit
def test_both_halves_default_to_the_same_cost() -> None:
    from motor_adapter.scoring import KvAffinityConfig
    from sglang_kvpub.core import cost_settings
    from sglang_kvpub.core.rank_cost import CostParams

    adapter = KvAffinityConfig()
    params = CostParams(BS)
    for key in COST_KEYS:
        plugin_default = PluginConfig().cost()[key]
        assert cost_settings.DEFAULTS[key] == getattr(adapter, key) == getattr(params, key) == plugin_default


@pytest.mark.unit
def test_sglang_kvpub_check_config_sends_a_motor_config_adapter_to_the_adapters_check(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter.json"
    adapter.write_text(json.dumps({"motor_config": str(EXAMPLES / "motor_user_config.json")}))
    events = '{"publisher":"zmq"}'
    args = ["check-config", "--kv-events-config", events, "--adapter-config", str(adapter)]
    done = _cli("-m", "sglang_kvpub.cli", *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "takes its weights from motor_config" in done.stdout
    assert "motor-kv-adapter check-config USER_CONFIG --env-config ENV --adapter-config" in done.stdout


@pytest.mark.unit
def test_docs_name_every_cost_and_log_key_with_its_env_var() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    for key in (*COST_KEYS, "dispatch_log", "dispatch_log_every"):
        assert f"`{key}`" in text and f"`SGLANG_KVPUB_{key.upper()}`" in text, key
