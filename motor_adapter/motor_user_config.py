"""A Motor user config read as the released Motor reads it, for the checks of ``check-config``.

Where each section is (the engine that publishes, the scheduler, the conductor), engine
args as SGLang's CLI spells them, the engine's ``kv-events-config``, Motor's env config
sections, and the :class:`Finding` every check reports (``mindie-motor`` 3.0.0b2 and the
Ascend source; docs/motor.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Literal, Union
from urllib.parse import urlsplit

__all__ = [
    "ENABLED_ENV",
    "Finding",
    "conductor_section",
    "enable_multi_endpoints",
    "engine_args",
    "env_enables_plugin",
    "env_section",
    "find_engine",
    "has_plugin",
    "kv_events",
    "scheduler_section",
    "section_env",
    "sglang_page_size",
    "sglang_sections",
    "url_port",
]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem (``severity="problem"``, fails the check) or a note, with the key and fix."""

    key: str
    message: str
    fix: str
    severity: Literal["problem", "note"] = "problem"

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}\n    fix: {self.fix}"


def engine_args(engine: Mapping[str, Any]) -> dict[str, Any]:
    """Engine args with ``_`` spelled ``-``, as SGLang's CLI spells them."""
    args = engine.get("engine_config") or {}
    if not isinstance(args, Mapping):
        return {}
    return {str(k).replace("_", "-"): v for k, v in args.items()}


def kv_events(args: Mapping[str, Any]) -> tuple[Union[dict[str, Any], None], str]:
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


def url_port(url: Any) -> Union[int, None]:
    if not isinstance(url, str):
        return None
    try:
        return urlsplit(url.replace("*", "0.0.0.0")).port
    except ValueError:
        return None


def has_plugin(args: Mapping[str, Any]) -> bool:
    for key in ("plugin", "plugins"):
        value = args.get(key)
        items = value if isinstance(value, list) else str(value or "").replace(",", " ").split()
        if "sglang_kvpub" in items:
            return True
    return False


def find_engine(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    for role in ("prefill", "union", "decode"):
        key = f"motor_engine_{role}_config"
        engine = config.get(key)
        if isinstance(engine, Mapping) and "kv-events-config" in engine_args(engine):
            return key, engine
    for role in ("prefill", "union"):
        engine = config.get(f"motor_engine_{role}_config")
        if isinstance(engine, Mapping):
            return f"motor_engine_{role}_config", engine
    return "motor_engine_prefill_config", {}


def scheduler_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    coordinator = config.get("motor_coordinator_config")
    scheduler = coordinator.get("scheduler_config") if isinstance(coordinator, Mapping) else None
    return scheduler if isinstance(scheduler, Mapping) else {}


def conductor_section(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(config.get("kv_conductor_config"), Mapping):
        return "kv_conductor_config", config["kv_conductor_config"]
    scheduler = scheduler_section(config)
    if isinstance(scheduler.get("kv_conductor_config"), Mapping):
        return "motor_coordinator_config.scheduler_config.kv_conductor_config", scheduler["kv_conductor_config"]
    return "kv_conductor_config", {}


def enable_multi_endpoints(config: Mapping[str, Any]) -> bool:
    for section in ("motor_deploy_config", "basic_config", "motor_controller_config"):
        value = config.get(section)
        if isinstance(value, Mapping) and "enable_multi_endpoints" in value:
            return bool(value["enable_multi_endpoints"])
    engine = config.get("motor_engine_prefill_config")
    args = engine_args(engine) if isinstance(engine, Mapping) else {}
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


ENABLED_ENV = "SGLANG_KVPUB_ENABLED"  # sglang_kvpub.engine.plugin.ENABLED_ENV (no engine import here)


_TRUE = frozenset({"1", "true", "yes", "on"})


def env_section(config_key: str) -> str:
    """``motor_engine_prefill_config`` -> ``motor_engine_prefill_env`` (Motor's env config sections)."""
    return config_key.removesuffix("_config") + "_env"


def section_env(env_config: Any, config_key: str) -> Mapping[str, Any]:
    section = env_config.get(env_section(config_key)) if isinstance(env_config, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def env_enables_plugin(engine_env: Mapping[str, Any]) -> bool:
    return str(engine_env.get(ENABLED_ENV, "")).strip().lower() in _TRUE


def sglang_sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    sections = []
    for role in ("prefill", "decode", "union"):
        key = f"motor_engine_{role}_config"
        engine = config.get(key)
        if isinstance(engine, Mapping) and str(engine.get("engine_type", "")).lower() == "sglang":
            sections.append((key, engine))
    return sections
