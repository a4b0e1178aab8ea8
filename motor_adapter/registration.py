"""Motor specifics: what a kv-conductor registration means.

Registrations come from Motor's conductor client (``motor-conductor.md`` section 4.1). We
read them the way the conductor does, and fix what the originating report found broken:

- ``medium_endpoints`` keys have aliases (npu|gpu|xpu|hbm|device, cpu|cpu_pinned|host|memory,
  disk|ssd|nvme|nof_ssd|dfs);
- a registration that repeats the engine URL under cpu/disk (Motor's pool-mode
  re-registration, the report's bug 4 / risk R3) is an ENGINE stream, never a pool: the
  conductor would parse it as pool events and drop every HBM store;
- ``type: sglang`` with ``dp_size`` > 1 and no ``fanned_in`` is an engine without our
  plugin: compatibility mode, one subscription per rank port ``base + rank``.

The checks of a whole Motor user config live in :mod:`motor_adapter.config_check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, Union

from motor_adapter.affinity import compat_endpoints

__all__ = [
    "HTTP_EVENTS_SCHEME",
    "MEDIUM_ALIASES",
    "MOTOR_REGISTER_TIMEOUT_S",
    "POOL_EXPLAINED",
    "RegistrationError",
    "Registration",
    "Unregistration",
    "parse_registration",
    "parse_unregistration",
    "http_events_stream",
]

# Motor's conductor client posts a registration once, when it adds the instance, with this
# timeout and no retry.
MOTOR_REGISTER_TIMEOUT_S = 2.0

MEDIUM_ALIASES: dict[str, str] = {
    **dict.fromkeys(("npu", "gpu", "xpu", "hbm", "device"), "npu"),
    **dict.fromkeys(("cpu", "cpu_pinned", "host", "memory"), "cpu"),
    **dict.fromkeys(("disk", "ssd", "nvme", "nof_ssd", "dfs"), "disk"),
}
DEFAULT_TENANT = "default"
_MAX_DP = 4096
MAX_COMPAT_DP = 256  # compat mode opens one subscriber (a SUB socket) per rank: keep one registration bounded

StreamMode = Literal["engine", "compat", "pool", "http_only"]
HTTP_EVENTS_SCHEME = "http-events://"
# Motor 3.1's pool-mode registration (Mooncake/Memcache, once per cluster, kv_conductor_config.pool_endpoint):
# accepted and listed, never followed - and why, for the operator who reads /register's warnings.
POOL_EXPLAINED = (
    "pool registration (endpoint without medium_endpoints, a Mooncake/Memcache master's placement stream): "
    "accepted and listed in /workers, not followed - its events name blocks by the pool's own hashes and a node "
    "IP, not by an engine rank; SGLang's host/disk tiers (HiCache) reach this adapter on the plugin's instance "
    "stream with each event's medium, so the engines' registrations carry every tier this adapter scores"
)


def http_events_stream(instance_id: str, dp_rank: int) -> str:
    """The index's name for a registration without any endpoint: its blocks come by ``POST /events``."""
    return f"{HTTP_EVENTS_SCHEME}{instance_id}/{dp_rank}"


class RegistrationError(ValueError):
    """A register/unregister body we cannot accept; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Registration:
    """One ``(instance_id, dp_rank)`` registration, interpreted.

    ``stream`` is the URL we subscribe to (``None``: nothing to follow); ``mode`` says how:
    ``engine`` (one stream - the plugin's instance stream or a single-rank engine),
    ``compat`` (ranks on ``stream``'s port + rank, ``compat_dp_size`` of them), ``pool``
    (pool streams, not followed) or ``http_only``.
    """

    instance_id: str
    dp_rank: int
    model: str
    tenant: str
    block_size: int
    engine_type: str
    store_backend: str
    media: dict[str, str]
    replay_endpoint: Union[str, None]
    node_id: Union[str, None]
    dp_size: Union[int, None]
    fanned_in: Union[bool, None]
    stream: Union[str, None]
    mode: StreamMode
    compat_dp_size: Union[int, None]
    warnings: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.tenant, self.model, self.instance_id, self.dp_rank)

    @property
    def index_name(self) -> Union[str, None]:
        """Whose blocks answer for this dp in its index: the stream's, or for a registration
        without any endpoint (Motor 3.1's HTTP-only worker) the blocks ``POST /events`` brings."""
        if self.stream is not None:
            return self.stream
        return http_events_stream(self.instance_id, self.dp_rank) if self.mode == "http_only" else None

    def same_as(self, other: Registration) -> bool:
        """Equal for idempotence: Motor re-registers the same thing every 30 s."""
        return dataclasses.replace(self, warnings=()) == dataclasses.replace(other, warnings=())

    def worker_endpoint(self) -> dict[str, Any]:
        """The ``GET /workers`` view of this dp, conductor-shaped."""
        return {
            "medium_endpoints": dict(self.media),
            "engine_type": self.engine_type,
            "dp_rank": self.dp_rank,
            "replay_endpoint": self.replay_endpoint,
            "store_backend": self.store_backend,
            "node_id": self.node_id,
            "stream": self.stream,
            "mode": self.mode,
            "compat_dp_size": self.compat_dp_size,
            "warnings": list(self.warnings),
        }


@dataclasses.dataclass(frozen=True)
class Unregistration:
    instance_id: str
    dp_rank: Union[int, None]  # None: every dp of the instance
    model: Union[str, None]
    tenant: str


def _str(body: Mapping[str, Any], key: str, default: Union[str, None] = None, required: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        if required:
            raise RegistrationError(f"{key} is required")
        return default
    if not isinstance(value, str) or (required and not value):
        raise RegistrationError(f"{key} must be a non-empty string, got {type(value).__name__}")
    return value


def _int(body: Mapping[str, Any], key: str, default: Union[int, None], minimum: int, maximum: int) -> Any:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RegistrationError(f"{key} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise RegistrationError(f"{key} must be in [{minimum}, {maximum}], got {value}")
    return value


def _check_url(key: str, url: Any) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise RegistrationError(f"{key} must be a ZMQ URL like tcp://HOST:PORT, got {url!r}")
    return url


def _normalise_media(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RegistrationError(f"medium_endpoints must be an object, got {type(raw).__name__}")
    media: dict[str, str] = {}
    for name, url in raw.items():
        medium = MEDIUM_ALIASES.get(str(name).strip().lower())
        if medium is None:
            known = ", ".join(sorted(MEDIUM_ALIASES))
            raise RegistrationError(f"medium_endpoints has unknown medium {name!r} (known: {known})")
        if url in (None, ""):
            continue
        media[medium] = _check_url(f"medium_endpoints.{name}", url)
    return media


def parse_registration(body: Any) -> Registration:
    """Reads a ``POST /register`` body; raises :class:`RegistrationError` with the field at fault."""
    if not isinstance(body, Mapping):
        raise RegistrationError(f"the body must be an object, got {type(body).__name__}")
    instance_id = _str(body, "instance_id", required=True)
    media = _normalise_media(body.get("medium_endpoints"))
    legacy = body.get("endpoint")
    if legacy not in (None, ""):
        legacy = _check_url("endpoint", legacy)
    replay = body.get("replay_endpoint")
    replay = _check_url("replay_endpoint", replay) if replay not in (None, "") else None
    fanned_in = body.get("fanned_in")
    if fanned_in is not None and not isinstance(fanned_in, bool):
        raise RegistrationError(f"fanned_in must be true or false, got {fanned_in!r}")
    engine_type = _str(body, "type", "vLLM")
    dp_size = _int(body, "dp_size", None, 1, _MAX_DP)
    fields: dict[str, Any] = {
        "instance_id": instance_id,
        "dp_rank": _int(body, "dp_rank", 0, 0, _MAX_DP),
        "model": _str(body, "modelname", None) or _str(body, "model_name", "default"),
        "tenant": _str(body, "tenant_id", DEFAULT_TENANT) or DEFAULT_TENANT,
        "block_size": _int(body, "block_size", 128, 1, 1 << 20),
        "engine_type": engine_type,
        "store_backend": _str(body, "store_backend", "") or "Mooncake",
        "replay_endpoint": replay,
        "node_id": _str(body, "node_id", None),
        "dp_size": dp_size,
        "fanned_in": fanned_in,
    }
    stream, mode, warnings = _interpret(instance_id, media, legacy, engine_type)
    compat = None
    if mode == "engine" and not fanned_in and engine_type.lower() == "sglang" and (dp_size or 1) > 1:
        mode, compat = "compat", dp_size
        warnings.append(
            f"type sglang with dp_size {dp_size} and no fanned_in: compatibility mode, "
            f"subscribing to {dp_size} rank ports from {stream} (run the engine with --plugin sglang_kvpub "
            "and register fanned_in: true for one stream with replay and snapshot)"
        )
    if compat is not None:
        _check_compat(stream, replay, compat)
    if legacy and not media:
        media = {"npu": legacy} if mode in ("engine", "compat") else dict.fromkeys(("npu", "cpu", "disk"), legacy)
    return Registration(
        media=media, stream=stream, mode=mode, compat_dp_size=compat, warnings=tuple(warnings), **fields
    )


def _check_compat(stream: Union[str, None], replay: Union[str, None], dp_size: int) -> None:
    """Refuses a compat registration whose rank ports cannot exist, before anything subscribes."""
    if dp_size > MAX_COMPAT_DP:
        raise RegistrationError(
            f"dp_size {dp_size} > {MAX_COMPAT_DP} in compatibility mode (one subscription per rank); "
            "run the engine with --plugin sglang_kvpub and register fanned_in: true"
        )
    for key, url in (("stream endpoint", stream), ("replay_endpoint", replay)):
        if url is None:
            continue
        try:
            compat_endpoints(url, dp_size)
        except ValueError as exc:
            raise RegistrationError(f"{key}: {exc}") from exc


def _interpret(
    instance_id: str, media: dict[str, str], legacy: Any, engine_type: str
) -> tuple[Union[str, None], StreamMode, list[str]]:
    warnings: list[str] = []
    engine = media.get("npu")
    lower = {m: url for m, url in media.items() if m != "npu"}
    if engine is not None:
        repeated = sorted(m for m, url in lower.items() if url == engine)
        if repeated:
            warnings.append(
                f"medium_endpoints repeats the engine URL {engine} under {'/'.join(repeated)}: treated as ONE "
                "engine stream (npu); a pool reading would drop every HBM BlockStored (Motor pool-mode "
                "re-registration, report bug 4). Register only npu for an engine."
            )
        others = sorted(m for m, url in lower.items() if url != engine)
        if others:
            warnings.append(f"pool streams ({'/'.join(others)}) are not followed by this adapter; only npu is")
        return engine, "engine", warnings
    if lower:
        warnings.append(f"pool-only registration ({'/'.join(sorted(lower))}): not followed by this adapter")
        return None, "pool", warnings
    if legacy:
        if "pool" in instance_id.lower():
            warnings.append(POOL_EXPLAINED)
            return None, "pool", warnings
        return str(legacy), "engine", warnings
    return None, "http_only", warnings


def parse_unregistration(body: Any) -> Unregistration:
    if not isinstance(body, Mapping):
        raise RegistrationError(f"the body must be an object, got {type(body).__name__}")
    return Unregistration(
        instance_id=_str(body, "instance_id", required=True),
        dp_rank=_int(body, "dp_rank", None, 0, _MAX_DP),
        model=_str(body, "modelname", None) or _str(body, "model_name", None),
        tenant=_str(body, "tenant_id", DEFAULT_TENANT) or DEFAULT_TENANT,
    )
