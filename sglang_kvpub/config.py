"""Plugin configuration: SGLang's ``--kv-events-config`` keys plus the plugin's own keys.

SGLang validates ``--kv-events-config`` with a pydantic model that silently drops keys it
does not know, so a publisher built through SGLang's factory never sees plugin keys.
Plugin keys therefore come from environment variables ``SGLANG_KVPUB_<KEY>`` (upper
case); when the plugin parses the raw JSON string itself it also accepts them there, and
a key in the JSON wins over the environment.  Every bad value raises :class:`ConfigError`
naming the key, the value and the fix.  See docs/config.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args

from sglang_kvpub.core.cost_settings import COST_KEYS, ENV_PREFIX, cost_from_env, cost_problem, env_name
from sglang_kvpub.core.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "SGLANG_KEYS",
    "PLUGIN_KEYS",
    "COST_KEYS",
    "DISPATCH_LOG_KEYS",
    "ConfigError",
    "PluginConfig",
    "env_name",
    "should_bind",
    "offset_endpoint",
]

log = logging.getLogger(__name__)


HashFormName = Literal["u64", "i64"]
EncodingName = Literal["map", "array"]
FullPolicy = Literal["drop_oldest", "drop_newest"]
RankSendName = Literal["inline", "thread"]
DispatchName = Literal["default", "cache_aware"]

# The rank cost's settings (COST_KEYS, core/cost_settings.py) are spelled as the Motor adapter's
# kv_affinity spells them, so one set of values configures both halves (docs/dispatch.md).
DISPATCH_LOG_KEYS = ("dispatch_log", "dispatch_log_every")
DispatchLogName = Literal["debug", "info", "off"]

# Keys of SGLang's KVEventsConfig (0.5.23); only they are read from the JSON by SGLang itself.
SGLANG_KEYS = (
    "publisher",
    "endpoint",
    "bind",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
    "format",
)
PLUGIN_KEYS = (
    "hash_form",
    "event_encoding",
    "heartbeat_s",
    "internal_channel",
    "rank_queue_size",
    "full_policy",
    "rank_send",
    "dp_dispatch",
    "dp_pending",
    "load_report_s",
    "folded_endpoint",
    "folded_replay_endpoint",
    "folded_event_encoding",
    "rank_order",
    "curve_secret_key_file",
    "curve_public_key_file",
    "curve_authorized_keys",
    *COST_KEYS,
    *DISPATCH_LOG_KEYS,
)


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    # SGLang's keys (same names and defaults as KVEventsConfig).
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Union[str, None] = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    bind: Union[bool, None] = None
    publisher: str = "zmq"
    format: str = "default"
    # Plugin keys.
    hash_form: HashFormName = "u64"
    event_encoding: EncodingName = "map"
    heartbeat_s: float = 1.0
    internal_channel: Union[str, None] = None
    rank_queue_size: int = 10_000
    full_policy: FullPolicy = "drop_oldest"
    rank_send: RankSendName = "inline"
    dp_dispatch: DispatchName = "cache_aware"  # on by default with the plugin; "default" opts out
    load_report_s: float = 0.1  # the rank-load message (wire.LoadReport) at most this often; 0: never
    # The folded view (docs/wire.md "Which view"): the instance as one cache on its own PUB.
    folded_endpoint: Union[str, None] = None
    folded_replay_endpoint: Union[str, None] = None
    folded_event_encoding: Union[EncodingName, None] = None  # None: as event_encoding
    rank_order: bool = False  # each rank batch carries its rank's (epoch, seq): wire.RankOrder (opt-in)
    # Optional CURVE for the instance PUB and replay ROUTER (docs/security.md).
    curve_secret_key_file: Union[str, None] = None
    curve_public_key_file: Union[str, None] = None
    curve_authorized_keys: Union[str, None] = None  # directory of client *.key files; None: any client
    # The rank cost (Motor's defaults; hot-spot guard off): must equal the adapter's kv_affinity.
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0
    load_weight: float = 1.0
    hotspot_spread: Union[float, None] = None
    hotspot_relative: Union[float, None] = None
    # The DP controller's one line per dispatch decision: at debug level by default (quiet in
    # production), "info" to read it beside SGLang's own lines, "off"; every Nth decision only.
    dispatch_log: DispatchLogName = "debug"
    dispatch_log_every: int = 1
    # The dispatcher counts what a rank is prefilling or has queued as a future hit there
    # (docs/dispatch.md, "Pending prefixes"): a burst of one prompt shares one prefill.
    dp_pending: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _VALIDATORS[field.name](field.name, getattr(self, field.name))
        if self.folded_replay_endpoint and not self.folded_endpoint:
            raise _bad(
                "folded_replay_endpoint", self.folded_replay_endpoint, "set folded_endpoint too (the view's own PUB)"
            )

    @property
    def binds(self) -> bool:
        """Whether the instance PUB binds (True) or connects (False), as SGLang decides."""
        return should_bind(self.endpoint, self.bind)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> PluginConfig:
        """From already-parsed keys (e.g. the kwargs SGLang's publisher factory passes) plus env.

        Keys that are not configuration (``attn_dp_rank`` from the factory) are ignored.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for key in SGLANG_KEYS + PLUGIN_KEYS:
            if key in data:
                values[key] = data[key]
            elif key in PLUGIN_KEYS and env_name(key) in env:
                values[key] = _from_env(key, env[env_name(key)])
        if values.get("publisher") is None:
            values.pop("publisher", None)
        if values.get("format") is None:
            values.pop("format", None)
        return cls(**values)

    @classmethod
    def from_kv_events_json(cls, text: str, env: Mapping[str, str] | None = None) -> PluginConfig:
        """From the raw ``--kv-events-config`` string (plugin keys allowed in it) plus env."""
        try:
            data = json.loads(text) if text and text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--kv-events-config is not valid JSON ({exc.msg} at char {exc.pos}): fix the JSON"
            ) from exc
        if not isinstance(data, dict):
            raise ConfigError('--kv-events-config must be a JSON object like {"publisher": "zmq", ...}')
        unknown = sorted(set(data) - set(SGLANG_KEYS) - set(PLUGIN_KEYS))
        if unknown:
            log.warning("--kv-events-config: ignoring unknown keys %s", unknown)
        return cls.from_mapping(data, env)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def cost(self) -> dict[str, Any]:
        """The rank cost's settings (:data:`COST_KEYS`), as CacheAwareDispatcher's keywords."""
        return {key: getattr(self, key) for key in COST_KEYS}


# --------------------------------------------------------------------------- validation


def _where(key: str) -> str:
    if key in PLUGIN_KEYS:
        return f"key {key!r} (env {env_name(key)})"
    return f"--kv-events-config key {key!r}"


def _bad(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{_where(key)} = {value!r} is invalid: {fix}")


def _from_env(key: str, raw: str) -> Any:
    """Env values are strings; convert by the key's type, keeping the raw text for errors."""
    text = raw.strip()
    if key in (
        "internal_channel",
        "curve_secret_key_file",
        "curve_public_key_file",
        "curve_authorized_keys",
        "folded_endpoint",
        "folded_replay_endpoint",
        "folded_event_encoding",
    ):
        return text or None
    if key in ("rank_order", "dp_pending"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise _bad(key, raw, "use true or false")
    if key in ("heartbeat_s", "load_report_s"):
        try:
            return float(text)
        except ValueError:
            raise _bad(key, raw, "use a number of seconds, e.g. 1.0") from None
    if key in ("rank_queue_size", "dispatch_log_every"):
        try:
            return int(text)
        except ValueError:
            raise _bad(key, raw, "use a positive integer, e.g. 100") from None
    if key in COST_KEYS:
        return cost_from_env(key, raw)
    return text


def _choice(allowed: tuple[str, ...]) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if value not in allowed:
            raise _bad(key, value, "use one of " + ", ".join(repr(a) for a in allowed))

    return check


def _optional_choice(allowed: tuple[str, ...]) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if value is not None:
            _choice(allowed)(key, value)

    return check


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(key, value, "use true or false")


def _positive_int(minimum: int) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _bad(key, value, f"use an integer >= {minimum}")

    return check


def _endpoint(optional: bool) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise _bad(key, value, "use a ZMQ endpoint like 'tcp://*:5557' (tcp://, ipc:// or inproc://)")
        if value.startswith("tcp://") and not _port_of(value):
            raise _bad(key, value, "give a tcp port, e.g. 'tcp://*:5557'")

    return check


def _str(key: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(key, value, "use a string")


def _optional_bool(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise _bad(key, value, "use true, false or null (null: bind for *, 0.0.0.0, ::, ipc and inproc)")


def _heartbeat(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise _bad(key, value, "use a number of seconds in (0, 3600], e.g. 1.0")


def _load_report(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or 0.01 <= value <= 60):
        raise _bad(key, value, "use 0 (off) or a number of seconds in [0.01, 60], e.g. 0.1")


_UNIX_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
PACKET_SCHEME = "unixpkt://"  # the Unix SEQPACKET internal channel (packet_channel.py); others are ZMQ


def _internal_channel(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str) and value.startswith(PACKET_SCHEME):  # one node
        path = value[len(PACKET_SCHEME) :]
        if not path:
            raise _bad(key, value, "give a socket path, e.g. 'unixpkt:///run/sglang-kvpub/ch.pkt'")
        if not hasattr(socket, "SOCK_SEQPACKET"):
            raise _bad(key, value, "this platform has no Unix SEQPACKET sockets: use 'ipc://<path>'")
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise _bad(key, value, f"Unix socket paths are limited to {_UNIX_PATH_MAX} bytes: use a shorter path")
        return
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise _bad(key, value, "use 'unixpkt://<path>' (one node), 'ipc://<path>' or 'tcp://<fan-in host>:<port>'")
    _endpoint(False)(key, value)
    if isinstance(value, str) and value.startswith("tcp://") and "*" in value:
        raise _bad(key, value, "ranks connect to it: give the fan-in host's address, e.g. 'tcp://10.0.0.1:5600'")


def _cost(key: str, value: Any) -> None:
    fix = cost_problem(key, value)
    if fix is not None:
        raise _bad(key, value, fix)


def _optional_path(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise _bad(key, value, "use a file or directory path, or null")


_VALIDATORS: dict[str, Callable[[str, Any], None]] = {
    "endpoint": _endpoint(False),
    "replay_endpoint": _endpoint(True),
    "topic": _str,
    "buffer_steps": _positive_int(1),
    "hwm": _positive_int(0),
    "max_queue_size": _positive_int(1),
    "bind": _optional_bool,
    "publisher": _str,
    "format": _choice(("default", "dynamo")),
    "hash_form": _choice(get_args(HashFormName)),
    "event_encoding": _choice(get_args(EncodingName)),
    "heartbeat_s": _heartbeat,
    "internal_channel": _internal_channel,
    "rank_queue_size": _positive_int(1),
    "full_policy": _choice(get_args(FullPolicy)),
    "rank_send": _choice(get_args(RankSendName)),
    "dp_dispatch": _choice(get_args(DispatchName)),
    "load_report_s": _load_report,
    "folded_endpoint": _endpoint(True),
    "folded_replay_endpoint": _endpoint(True),
    "folded_event_encoding": _optional_choice(get_args(EncodingName)),
    "rank_order": _bool,
    "curve_secret_key_file": _optional_path,
    "curve_public_key_file": _optional_path,
    "curve_authorized_keys": _optional_path,
    **{key: _cost for key in COST_KEYS},
    "dispatch_log": _choice(get_args(DispatchLogName)),
    "dispatch_log_every": _positive_int(1),
    "dp_pending": _bool,
}


# --------------------------------------------------------------------------- endpoints


def should_bind(endpoint: str, bind: bool | None = None) -> bool:
    """SGLang's rule: explicit ``bind`` wins; else bind wildcard hosts, ipc and inproc."""
    if bind is not None:
        return bind
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return any(marker in endpoint for marker in ("*", "::", "0.0.0.0"))


def _port_of(endpoint: str) -> int | None:
    host_port = endpoint[len("tcp://") :]
    _, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        return None
    value = int(port)
    return value if 0 < value < 65536 else None


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The per-rank endpoint SGLang uses: tcp port + rank, inproc suffix ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        port = _port_of(endpoint)
        if port is None:
            raise ConfigError(f"endpoint {endpoint!r} has no tcp port to offset by rank {rank}")
        head = endpoint[: endpoint.rfind(":")]
        return f"{head}:{port + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ConfigError(f"endpoint {endpoint!r}: per-rank offsets need tcp:// (ipc cannot be offset)")
