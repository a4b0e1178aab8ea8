"""check-config catches each problem of a Motor user config; registrations are read like the conductor."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from motor_adapter.config_check import Finding, check_config
from motor_adapter.registration import RegistrationError, parse_registration, parse_unregistration
from motor_adapter.service import ServiceConfig
from motor_adapter.tools.cli import main

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "motor_user_config.json"
ENV: dict[str, str] = {"KV_CONDUCTOR_SERVICE": "127.0.0.1"}


@pytest.fixture
def good() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


def _engine(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["motor_engine_prefill_config"]["engine_config"]  # type: ignore[no-any-return]


def _scheduler(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["motor_coordinator_config"]["scheduler_config"]  # type: ignore[no-any-return]


ENV_CONFIG = json.loads((EXAMPLE.parent / "motor_env_config.json").read_text())  # enables the plugin


def _problems(cfg: Any, env_config: Any = ENV_CONFIG) -> list[Finding]:
    return [f for f in check_config(cfg, ENV, env_config=env_config) if f.severity == "problem"]


def test_the_documented_example_is_clean(good: dict[str, Any]) -> None:
    assert _problems(good) == []
    env_config = str(EXAMPLE.parent / "motor_env_config.json")
    assert main(["check-config", str(EXAMPLE), "--env-config", env_config]) == 0


def _set_block_size(cfg: dict[str, Any]) -> None:
    _engine(cfg)["block-size"] = 64


def _drop_block_size_with_page_256(cfg: dict[str, Any]) -> None:
    assert "block-size" not in _engine(cfg)  # the documented config sets none (no SGLang flag)
    _engine(cfg)["page-size"] = 256


def _drop_events(cfg: dict[str, Any]) -> None:
    del _engine(cfg)["kv-events-config"]


def _events_bad_json(cfg: dict[str, Any]) -> None:
    _engine(cfg)["kv-events-config"] = "{publisher: zmq"


NO_PLUGIN_ENV = {"motor_engine_prefill_env": {}}  # Motor's env config without SGLANG_KVPUB_ENABLED


def _no_plugin(cfg: dict[str, Any]) -> Any:
    return NO_PLUGIN_ENV


def _replay_overlap(cfg: dict[str, Any]) -> Any:
    cfg["motor_deploy_config"]["enable_multi_endpoints"] = True  # not the DP0 problem, only the ports
    _engine(cfg)["kv-events-config"]["replay_endpoint"] = "tcp://*:5565"  # inside 5557..5572
    return NO_PLUGIN_ENV


def _replay_equal_with_plugin(cfg: dict[str, Any]) -> None:
    _engine(cfg)["kv-events-config"]["replay_endpoint"] = "tcp://*:5557"


def _no_tokenizer(cfg: dict[str, Any]) -> None:
    del cfg["motor_engine_prefill_config"]["model_config"]
    _engine(cfg)["model-path"] = _engine(cfg).pop("model")  # Motor never resolves model-path for SGLang


def _port_under_scheduler(cfg: dict[str, Any]) -> None:
    _scheduler(cfg)["kv_conductor_config"] = cfg.pop("kv_conductor_config")


def _negative_weight(cfg: dict[str, Any]) -> None:
    _scheduler(cfg)["kv_affinity_load_weight"] = -1


def _unknown_mode(cfg: dict[str, Any]) -> None:
    _scheduler(cfg)["kv_affinity_mode"] = "greedy"


def _w_cpu_without_plugin(cfg: dict[str, Any]) -> Any:
    cfg["motor_deploy_config"]["enable_multi_endpoints"] = True
    _scheduler(cfg)["kv_affinity_w_cpu"] = 1.0
    _engine(cfg)["enable-hierarchical-cache"] = True
    _engine(cfg)["hicache-write-policy"] = "write_through"
    return NO_PLUGIN_ENV


def _pd_separate(cfg: dict[str, Any]) -> None:
    _scheduler(cfg)["deploy_mode"] = "pd_separate"


def _block_size_key(cfg: dict[str, Any]) -> None:
    _engine(cfg)["block-size"] = 128


def _plugin_key(cfg: dict[str, Any]) -> None:
    cfg["motor_engine_decode_config"]["engine_config"]["plugin"] = "sglang_kvpub"


def _explicit_follow_bootstrap_room(cfg: dict[str, Any]) -> None:
    _engine(cfg)["load_balance_method"] = "follow_bootstrap_room"


def _no_bootstrap_port(cfg: dict[str, Any]) -> Any:
    del _engine(cfg)["disaggregation_bootstrap_port"]
    return {**ENV_CONFIG, "motor_coordinator_env": {}}


def _scheduler_type(cfg: dict[str, Any]) -> None:
    _scheduler(cfg)["scheduler_type"] = "load_balance"


def _publisher(cfg: dict[str, Any]) -> None:
    _engine(cfg)["kv-events-config"]["publisher"] = "null"


@pytest.mark.parametrize(
    ("mutate", "key", "words"),
    [
        (_set_block_size, "engine_config.block-size", "page-size (SGLang's --page-size) is 128"),
        (_drop_block_size_with_page_256, "engine_config.block-size", "unset, so Motor sends 128"),
        (_no_tokenizer, "model_config.model_path", "loads no tokenizer"),
        (_port_under_scheduler, "scheduler_config.kv_conductor_config", "not where Motor looks"),
        (_drop_events, "kv-events-config", "is missing"),
        (_events_bad_json, "kv-events-config", "not valid JSON"),
        (_no_plugin, "engine_config.plugin", "ranks 1..N-1 are invisible"),
        (_replay_overlap, "replay_endpoint", "overlap the event ports 5557..5572"),
        (_replay_equal_with_plugin, "replay_endpoint", "overlap"),
        (_negative_weight, "kv_affinity", "load_weight"),
        (_unknown_mode, "kv_affinity", "greedy"),
        (_w_cpu_without_plugin, "kv_affinity.w_cpu", "exclusive split"),
        (_scheduler_type, "scheduler_type", "KV affinity is off"),
        (_publisher, "kv-events-config.publisher", "'null'"),
        (_pd_separate, "deploy_mode", "vLLM PD flow"),
        (_block_size_key, "prefill_config.engine_config.block-size", "unrecognized arguments: --block-size"),
        (_plugin_key, "decode_config.engine_config.plugin", "unrecognized arguments: --plugin"),
        (_explicit_follow_bootstrap_room, "load_balance_method", "cache-aware DP dispatch off"),
        (_no_bootstrap_port, "disaggregation_bootstrap_port", "empty bootstrap_port"),
    ],
)
def test_each_problem_is_named_with_its_key_and_fix(
    good: dict[str, Any], mutate: Any, key: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = copy.deepcopy(good)
    env_config = mutate(cfg) or ENV_CONFIG
    problems = _problems(cfg, env_config)
    assert problems, "expected a problem"
    assert any(key in p.key and words in p.message for p in problems), problems
    assert all(p.fix for p in problems)
    path, env_path = tmp_path / "user_config.json", tmp_path / "env.json"
    path.write_text(json.dumps(cfg))
    env_path.write_text(json.dumps(env_config))
    assert main(["check-config", str(path), "--env-config", str(env_path)]) == 1
    out = capsys.readouterr().out
    assert "fix:" in out and key in out


def test_conductor_host_comes_from_the_environment_only(good: dict[str, Any]) -> None:
    assert not [f for f in check_config(good, ENV) if "KV_CONDUCTOR_SERVICE" in f.key]
    (note,) = [f for f in check_config(good, {}) if f.key == "KV_CONDUCTOR_SERVICE"]
    assert note.severity == "note" and "export KV_CONDUCTOR_SERVICE" in note.fix
    good["kv_conductor_config"]["conductor_service"] = "10.0.0.1"  # what older docs said: ignored by Motor
    assert any("not read" in f.message for f in check_config(good, ENV) if "conductor_service" in f.key)


def test_not_json_and_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{")
    assert main(["check-config", str(path)]) == 1
    assert _problems([1, 2])[0].key == "<root>"


# --------------------------------------------------------------------------- registrations


def test_medium_aliases_and_the_repeated_engine_url() -> None:
    url = "tcp://10.0.0.1:5557"
    reg = parse_registration(
        {"instance_id": "vllm-prefill-0", "medium_endpoints": {"HBM": url, "host": url, "nof_ssd": url}}
    )
    assert reg.media == {"npu": url, "cpu": url, "disk": url}
    assert reg.stream == url and reg.mode == "engine"
    assert any("repeats the engine URL" in w for w in reg.warnings)
    assert (reg.model, reg.tenant, reg.block_size, reg.dp_rank) == ("default", "default", 128, 0)


def test_compat_and_fanned_in_and_pools() -> None:
    base = {"instance_id": "p", "medium_endpoints": {"gpu": "tcp://h:5557"}, "type": "sglang", "dp_size": 8}
    assert parse_registration(base).mode == "compat" and parse_registration(base).compat_dp_size == 8
    fanned = parse_registration({**base, "fanned_in": True})
    assert fanned.mode == "engine" and fanned.compat_dp_size is None
    assert parse_registration({**base, "type": "vLLM"}).mode == "engine"
    pool = parse_registration({"instance_id": "Mooncake-pool", "endpoint": "tcp://m:5557"})
    assert pool.mode == "pool" and pool.stream is None
    legacy = parse_registration({"instance_id": "vllm-prefill-1", "endpoint": "tcp://e:5557"})
    assert legacy.mode == "engine" and legacy.media == {"npu": "tcp://e:5557"}
    yuanrong = parse_registration({"instance_id": "yuanrong-pool-x", "medium_endpoints": {"cpu": "tcp://y:1"}})
    assert yuanrong.mode == "pool"
    assert parse_registration({"instance_id": "http-only"}).mode == "http_only"
    split = parse_registration({"instance_id": "p", "medium_endpoints": {"npu": "tcp://a:1", "disk": "tcp://b:2"}})
    assert split.stream == "tcp://a:1" and any("not followed" in w for w in split.warnings)


@pytest.mark.parametrize(
    "body",
    [
        [],
        {},
        {"instance_id": ""},
        {"instance_id": "x", "dp_rank": -1},
        {"instance_id": "x", "dp_rank": True},
        {"instance_id": "x", "block_size": 0},
        {"instance_id": "x", "medium_endpoints": []},
        {"instance_id": "x", "replay_endpoint": 5},
        {"instance_id": "x", "dp_size": 0},
    ],
)
def test_bad_registrations_name_the_field(body: Any) -> None:
    with pytest.raises(RegistrationError):
        parse_registration(body)


def test_unregistration_and_idempotence() -> None:
    un = parse_unregistration({"instance_id": "a", "modelname": "m"})
    assert (un.dp_rank, un.model, un.tenant) == (None, "m", "default")
    a = parse_registration({"instance_id": "a", "medium_endpoints": {"npu": "tcp://h:1"}})
    b = parse_registration({"instance_id": "a", "medium_endpoints": {"device": "tcp://h:1"}})
    assert a.same_as(b)


def test_service_config_reads_motor_config_and_env(good: dict[str, Any], tmp_path: Path) -> None:
    motor = tmp_path / "user_config.json"
    motor.write_text(json.dumps(good))
    cfg = ServiceConfig.from_mapping({"motor_config": str(motor), "port": 14000}, env={"MOTOR_KV_ADAPTER_TOKEN": "t"})
    assert (cfg.port, cfg.auth_token, cfg.kv_affinity.load_weight, cfg.kv_affinity.block_size) == (14000, "t", 1.0, 128)
    assert cfg.host == "127.0.0.1"
    with pytest.raises(ValueError, match="unknown service setting"):
        ServiceConfig.from_mapping({"prot": 1})
    example = EXAMPLE.parent / "adapter_config.json"
    loaded = ServiceConfig.from_file(str(example), env={})
    assert loaded.tokenizer_path == "/models/DeepSeek-V4-Flash" and loaded.max_body_bytes == 8 << 20


def test_block_size_against_the_sglang_launch_arguments(good: dict[str, Any], tmp_path: Path) -> None:
    launch = "python -m sglang.launch_server --model-path /m --dp-size 16 --page-size 64 --plugin sglang_kvpub"
    found = check_config(good, ENV, sglang_args=launch, env_config=ENV_CONFIG)
    (problem,) = [f for f in found if f.severity == "problem"]
    assert "engine_config.block-size" in problem.key and "--page-size 64" in problem.message
    assert '"block-size": 64' in problem.fix
    found = check_config(good, ENV, sglang_args=launch.replace("64", "128"), env_config=ENV_CONFIG)
    assert not [f for f in found if f.severity == "problem"]
    # no --page-size: SGLang's default page size 1 never matches Motor's 128
    assert any("--page-size 1" in f.message for f in check_config(good, ENV, sglang_args="--dp-size 2"))
    path, env_path = tmp_path / "user_config.json", str(EXAMPLE.parent / "motor_env_config.json")
    path.write_text(json.dumps(good))
    assert main(["check-config", str(path), "--sglang-args=--page-size=128", "--env-config", env_path]) == 0
    launch_32 = "--sglang-args=python -m sglang.launch_server --page-size 32"
    assert main(["check-config", str(path), launch_32, "--env-config", env_path]) == 1
