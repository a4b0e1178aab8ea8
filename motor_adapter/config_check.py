"""Checks of a Motor user config (``motor-kv-adapter check-config``).

:func:`check_config` validates a Motor user config as the released Motor reads it
(``mindie-motor`` 3.0.0b2 and the Ascend source; docs/motor.md) and names the key and the fix
of every problem it finds.  The scheduler and conductor sections are checked here, the engine
sections in :mod:`motor_adapter.engine_config_check`, the rank cost's agreement with the
adapter's in :mod:`motor_adapter.cost_agreement`; :mod:`motor_adapter.motor_user_config`
reads the sections.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Union

from motor_adapter.engine_config_check import check_engine, check_launch_page, check_pd, check_sglang_keys
from motor_adapter.motor_user_config import (
    Finding,
    conductor_section,
    engine_args,
    env_section,
    find_engine,
    scheduler_section,
    section_env,
    sglang_page_size,
)
from motor_adapter.rust_conductor import RUST_CONDUCTOR_FIX, RUST_CONDUCTOR_MESSAGE
from motor_adapter.scoring import ConfigError, KvAffinityConfig

__all__ = ["Finding", "check_config", "load_config_file", "sglang_page_size"]


def load_config_file(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


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
    conductor_key, conductor = conductor_section(config)
    engine_key, engine = find_engine(config)
    args = engine_args(engine)
    engine_env = section_env(env_config, engine_key)
    findings += _check_conductor(conductor_key, conductor, env)
    findings += check_engine(config, engine_key, engine, args, conductor_key, conductor, engine_env)
    findings += check_sglang_keys(config)
    findings += check_pd(config, engine_key, args, engine_env, section_env(env_config, "motor_coordinator_config"))
    if sglang_args is not None:
        findings += check_launch_page(engine_key, args, sglang_args)
    if adapter_config is not None:  # the engine's rank cost against the adapter's (cost_agreement.py)
        from motor_adapter.cost_agreement import check_motor_engine

        where = f"{env_section(engine_key)} of Motor's env config"
        found = check_motor_engine(engine_key, args, engine_env, adapter_config, where)
        findings += [Finding(m.key, m.message, m.fix) for m in found]
    findings.append(_start_order(conductor_key))
    findings.append(Finding(conductor_key, RUST_CONDUCTOR_MESSAGE, RUST_CONDUCTOR_FIX, severity="note"))
    return findings


def _check_scheduler(config: Mapping[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    scheduler = scheduler_section(config)
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
