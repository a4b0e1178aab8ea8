"""The adapter's settings (``motor-kv-adapter serve`` flags, a JSON file, the environment)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any, Union

from motor_adapter.scoring import (
    INVALID,
    QUERY_SHAPES,
    ConfigError,
    KvAffinityConfig,
)

__all__ = ["ServiceConfig", "TOKEN_ENV", "MAX_STREAMS_ENV"]


TOKEN_ENV = "MOTOR_KV_ADAPTER_TOKEN"
MAX_STREAMS_ENV = "MOTOR_KV_ADAPTER_MAX_STREAMS"


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 13333
    max_body_bytes: int = 8 << 20
    auth_token: Union[str, None] = None  # bearer token for /register and /unregister
    kv_affinity: KvAffinityConfig = dataclasses.field(default_factory=KvAffinityConfig)
    capacity_blocks: Union[int, None] = None
    tokenizer_path: Union[str, None] = None  # for every model without its own entry
    tokenizers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    trust_remote_code: bool = False
    # Security (docs/security.md): per-client-IP token bucket (None: off) and CURVE for streams.
    rate_limit_rps: Union[float, None] = None
    rate_limit_burst: int = 200
    curve_server_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)  # stream URL -> key
    curve_client_secret_key_file: Union[str, None] = None
    # Subscriptions followed at once (a compat registration counts one per rank): 429 beyond.
    max_streams: int = 1024
    # Where registrations outlive the process (docs/operations.md): "file:PATH", "etcd://HOST:PORT/PREFIX"
    # or None/"memory" (nothing survives); `motor-kv-adapter serve` defaults to a file in $XDG_STATE_HOME.
    registry: Union[str, None] = None
    registry_dead_after_s: float = 60.0  # a restored registration silent this long is dropped (0: never)
    # /query's DP layout (scoring.QUERY_SHAPES): "tokens" is what every released Motor scores.
    query_shape: str = "tokens"
    # /query_by_hash's units when the body names none: "tokens" (as /query) or "blocks" (Motor 3.1's conductor)
    query_by_hash_units: str = "tokens"

    def __post_init__(self) -> None:
        if self.query_shape not in QUERY_SHAPES:
            raise ConfigError(
                [f"query_shape is {self.query_shape!r}: use one of {', '.join(QUERY_SHAPES)} (docs/motor.md)"], INVALID
            )
        if self.query_by_hash_units not in ("tokens", "blocks"):
            raise ConfigError(
                [f"query_by_hash_units is {self.query_by_hash_units!r}: use tokens or blocks (docs/motor.md)"], INVALID
            )
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise ConfigError([f"max_streams must be an integer >= 1, got {self.max_streams!r}"], INVALID)
        dead = self.registry_dead_after_s
        if isinstance(dead, bool) or not isinstance(dead, (int, float)) or not 0 <= dead < math.inf:
            raise ConfigError([f"registry_dead_after_s must be a number >= 0 (0: never drop), got {dead!r}"], INVALID)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ServiceConfig:
        """Reads the ``--config`` JSON; ``kv_affinity`` may be ours or a whole Motor user config."""
        env = os.environ if env is None else env
        known = {f.name for f in dataclasses.fields(cls)} | {"tokenizer", "motor_config"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                [f"unknown service setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"], INVALID
            )
        values = {k: v for k, v in data.items() if k in known - {"tokenizer", "motor_config", "kv_affinity"}}
        tokenizer = data.get("tokenizer")
        if isinstance(tokenizer, Mapping):
            values.setdefault("tokenizer_path", tokenizer.get("path"))
            values.setdefault("trust_remote_code", bool(tokenizer.get("trust_remote_code", False)))
        elif isinstance(tokenizer, str):
            values.setdefault("tokenizer_path", tokenizer)
        source = data.get("motor_config") or data.get("kv_affinity")
        if isinstance(source, str):
            with open(source, encoding="utf-8") as handle:
                source = json.load(handle)
        if source is not None:
            values["kv_affinity"] = KvAffinityConfig.from_motor(source)
        if not values.get("auth_token") and env.get(TOKEN_ENV):
            values["auth_token"] = env[TOKEN_ENV]
        if "max_streams" not in values and env.get(MAX_STREAMS_ENV):
            try:
                values["max_streams"] = int(env[MAX_STREAMS_ENV])
            except ValueError as exc:
                raise ConfigError(
                    [f"{MAX_STREAMS_ENV} must be an integer, got {env[MAX_STREAMS_ENV]!r}"], INVALID
                ) from exc
        return cls(**values)

    @classmethod
    def from_file(cls, path: str, env: Mapping[str, str] | None = None) -> ServiceConfig:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, Mapping):
            raise ConfigError([f"{path}: expected a JSON object"], INVALID)
        return cls.from_mapping(data, env)
