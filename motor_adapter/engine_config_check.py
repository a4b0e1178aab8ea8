"""Checks of the engine sections of a Motor user config (``motor-kv-adapter check-config``).

What SGLang and the plugin need from the engine Motor launches: a model, the block size
Motor sends equal to SGLang's page size, KV events on a usable port pair, no engine_config
key SGLang's parser refuses, SGLang PD's deploy mode and bootstrap port, and the plugin
where DP ranks or HiCache need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from motor_adapter.motor_user_config import (
    ENABLED_ENV,
    Finding,
    enable_multi_endpoints,
    engine_args,
    env_enables_plugin,
    env_section,
    has_plugin,
    kv_events,
    scheduler_section,
    sglang_page_size,
    sglang_sections,
    url_port,
)
from motor_adapter.scoring import ConfigError, KvAffinityConfig
from sglang_kvpub.core.load_balance import plan_dispatch

__all__ = ["check_engine", "check_launch_page", "check_pd", "check_sglang_keys"]


def check_engine(
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
    plugin = has_plugin(args) or env_enables_plugin(engine_env)
    findings += _check_block_size(engine_key, args, conductor_key, conductor)
    events, what = kv_events(args)
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
    if engine_type == "sglang" and dp > 1 and not plugin and not enable_multi_endpoints(config):
        findings.append(
            Finding(
                f"{engine_key}.engine_config.plugin",
                f"dp-size {dp} behind one HTTP endpoint (enable_multi_endpoints false) without the sglang_kvpub "
                "plugin: a conductor subscribes to DP0's stream only, ranks 1..N-1 are invisible",
                f'set "{ENABLED_ENV}": "1" in {env_section(engine_key)} of Motor\'s env config (--env-config), '
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


def check_launch_page(engine_key: str, args: Mapping[str, Any], sglang_args: str) -> list[Finding]:
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


# engine_config keys Motor's engine launcher (the 3.1 line: motor/engine_server/core/sglang/
# sglang_config.py) turns into flags that SGLang 0.5.23's ServerArgs.add_cli_args refuses
# ("unrecognized arguments") - it parses before SGLang's load_plugins() adds --plugin.
_SGLANG_REFUSED = {
    "block-size": 'remove it: Motor then sends its default 128 - set "page-size": 128',
    "plugin": f'remove it: set "{ENABLED_ENV}": "1" in motor_engine_prefill_env of Motor\'s env config',
    "plugins": f'remove it: set "{ENABLED_ENV}": "1" in motor_engine_prefill_env of Motor\'s env config',
}


def check_sglang_keys(config: Mapping[str, Any]) -> list[Finding]:
    """engine_config keys SGLang refuses when Motor's engine launcher hands them to its parser."""
    findings: list[Finding] = []
    for key, engine in sglang_sections(config):
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


def check_pd(
    config: Mapping[str, Any],
    engine_key: str,
    args: Mapping[str, Any],
    engine_env: Mapping[str, Any],
    coordinator_env: Mapping[str, Any],
) -> list[Finding]:
    """SGLang PD under Motor: the deploy mode, the bootstrap port, and whether the prefill dispatches."""
    findings: list[Finding] = []
    sections = dict(sglang_sections(config))
    modes = {str(engine_args(e).get("disaggregation-mode", "")) for e in sections.values()}
    pd = "motor_engine_decode_config" in sections or "prefill" in modes
    mode_key = "motor_coordinator_config.scheduler_config.deploy_mode"
    deploy_mode = scheduler_section(config).get("deploy_mode")
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
    if not (has_plugin(args) or env_enables_plugin(engine_env)):
        return []
    events, _what = kv_events(args)
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
    if url_port(events.get("endpoint", "tcp://*:5557")) is None:
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
    base, replay = url_port(events.get("endpoint", "tcp://*:5557")), url_port(events.get("replay_endpoint"))
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
