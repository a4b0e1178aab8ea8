"""Do the engine and the adapter score with the same rank cost?  (``motor-kv-adapter check-config``)

The engine's side is read from what Motor launches it with (its engine_config
``kv-events-config`` and its section of Motor's env config), the adapter's from its
``serve --config`` exactly as ``serve`` reads it (every form: a ``kv_affinity`` object, or
``motor_config``); :mod:`sglang_kvpub.core.cost_settings` compares them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Union

from motor_adapter.scoring import ConfigError
from motor_adapter.settings import ServiceConfig
from sglang_kvpub.core.cost_settings import COST_KEYS, Cost, Mismatch, compare, engine_cost

__all__ = ["check", "check_motor_engine", "engine_cost_from_motor", "load_adapter_cost"]


def engine_cost_from_motor(
    engine_args: Mapping[str, Any], engine_env: Mapping[str, Any]
) -> tuple[Cost, dict[str, str]]:
    """The cost of an engine Motor launches: its engine_config ``kv-events-config`` (a JSON
    string or object) and its section of Motor's env config (``motor_engine_prefill_env``);
    raises :class:`ConfigError` naming a bad key."""
    events: Union[Any, None] = engine_args.get("kv-events-config")
    if isinstance(events, str):
        try:
            events = json.loads(events)
        except ValueError:
            events = None
    return engine_cost(events if isinstance(events, Mapping) else None, engine_env)


def load_adapter_cost(path: str) -> Cost:
    """The cost an adapter started with ``serve --config PATH`` scores with; raises
    :class:`ConfigError`, ``OSError`` or ``ValueError``."""
    affinity = ServiceConfig.from_file(path, env={}).kv_affinity
    return {key: getattr(affinity, key) for key in COST_KEYS}


def check(
    engine: tuple[Cost, dict[str, str]],
    adapter_config_path: str,
    engine_label: str = "the engine",
    env_where: str = "the engine's environment",
) -> list[Mismatch]:
    """Every key the engine's cost differs on from the adapter config's (unreadable: one mismatch)."""
    try:
        adapter = load_adapter_cost(adapter_config_path)
    except (OSError, ValueError, ConfigError) as exc:
        fix = "pass the JSON given to motor-kv-adapter serve --config"
        return [Mismatch("--adapter-config", f"{adapter_config_path}: cannot be read: {exc}", fix)]
    return compare(engine[0], engine[1], adapter, adapter_config_path, engine_label, env_where)


def check_motor_engine(
    engine_key: str, engine_args: Mapping[str, Any], engine_env: Mapping[str, Any], adapter_config: str, env_where: str
) -> list[Mismatch]:
    """:func:`check` for the engine Motor launches from ``engine_key`` (a bad engine value: one mismatch)."""
    try:
        engine = engine_cost_from_motor(engine_args, engine_env)
    except ConfigError as exc:
        return [Mismatch(f"{engine_key} cost", str(exc), "fix the engine's value (docs/config.md)")]
    return check(engine, adapter_config, engine_label=engine_key, env_where=env_where)
