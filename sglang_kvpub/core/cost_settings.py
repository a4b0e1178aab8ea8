"""The rank cost's settings as both halves configure them, and where they differ.

The engine's cache-aware dispatcher and the Motor adapter score ranks with one function
(:func:`sglang_kvpub.core.rank_cost.score_ranks`); they pick the same rank only when given the
same constants.  The engine reads them from its plugin keys (``--kv-events-config`` or
``SGLANG_KVPUB_<KEY>``, sglang_kvpub/config.py), the adapter from its config's ``kv_affinity``;
the keys have the same names on both sides (:data:`COST_KEYS`).  This module holds what both
sides and both ``check-config`` commands share: the keys, their validation, the engine's
reading of them (a key in the JSON wins over the environment, as the plugin reads it) and the
comparison, whose every mismatch names the key, both values, where each came from, and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Union

from sglang_kvpub.core.errors import ConfigError

__all__ = [
    "COST_KEYS",
    "ENV_PREFIX",
    "OPTIONAL_COST_KEYS",
    "Cost",
    "Mismatch",
    "adapter_cost_from_json",
    "compare",
    "cost_from_env",
    "cost_problem",
    "cost_problems",
    "engine_cost",
    "env_name",
    "number_problems",
]

ENV_PREFIX = "SGLANG_KVPUB_"  # the plugin's environment variables: SGLANG_KVPUB_<KEY>
# CostParams' constants, named as the adapter's kv_affinity names them.
COST_KEYS = (
    "w_npu",
    "w_cpu",
    "w_disk",
    "prefill_load_scale",
    "overlap_credit",
    "load_weight",
    "hotspot_spread",
    "hotspot_relative",
)
OPTIONAL_COST_KEYS = ("hotspot_spread", "hotspot_relative")  # null: that half of the guard is off
# The defaults of both halves (Motor's; the guard off): CostParams' and KvAffinityConfig's.
DEFAULTS: dict[str, Union[float, None]] = {
    "w_npu": 1.0,
    "w_cpu": 1.0,
    "w_disk": 0.0,
    "prefill_load_scale": 1.0,
    "overlap_credit": 1.0,
    "load_weight": 1.0,
    "hotspot_spread": None,
    "hotspot_relative": None,
}

Cost = dict[str, Union[float, None]]


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _bad(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"key {key!r} (env {env_name(key)}) = {value!r} is invalid: {fix}")


def number_problems(name: str, value: Any, *, integer: bool = False) -> list[str]:
    """Why ``value`` cannot be the number >= 0 that ``name`` needs (a whole one if ``integer``),
    in the adapter's config's words; empty when it can."""
    kind = "a whole number" if integer else "a number"
    if isinstance(value, str):
        return [f"{name} is the string {value!r}: write {kind} without quotes"]
    if not _is_number(value):
        return [f"{name} is {value!r}: it must be {kind} >= 0"]
    if integer and not isinstance(value, int):
        if float(value).is_integer():
            return []
        return [f"{name} is {value!r}: it must be {kind}, e.g. {int(value)}"]
    if value < 0:
        return [f"{name} is {value!r}: it must be >= 0"]
    return []


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cost_problems(values: Mapping[str, Any], prefix: str) -> list[str]:
    """The problems of the cost keys in ``values`` (the adapter's ``kv_affinity``), each named
    ``prefix + key``: the check the engine's keys get from :func:`cost_problem`."""
    problems: list[str] = []
    for key in COST_KEYS:
        value = values.get(key)
        if key in values and not (value is None and key in OPTIONAL_COST_KEYS):
            problems += number_problems(prefix + key, value)
    return problems


def cost_problem(key: str, value: Any) -> Union[str, None]:
    """The fix when ``value`` cannot be ``key``'s (the plugin's keys), else None."""
    if (value is None and key in OPTIONAL_COST_KEYS) or (_is_number(value) and not number_problems(key, value)):
        return None
    what = "a number >= 0 or null (off)" if key in OPTIONAL_COST_KEYS else "a number >= 0"
    return f"use {what}, the same value as the Motor adapter's kv_affinity.{key}"


def cost_from_env(key: str, raw: str) -> Union[float, None]:
    """An environment value (text) as ``key``'s number; empty, none, null or off: None where allowed."""
    text = raw.strip()
    if key in OPTIONAL_COST_KEYS and text.lower() in ("", "none", "null", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise _bad(key, raw, "use a number >= 0, e.g. 1.0") from None


def engine_cost(kv_events: Union[Mapping[str, Any], None], env: Mapping[str, Any]) -> tuple[Cost, dict[str, str]]:
    """The engine's cost as the plugin reads it (a key in the ``--kv-events-config`` JSON wins over
    ``SGLANG_KVPUB_<KEY>``) and where each value came from; raises :class:`ConfigError`."""
    events = dict(kv_events or {})
    values: Cost = {}
    where: dict[str, str] = {}
    for key in COST_KEYS:
        if key in events:
            value, where[key] = events[key], f"--kv-events-config {key!r}"
        elif env_name(key) in env:
            value, where[key] = cost_from_env(key, str(env[env_name(key)])), env_name(key)
        else:
            value, where[key] = DEFAULTS[key], f"default; {env_name(key)} unset"
        fix = cost_problem(key, value)
        if fix is not None:
            raise _bad(key, value, fix)
        values[key] = None if value is None else float(value)
    return values, where


def adapter_cost_from_json(config: Mapping[str, Any]) -> Union[Cost, None]:
    """The cost in an adapter ``serve --config`` whose ``kv_affinity`` is an object (the shipped
    example's form); None when the weights come from elsewhere (``motor_config``, a path), which
    ``motor-kv-adapter check-config --adapter-config`` reads."""
    if "motor_config" in config:
        return None
    affinity = config.get("kv_affinity", {})
    if not isinstance(affinity, Mapping):
        return None
    values: Cost = {}
    for key in COST_KEYS:
        value = affinity.get(key, DEFAULTS[key])
        fix = cost_problem(key, value)
        if fix is not None:
            raise ConfigError(f"the adapter's kv_affinity.{key} = {value!r} is invalid: use a number >= 0")
        values[key] = None if value is None else float(value)
    return values


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One key the two halves disagree on, with the fix on both sides."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"problem: {self.key}: {self.message}\n    fix: {self.fix}"


def compare(
    engine: Cost,
    engine_where: Mapping[str, str],
    adapter: Cost,
    adapter_where: str,
    engine_label: str = "the engine",
    env_where: str = "the engine's environment",
) -> list[Mismatch]:
    """Every cost key on which ``engine`` and ``adapter`` differ."""
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
        return "off" if env else "null"
    return f"{value:g}"
