"""Do the engine and the adapter score with the same rank cost?  (both ``check-config`` commands)

The adapter scores each instance by the rank that would serve a request and the engine's
cache-aware dispatcher picks that rank, each with :func:`sglang_kvpub.core.rank_cost.score_ranks`
(docs/dispatch.md, "One cost for both halves").  They pick the same rank only when they are
given the same weights and hot-spot guard: the engine from its plugin keys
(``--kv-events-config`` or ``SGLANG_KVPUB_<KEY>``, sglang_kvpub/config.py), the adapter from
its config's ``kv_affinity`` (motor_adapter/settings.py).  This module reads both the way
each half does and names every key on which they differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Union

from motor_adapter.scoring import ConfigError, KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from sglang_kvpub.config import COST_KEYS, PluginConfig, env_name
from sglang_kvpub.config import ConfigError as PluginConfigError

__all__ = [
    "Mismatch",
    "adapter_cost",
    "check",
    "compare",
    "engine_cost",
    "engine_cost_from_motor",
    "load_adapter_cost",
]


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One key the two halves disagree on (or cannot be read), with the fix."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"problem: {self.key}: {self.message}\n    fix: {self.fix}"


Cost = dict[str, Union[float, None]]


def engine_cost(kv_events: Union[Mapping[str, Any], None], env: Mapping[str, Any]) -> tuple[Cost, dict[str, str]]:
    """The engine's cost settings as the plugin reads them (a key in the JSON wins over the
    environment) and where each came from; raises :class:`sglang_kvpub.config.ConfigError`."""
    events = dict(kv_events or {})
    text_env = {str(k): str(v) for k, v in env.items()}
    config = PluginConfig.from_mapping({k: events[k] for k in COST_KEYS if k in events}, env=text_env)
    where = {}
    for key in COST_KEYS:
        if key in events:
            where[key] = f"--kv-events-config {key!r}"
        elif env_name(key) in text_env:
            where[key] = env_name(key)
        else:
            where[key] = f"default; {env_name(key)} unset"
    return config.cost(), where


def engine_cost_from_motor(
    engine_args: Mapping[str, Any], engine_env: Mapping[str, Any]
) -> tuple[Cost, dict[str, str]]:
    """The cost of an engine Motor launches: its engine_config ``kv-events-config`` (a JSON
    string or object) and its section of Motor's env config (``motor_engine_prefill_env``)."""
    import json

    events = engine_args.get("kv-events-config")
    if isinstance(events, str):
        try:
            events = json.loads(events)
        except ValueError:
            events = None
    return engine_cost(events if isinstance(events, Mapping) else None, engine_env)


def adapter_cost(kv_affinity: KvAffinityConfig) -> Cost:
    return {key: getattr(kv_affinity, key) for key in COST_KEYS}


def load_adapter_cost(path: str) -> Cost:
    """The cost an adapter started with ``serve --config PATH`` scores with; raises
    :class:`motor_adapter.scoring.ConfigError` or ``OSError``/``ValueError``."""
    return adapter_cost(ServiceConfig.from_file(path, env={}).kv_affinity)


def compare(
    engine: Cost,
    engine_where: Mapping[str, str],
    adapter: Cost,
    adapter_where: str,
    engine_label: str = "the engine",
    env_where: str = "the engine's environment",
) -> list[Mismatch]:
    """Every cost key on which ``engine`` and ``adapter`` differ, with the fix on both sides."""
    found = []
    for key in COST_KEYS:
        ours, theirs = engine.get(key), adapter.get(key)
        if ours == theirs or (ours is not None and theirs is not None and abs(ours - theirs) <= 1e-9):
            continue
        found.append(
            Mismatch(
                f"cost.{key}",
                f"{engine_label} dispatches with {key}={_show(ours)} ({engine_where.get(key, 'default')}) but the "
                f"adapter scores with {key}={_show(theirs)} ({adapter_where} kv_affinity.{key}): the adapter "
                "scores each instance by a rank the engine's dispatcher does not pick",
                f"configure the same value once for both halves: {env_name(key)}={_show(theirs, env=True)} in "
                f'{env_where}, or "{key}": {_show(ours)} in the adapter\'s kv_affinity',
            )
        )
    return found


def _show(value: Union[float, None], env: bool = False) -> str:
    if value is None:
        return "null" if not env else "off"
    return f"{value:g}"


def check(
    engine: tuple[Cost, dict[str, str]],
    adapter_config_path: str,
    engine_label: str = "the engine",
    env_where: str = "the engine's environment",
) -> list[Mismatch]:
    """:func:`compare` against the adapter config at ``adapter_config_path`` (unreadable: one mismatch)."""
    try:
        adapter = load_adapter_cost(adapter_config_path)
    except (OSError, ValueError, ConfigError, PluginConfigError) as exc:
        fix = "pass the JSON given to motor-kv-adapter serve --config"
        return [Mismatch("--adapter-config", f"{adapter_config_path}: cannot be read: {exc}", fix)]
    return compare(engine[0], engine[1], adapter, adapter_config_path, engine_label, env_where)
