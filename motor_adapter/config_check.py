"""Checks of a Motor user config (``motor-kv-adapter check-config``).

:func:`check_config` validates a Motor user config as the released Motor reads it
(``mindie-motor`` 3.0.0b2 and the Ascend source; docs/motor.md) and names the key and the fix
of every problem it finds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal, Union
from urllib.parse import urlsplit

from motor_adapter.rust_conductor import RUST_CONDUCTOR_FIX, RUST_CONDUCTOR_MESSAGE
from motor_adapter.scoring import ConfigError, KvAffinityConfig
from sglang_kvpub.core.load_balance import plan_dispatch

__all__ = ["Finding", "check_config", "load_config_file", "sglang_page_size"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem (``severity="problem"``, fails the check) or a note, with the key and fix."""

    key: str
    message: str
    fix: str
    severity: Literal["problem", "note"] = "problem"

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}\n    fix: {self.fix}"


def load_config_file(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _engine_args(engine: Mapping[str, Any]) -> dict[str, Any]:
    """Engine args with ``_`` spelled ``-``, as SGLang's CLI spells them."""
    args = engine.get("engine_config") or {}
    if not isinstance(args, Mapping):
        return {}
    return {str(k).replace("_", "-"): v for k, v in args.items()}


def _kv_events(args: Mapping[str, Any]) -> tuple[Union[dict[str, Any], None], str]:
    """``(kv-events-config as a dict, "" or why it is unusable)``; SGLang takes it as a JSON string."""
    value = args.get("kv-events-config")
    if value is None:
        return None, "is missing"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None, "is not valid JSON"
    if not isinstance(value, Mapping):
        return None, f"must be a JSON object, got {type(value).__name__}"
    return dict(value), ""


def _port(url: Any) -> Union[int, None]:
    if not isinstance(url, str):
        return None
    try:
        return urlsplit(url.replace("*", "0.0.0.0")).port
    except ValueError:
        return None


def _has_plugin(args: Mapping[str, Any]) -> bool:
    for key in ("plugin", "plugins"):
        value = args.get(key)
        items = value if isinstance(value, list) else str(value or "").replace(",", " ").split()
        if "sglang_kvpub" in items:
            return True
    return False


def _find_engine(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    for role in ("prefill", "union", "decode"):
        key = f"motor_engine_{role}_config"
        engine = config.get(key)
        if isinstance(engine, Mapping) and "kv-events-config" in _engine_args(engine):
            return key, engine
    for role in ("prefill", "union"):
        engine = config.get(f"motor_engine_{role}_config")
        if isinstance(engine, Mapping):
            return f"motor_engine_{role}_config", engine
    return "motor_engine_prefill_config", {}


def _scheduler(config: Mapping[str, Any]) -> Mapping[str, Any]:
    coordinator = config.get("motor_coordinator_config")
    scheduler = coordinator.get("scheduler_config") if isinstance(coordinator, Mapping) else None
    return scheduler if isinstance(scheduler, Mapping) else {}


def _conductor(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(config.get("kv_conductor_config"), Mapping):
        return "kv_conductor_config", config["kv_conductor_config"]
    scheduler = _scheduler(config)
    if isinstance(scheduler.get("kv_conductor_config"), Mapping):
        return "motor_coordinator_config.scheduler_config.kv_conductor_config", scheduler["kv_conductor_config"]
    return "kv_conductor_config", {}


def _enable_multi_endpoints(config: Mapping[str, Any]) -> bool:
    for section in ("motor_deploy_config", "basic_config", "motor_controller_config"):
        value = config.get(section)
        if isinstance(value, Mapping) and "enable_multi_endpoints" in value:
            return bool(value["enable_multi_endpoints"])
    engine = config.get("motor_engine_prefill_config")
    args = _engine_args(engine) if isinstance(engine, Mapping) else {}
    if "enable-multi-endpoints" in args:
        return bool(args["enable-multi-endpoints"])
    # Motor runs SGLang as one endpoint for the whole server unless told otherwise.
    sglang = isinstance(engine, Mapping) and str(engine.get("engine_type", "")).lower() == "sglang"
    return bool(config.get("enable_multi_endpoints", not sglang))


def sglang_page_size(launch_args: str) -> Union[int, None]:
    """``--page-size`` of an SGLang launch command line (``None``: not given, SGLang's default 1)."""
    import shlex

    words = shlex.split(launch_args)
    for i, word in enumerate(words):
        value = word.split("=", 1)[1] if word.startswith("--page-size=") else None
        if word == "--page-size" and i + 1 < len(words):
            value = words[i + 1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def check_config(
    config: Any,
    env: Union[Mapping[str, str], None] = None,
    sglang_args: Union[str, None] = None,
    env_config: Any = None,
    adapter_config: Union[str, None] = None,
) -> list[Finding]:
    """Every problem (and note) in a Motor user config for KV affinity with SGLang + this adapter.

    ``sglang_args``: the SGLang launch command line when SGLang is started outside Motor; its
    ``--page-size`` is checked against the ``block-size`` Motor sends.  ``env_config``: Motor's
    env config (``env.json``), where ``motor_engine_prefill_env`` enables the plugin
    (``SGLANG_KVPUB_ENABLED=1``) and ``motor_coordinator_env`` holds the bootstrap port.
    ``adapter_config``: the adapter's ``serve --config`` file, whose cost must equal the engine's.
    """
    if not isinstance(config, Mapping):
        return [
            Finding("<root>", f"expected a JSON object, got {type(config).__name__}", "pass a Motor user_config.json")
        ]
    env = os.environ if env is None else env
    findings: list[Finding] = []
    findings += _check_scheduler(config)
    conductor_key, conductor = _conductor(config)
    engine_key, engine = _find_engine(config)
    args = _engine_args(engine)
    engine_env = _section_env(env_config, engine_key)
    findings += _check_conductor(conductor_key, conductor, env)
    findings += _check_engine(config, engine_key, engine, args, conductor_key, conductor, engine_env)
    findings += _check_sglang_keys(config)
    findings += _check_pd(config, engine_key, args, engine_env, _section_env(env_config, "motor_coordinator_config"))
    if sglang_args is not None:
        findings += _check_launch_page(engine_key, args, sglang_args)
    if adapter_config is not None:  # the engine's rank cost against the adapter's (cost_agreement.py)
        from motor_adapter.cost_agreement import check_motor_engine

        where = f"{_env_section(engine_key)} of Motor's env config"
        found = check_motor_engine(engine_key, args, engine_env, adapter_config, where)
        findings += [Finding(m.key, m.message, m.fix) for m in found]
    findings.append(_start_order(conductor_key))
    findings.append(Finding(conductor_key, RUST_CONDUCTOR_MESSAGE, RUST_CONDUCTOR_FIX, severity="note"))
    return findings


def _check_launch_page(engine_key: str, args: Mapping[str, Any], sglang_args: str) -> list[Finding]:
    page = sglang_page_size(sglang_args) or 1  # SGLang's default page size is 1
    sent = args.get("block-size", 128)
    if page == sent:
        return []
    return [
        Finding(
            f"{engine_key}.engine_config.block-size",
            f"Motor sends block_size {sent} but the SGLang launch arguments give --page-size {page}: every "
            "event has the wrong block size for Motor's queries, every query misses",
            f"launch SGLang with --page-size {sent} (Motor's block size), or, only where SGLang runs outside "
            f"Motor's engine launcher (which refuses it), set \"block-size\": {page} in Motor's engine_config",
        )
    ]


def _check_scheduler(config: Mapping[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    scheduler = _scheduler(config)
    key = "motor_coordinator_config.scheduler_config"
    stype = scheduler.get("scheduler_type", scheduler.get("prefill_scheduler_type", "load_balance"))
    if stype != "kv_cache_affinity":
        findings.append(
            Finding(f"{key}.scheduler_type", f"is {stype!r}: KV affinity is off", 'set "kv_cache_affinity"')
        )
    try:
        KvAffinityConfig.from_motor(config)
    except ConfigError as exc:
        findings += [Finding(f"{key}.kv_affinity", p, "see the message") for p in exc.problems]
    return findings


def _check_conductor(key: str, conductor: Mapping[str, Any], env: Mapping[str, str]) -> list[Finding]:
    """Motor reads the conductor's HOST from ``KV_CONDUCTOR_SERVICE`` only and its PORT from
    top-level ``kv_conductor_config.http_server_port`` only (3.0.0b2 and the Ascend source)."""
    findings: list[Finding] = []
    if not env.get("KV_CONDUCTOR_SERVICE"):
        findings.append(
            Finding(
                "KV_CONDUCTOR_SERVICE",
                "is unset in this environment: Motor reads the conductor host from it alone "
                "(a conductor_service key in the file is not read), so it never registers or queries",
                "export KV_CONDUCTOR_SERVICE=<host of motor-kv-adapter serve> in the coordinator's environment",
                severity="note",
            )
        )
    if key != "kv_conductor_config":
        findings.append(
            Finding(
                key,
                "is not where Motor looks: it reads top-level kv_conductor_config.http_server_port; without it "
                "Motor registers nothing and disables its tokenizer, silently",
                'move it to the top level: "kv_conductor_config": {"http_server_port": 13333}',
            )
        )
    port = conductor.get("http_server_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        findings.append(
            Finding(
                "kv_conductor_config.http_server_port",
                f"is {port!r}" + (" (missing)" if port is None else ""),
                'set the adapter\'s port at the top level: "kv_conductor_config": {"http_server_port": 13333}',
            )
        )
    ignored = sorted(set(conductor) & {"conductor_service", "block_size", "engine_type", "query_encoding"})
    if ignored:
        findings.append(
            Finding(
                f"kv_conductor_config.{'/'.join(ignored)}",
                "not read by the released Motor (host: KV_CONDUCTOR_SERVICE; block_size: engine_config block-size; "
                "type is always vLLM; /query is JSON)",
                "remove them; see docs/motor.md",
                severity="note",
            )
        )
    return findings


def _check_engine(
    config: Mapping[str, Any],
    engine_key: str,
    engine: Mapping[str, Any],
    args: Mapping[str, Any],
    conductor_key: str,
    conductor: Mapping[str, Any],
    engine_env: Mapping[str, Any],
) -> list[Finding]:
    findings: list[Finding] = []
    engine_type = str(engine.get("engine_type", "")).lower()
    model_config = engine.get("model_config")
    model_path = model_config.get("model_path") if isinstance(model_config, Mapping) else None
    if not model_path and not args.get("model"):
        findings.append(
            Finding(
                f"{engine_key}.model_config.model_path",
                "is missing (and engine_config has no model): Motor loads no tokenizer, so every query is empty "
                "(3.0.0b2 also skips the whole conductor setup without model_config.model_path)",
                'set "model_config": {"model_name": ..., "model_path": "/models/X"} and engine_config "model": '
                '"/models/X" (Motor never resolves model-path for SGLang)',
            )
        )
    plugin = _has_plugin(args) or _env_enables_plugin(engine_env)
    findings += _check_block_size(engine_key, args, conductor_key, conductor)
    events, what = _kv_events(args)
    events_key = f"{engine_key}.engine_config.kv-events-config"
    if events is None:
        findings.append(
            Finding(
                events_key,
                f"{what}: the engine publishes no KV events, every query misses",
                'add {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6667", '
                '"topic": "kv-events"}',
            )
        )
        return findings
    findings += _check_events(events_key, events)
    dp = args.get("dp-size", args.get("data-parallel-size", 1))
    dp = dp if isinstance(dp, int) and not isinstance(dp, bool) and dp > 0 else 1
    if engine_type == "sglang" and dp > 1 and not plugin and not _enable_multi_endpoints(config):
        findings.append(
            Finding(
                f"{engine_key}.engine_config.plugin",
                f"dp-size {dp} behind one HTTP endpoint (enable_multi_endpoints false) without the sglang_kvpub "
                "plugin: a conductor subscribes to DP0's stream only, ranks 1..N-1 are invisible",
                f'set "{ENABLED_ENV}": "1" in {_env_section(engine_key)} of Motor\'s env config (--env-config), '
                "or register with dp_size for compat mode",
            )
        )
    findings += _check_ports(events_key, events, dp, plugin)
    findings += _check_l2(config, engine_key, args, plugin)
    return findings


def _check_block_size(
    engine_key: str, args: Mapping[str, Any], conductor_key: str, conductor: Mapping[str, Any]
) -> list[Finding]:
    """Motor sends ``block_size`` = engine_config ``block-size`` (default 128); SGLang hashes
    ``page-size`` tokens per block. A mismatch drops every event (wrong size) or misses every query."""
    page = args.get("page-size")
    sent = args.get("block-size", 128)
    if isinstance(sent, bool) or not isinstance(sent, int) or sent <= 0:
        return [Finding(f"{engine_key}.engine_config.block-size", f"is {sent!r}", "set SGLang's page-size, e.g. 128")]
    if page is None or page == sent:
        return []
    how = "unset, so Motor sends 128" if "block-size" not in args else f"{sent}"
    return [
        Finding(
            f"{engine_key}.engine_config.block-size",
            f"is {how} but page-size (SGLang's --page-size) is {page}: Motor reads block-size only, never "
            "page-size, and queries with a block size the stream never has - the adapter ignores every stored "
            "event of that size (logged once, counted in dropped_block_size) and every query misses",
            f'set "page-size": {sent} (Motor\'s block size; with DCP: page size x DCP size = {sent}); '
            '"block-size" is no SGLang flag, so an engine Motor launches cannot carry it',
        )
    ]


ENABLED_ENV = "SGLANG_KVPUB_ENABLED"  # sglang_kvpub.engine.plugin.ENABLED_ENV (no engine import here)
# engine_config keys Motor's engine launcher (the 3.1 line: motor/engine_server/core/sglang/
# sglang_config.py) turns into flags that SGLang 0.5.23's ServerArgs.add_cli_args refuses
# ("unrecognized arguments") - it parses before SGLang's load_plugins() adds --plugin.
_SGLANG_REFUSED = {
    "block-size": 'remove it: Motor then sends its default 128 - set "page-size": 128',
    "plugin": f'remove it: set "{ENABLED_ENV}": "1" in motor_engine_prefill_env of Motor\'s env config',
    "plugins": f'remove it: set "{ENABLED_ENV}": "1" in motor_engine_prefill_env of Motor\'s env config',
}
_TRUE = frozenset({"1", "true", "yes", "on"})


def _env_section(config_key: str) -> str:
    """``motor_engine_prefill_config`` -> ``motor_engine_prefill_env`` (Motor's env config sections)."""
    return config_key.removesuffix("_config") + "_env"


def _section_env(env_config: Any, config_key: str) -> Mapping[str, Any]:
    section = env_config.get(_env_section(config_key)) if isinstance(env_config, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def _env_enables_plugin(engine_env: Mapping[str, Any]) -> bool:
    return str(engine_env.get(ENABLED_ENV, "")).strip().lower() in _TRUE


def _sglang_sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    sections = []
    for role in ("prefill", "decode", "union"):
        key = f"motor_engine_{role}_config"
        engine = config.get(key)
        if isinstance(engine, Mapping) and str(engine.get("engine_type", "")).lower() == "sglang":
            sections.append((key, engine))
    return sections


def _check_sglang_keys(config: Mapping[str, Any]) -> list[Finding]:
    """engine_config keys SGLang refuses when Motor's engine launcher hands them to its parser."""
    findings: list[Finding] = []
    for key, engine in _sglang_sections(config):
        raw = engine.get("engine_config")
        for name in raw if isinstance(raw, Mapping) else ():
            fix = _SGLANG_REFUSED.get(str(name).replace("_", "-"))
            if fix is not None:
                findings.append(
                    Finding(
                        f"{key}.engine_config.{name}",
                        "is no SGLang flag: Motor's engine launcher passes every engine_config key to SGLang's "
                        "parser before SGLang loads plugins, which stops with "
                        f"'unrecognized arguments: --{str(name).replace('_', '-')} ...'",
                        fix,
                    )
                )
    return findings


def _check_pd(
    config: Mapping[str, Any],
    engine_key: str,
    args: Mapping[str, Any],
    engine_env: Mapping[str, Any],
    coordinator_env: Mapping[str, Any],
) -> list[Finding]:
    """SGLang PD under Motor: the deploy mode, the bootstrap port, and whether the prefill dispatches."""
    findings: list[Finding] = []
    sections = dict(_sglang_sections(config))
    modes = {str(_engine_args(e).get("disaggregation-mode", "")) for e in sections.values()}
    pd = "motor_engine_decode_config" in sections or "prefill" in modes
    mode_key = "motor_coordinator_config.scheduler_config.deploy_mode"
    deploy_mode = _scheduler(config).get("deploy_mode")
    if pd and deploy_mode == "pd_separate":
        findings.append(
            Finding(
                mode_key,
                "is pd_separate, Motor's vLLM PD flow: it sends no bootstrap_host, bootstrap_port or bootstrap_room, "
                "which an SGLang prefill and decode need to pair",
                'set "pd_dual_dispatch" (Motor\'s SGLang PD mode; its prefill request carries the bootstrap fields)',
            )
        )
    if deploy_mode == "pd_dual_dispatch" and engine_key in sections:
        port = args.get("disaggregation-bootstrap-port")
        sent = coordinator_env.get("DISAGGREGATION_BOOTSTRAP_PORT")
        if port is None and sent is None:
            findings.append(
                Finding(
                    f"{engine_key}.engine_config.disaggregation_bootstrap_port",
                    "is unset and so is DISAGGREGATION_BOOTSTRAP_PORT in motor_coordinator_env: Motor sends an "
                    "empty bootstrap_port, and the decode cannot reach the prefill's bootstrap server",
                    "set \"disaggregation_bootstrap_port\": 8998 (Motor's deployer copies it into the coordinator's "
                    "DISAGGREGATION_BOOTSTRAP_PORT)",
                )
            )
        elif port is not None and sent is not None and str(port) != str(sent):
            findings.append(
                Finding(
                    "motor_coordinator_env.DISAGGREGATION_BOOTSTRAP_PORT",
                    f"is {sent} but the prefill's disaggregation_bootstrap_port is {port}: Motor sends the wrong port",
                    "make them equal",
                )
            )
    if "prefill" in modes and engine_key in sections:
        findings += _check_prefill_dispatch(engine_key, args, engine_env)
    return findings


def _check_prefill_dispatch(engine_key: str, args: Mapping[str, Any], engine_env: Mapping[str, Any]) -> list[Finding]:
    """Would the plugin's cache-aware dispatch be on in this prefill (sglang_kvpub.core.load_balance)?"""
    if not (_has_plugin(args) or _env_enables_plugin(engine_env)):
        return []
    events, _what = _kv_events(args)
    dp_dispatch = str(engine_env.get("SGLANG_KVPUB_DP_DISPATCH") or (events or {}).get("dp_dispatch", "cache_aware"))
    dp = args.get("dp-size", 1)
    plan = plan_dispatch(
        dp_dispatch=dp_dispatch,
        requested_method=str(args.get("load-balance-method", "auto")),
        disaggregation_mode="prefill",
        num_dp_ranks=dp if isinstance(dp, int) and not isinstance(dp, bool) else 1,
    )
    if plan.on or plan.reason.startswith("one DP rank"):
        return []
    return [
        Finding(
            f"{engine_key}.engine_config.load_balance_method",
            f"{plan.line()}: a repeat reaches the rank holding its prefix 1/dp_size of the time",
            'remove load_balance_method (the plugin makes SGLang\'s "auto" round_robin on a PD prefill and '
            'dispatches by cache), and leave dp_dispatch at "cache_aware"',
        )
    ]


def _check_events(key: str, events: Mapping[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    if events.get("publisher", "zmq") != "zmq":
        findings.append(Finding(f"{key}.publisher", f"is {events.get('publisher')!r}", 'set "zmq"'))
    if events.get("enable_kv_cache_events") is False:
        findings.append(Finding(f"{key}.enable_kv_cache_events", "is false", "set it to true"))
    if _port(events.get("endpoint", "tcp://*:5557")) is None:
        findings.append(Finding(f"{key}.endpoint", f"{events.get('endpoint')!r} has no port", 'use "tcp://*:5557"'))
    if not events.get("replay_endpoint"):
        findings.append(
            Finding(
                f"{key}.replay_endpoint",
                "is missing: a router that misses a batch or restarts cannot recover",
                'add "replay_endpoint": "tcp://*:6667"',
                severity="note",
            )
        )
    return findings


def _check_ports(key: str, events: Mapping[str, Any], dp: int, plugin: bool) -> list[Finding]:
    base, replay = _port(events.get("endpoint", "tcp://*:5557")), _port(events.get("replay_endpoint"))
    if base is None or replay is None:
        return []
    span = 1 if plugin else dp  # without the plugin every rank binds base+rank and replay+rank
    if base < replay + span and replay < base + span:
        return [
            Finding(
                f"{key}.replay_endpoint",
                f"replay ports {replay}..{replay + span - 1} overlap the event ports {base}..{base + span - 1}"
                + ("" if plugin else " (each rank binds base+rank)"),
                f"move replay_endpoint to port {base + span + 1000} or higher",
            )
        ]
    return []


def _check_l2(config: Mapping[str, Any], engine_key: str, args: Mapping[str, Any], plugin: bool) -> list[Finding]:
    try:
        cfg = KvAffinityConfig.from_motor(config)
    except ConfigError:
        return []
    if cfg.w_cpu <= 0:
        return []
    hicache = bool(args.get("enable-hierarchical-cache"))
    policy = str(args.get("hicache-write-policy", "write_through" if hicache else ""))
    if not hicache:
        return []
    if not plugin:
        return [
            Finding(
                "motor_coordinator_config.scheduler_config.kv_affinity.w_cpu",
                f"is {cfg.w_cpu} with HiCache ({policy}) but without the sglang_kvpub plugin: SGLang sends no "
                "BlockRemoved(GPU) when HBM is released, and with write_through the exclusive split keeps "
                "cpu_blocks at 0, so L2 scoring is wrong",
                f'set "{ENABLED_ENV}": "1" in motor_engine_prefill_env of Motor\'s env config (the plugin), '
                'or set "w_cpu": 0 in the kv_affinity of the adapter\'s --config (the adapter scores CPU '
                "blocks with it; no released Motor reads w_cpu)",
            )
        ]
    if policy == "write_through":
        return [
            Finding(
                "motor_coordinator_config.scheduler_config.kv_affinity.w_cpu",
                "with write_through a block counts as cpu only after it left HBM (exclusive split)",
                "expected: npu_blocks first, cpu_blocks after HBM release",
                severity="note",
            )
        ]
    return []


def _start_order(conductor_key: str) -> Finding:
    """Motor registers an instance once, when it adds it: the order things start in matters."""
    return Finding(
        conductor_key,
        "Motor registers each instance with the conductor ONCE, when it adds the instance (one POST, 2 s timeout, "
        "no retry): an adapter that is not up then never learns it, and every query for it falls back to "
        "load_balance (counted in motor_kv_adapter_unregistered_queries_total)",
        "start order: etcd (for replicas) -> motor-kv-adapter serve (its --registry keeps registrations across "
        "restarts) -> the engines -> Motor's coordinator. To recover a missed registration: re-add the instance "
        "in Motor, or `motor-kv-adapter register --url http://ADAPTER:PORT --motor-config THIS_FILE "
        "--ip INSTANCE_IP --instance-id vllm-prefill-N` (docs/operations.md)",
        severity="note",
    )
