"""A kv-conductor-compatible HTTP service: Motor enables affinity by configuration alone.

Point Motor's ``kv_conductor_config.conductor_service`` / ``http_server_port`` at it.
Endpoints (``motor-conductor.md`` section 4): ``POST /register``, ``/unregister``,
``/query`` (JSON or msgpack body), ``/query_by_hash``; ``GET /workers``, ``/health``,
``/metrics``; ours: ``POST /select`` (Motor's decision + log line) and ``/explain``.

State: one :class:`~motor_adapter.affinity.KvAffinity` (one prefix index) per
``(model, tenant, block_size)``; one subscription per distinct stream URL in it, shared by
every registration naming that URL. ``/query`` lists every registered dp of the model,
zeros included (conductor semantics), with a fanned-in instance's engine ranks folded
into its registered dp and ``engine_dp_rank`` naming the rank that holds the prefix.

Request bodies are bounded, decoded with msgspec (JSON or msgpack, never pickle), and a
bad one gets a 4xx JSON ``{"error", "detail"}`` and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Union

import msgspec
from aiohttp import web
from xxhash import xxh3_128_intdigest as _xxh3_128

from motor_adapter import metrics
from motor_adapter.affinity import KvAffinity, decision_logger
from motor_adapter.registration import (
    DEFAULT_TENANT,
    Registration,
    RegistrationError,
    Unregistration,
    parse_registration,
    parse_unregistration,
)
from motor_adapter.registry.durable import DurableRegistrations
from motor_adapter.registry.store import open_store
from motor_adapter.scoring import (
    QUERY_SHAPES,
    Candidate,
    ConfigError,
    KvAffinityConfig,
    TierCounts,
    best_rank,
    dp_entry,
    fold_engine_dps,
    instance_entry,
    select,
)
from sglang_kvpub.core.hashing import chain_hashes, sequence_keys
from sglang_kvpub.transport.curve import RateLimiter

__all__ = ["ServiceConfig", "AdapterState", "RequestError", "build_app", "run_server", "AffinityFactory"]

log = logging.getLogger(__name__)

_U32_MAX = 0xFFFFFFFF
_U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
TOKEN_ENV = "MOTOR_KV_ADAPTER_TOKEN"
MAX_STREAMS_ENV = "MOTOR_KV_ADAPTER_MAX_STREAMS"
_MAX_REGISTRATIONS = 1 << 16  # registration records (cheap, but a flood must not grow them forever)
_CONFIGS_MAX = 64  # cached scoring configs: block_size comes from the network
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

_U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
_BLOCK_SIZE = Annotated[int, msgspec.Meta(gt=0, le=1 << 20)]


class QueryBody(msgspec.Struct, kw_only=True):
    """``/query`` and ``/query_by_hash``: decoded AND validated in C (the hot path)."""

    model: Union[str, None] = None
    block_size: _BLOCK_SIZE = 128
    tenant_id: Union[str, None] = None
    token_ids: Union[list[int], None] = None  # range-checked by u32_tokens in one C call
    block_hashes: Union[list[int], None] = None  # i64 or u64: range checked by the handler
    prompt: Any = None
    messages: Any = None
    tools: Any = None

    def common(self) -> tuple[str, str, int]:
        if not self.model:
            raise RequestError(400, "bad_field", "model must be a non-empty string")
        return self.model, self.tenant_id or DEFAULT_TENANT, self.block_size


AffinityFactory = Callable[[KvAffinityConfig, Union[int, None]], KvAffinity]
Hits = dict[str, dict[int, TierCounts]]


class RequestError(Exception):
    """A request we refuse: HTTP ``status``, a stable ``reason`` and a human ``detail``."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- configuration


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

    def __post_init__(self) -> None:
        if self.query_shape not in QUERY_SHAPES:
            raise ConfigError(
                [f"query_shape is {self.query_shape!r}: use one of {', '.join(QUERY_SHAPES)} (docs/motor.md)"]
            )
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise ConfigError([f"max_streams must be an integer >= 1, got {self.max_streams!r}"])
        dead = self.registry_dead_after_s
        if isinstance(dead, bool) or not isinstance(dead, (int, float)) or not 0 <= dead < math.inf:
            raise ConfigError([f"registry_dead_after_s must be a number >= 0 (0: never drop), got {dead!r}"])

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ServiceConfig:
        """Reads the ``--config`` JSON; ``kv_affinity`` may be ours or a whole Motor user config."""
        env = os.environ if env is None else env
        known = {f.name for f in dataclasses.fields(cls)} | {"tokenizer", "motor_config"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError([f"unknown service setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"])
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
                raise ConfigError([f"{MAX_STREAMS_ENV} must be an integer, got {env[MAX_STREAMS_ENV]!r}"]) from exc
        return cls(**values)

    @classmethod
    def from_file(cls, path: str, env: Mapping[str, str] | None = None) -> ServiceConfig:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, Mapping):
            raise ConfigError([f"{path}: expected a JSON object"])
        return cls.from_mapping(data, env)


# --------------------------------------------------------------------------- request fields


def _field_str(body: Mapping[str, Any], key: str, default: Union[str, None] = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise RequestError(400, "bad_field", f"{key} must be a non-empty string")
    return value


def _field_block_size(body: Mapping[str, Any], default: int) -> int:
    value = body.get("block_size", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 20:
        raise RequestError(400, "bad_field", f"block_size must be a positive integer, got {value!r}")
    return value


def token_ids_of(value: Any) -> list[int]:
    """Validated token ids: integers in [0, 2^32) (the conductor hashes them as u32)."""
    try:
        return msgspec.convert(value, list[_U32])
    except msgspec.ValidationError as exc:
        raise RequestError(400, "bad_field", f"token_ids must be a list of integers in [0, 2^32): {exc}") from exc


def u32_tokens(tokens: Sequence[int]) -> array[int]:
    """Token ids packed as u32 in one C call, which is also the range check [0, 2^32)."""
    try:
        return array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise RequestError(400, "bad_field", f"token_ids must be a list of integers in [0, 2^32): {exc}") from exc


# --------------------------------------------------------------------------- state


@dataclasses.dataclass
class _Index:
    affinity: KvAffinity
    users: dict[str, set[tuple[str, str, str, int]]]  # stream URL -> registration keys
    costs: dict[str, int] = dataclasses.field(default_factory=dict)  # stream URL -> subscriptions it runs


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One registered instance as ``/query`` renders it at one block_size."""

    instance: str
    dps: list[int]  # registered dps, sorted
    keys: tuple[str, ...]  # the same as JSON keys
    streams: tuple[tuple[int, str], ...]  # (dp, stream URL) of the registrations usable at this block_size
    single: bool  # one registration: its stream's engine ranks fold into its dp


@dataclasses.dataclass(frozen=True)
class _View:
    """What a query of ``(model, tenant, block_size)`` needs, grouped once per registration change."""

    regs: list[Registration]
    affinity: Union[KvAffinity, None]
    plans: tuple[_Plan, ...]


_VIEWS_MAX = 256  # distinct (model, tenant, block_size) asked for; bounded against odd block sizes


def _plans(regs: Sequence[Registration], block_size: int) -> tuple[_Plan, ...]:
    groups: dict[str, list[Registration]] = {}
    for reg in regs:  # registration order: the response lists instances in it
        groups.setdefault(reg.instance_id, []).append(reg)
    plans = []
    for instance, members in groups.items():
        dps = sorted(r.dp_rank for r in members)
        usable = tuple((r.dp_rank, r.stream) for r in members if r.block_size == block_size and r.stream is not None)
        plans.append(_Plan(instance, dps, tuple(str(dp) for dp in dps), usable, len(members) == 1))
    return tuple(plans)


def _index_key(reg: Registration) -> tuple[str, str, int]:
    return (reg.model, reg.tenant, reg.block_size)


def _cost(reg: Registration) -> int:
    """Subscriptions a registration's stream runs: one, or one per rank in compat mode."""
    return reg.compat_dp_size or 1


def _run(stops: Sequence[tuple[KvAffinity, str]], starts: Sequence[tuple[KvAffinity, Registration]]) -> None:
    """Stops, then starts, subscriptions (joins and spawns threads: never under ``_lock``)."""
    for affinity, url in stops:
        affinity.remove_instance(url)
    for affinity, reg in starts:
        assert reg.stream is not None
        affinity.add_instance(reg.stream, reg.stream, reg.replay_endpoint, compat_dp_size=reg.compat_dp_size)


def _source(reg: Registration) -> tuple[Any, ...]:
    """What a subscription depends on: equal sources share one subscriber and its index."""
    return (reg.model, reg.tenant, reg.block_size, reg.stream, reg.replay_endpoint, reg.compat_dp_size)


class AdapterState:
    """Registrations, indexes and tokenizers; the HTTP layer is a thin shell around it."""

    def __init__(self, config: ServiceConfig, affinity_factory: AffinityFactory | None = None) -> None:
        self.config = config
        self._factory: AffinityFactory = affinity_factory or (
            lambda cfg, cap: KvAffinity(
                cfg,
                cap,
                curve_server_keys=config.curve_server_keys,
                curve_client_secret_key_file=config.curve_client_secret_key_file,
            )
        )
        self._lock = threading.RLock()  # registrations may change while queries read them
        self._reg_lock = threading.Lock()  # orders registration changes; queries never take it
        self._registrations: dict[tuple[str, str, str, int], Registration] = {}
        self._indexes: dict[tuple[str, str, int], _Index] = {}
        self._tokenizers: dict[str, Any] = {}
        self._configs: dict[int, KvAffinityConfig] = {}
        self._views: dict[tuple[str, str, int], _View] = {}  # cleared on every registration change
        self.metrics = _Metrics()

    # ------------------------------------------------------------------ registration

    def register(self, reg: Registration) -> dict[str, Any]:
        """Adds or replaces one ``(instance_id, dp_rank)``; the same registration again is a no-op.

        Subscribers start and stop outside ``_lock`` (joining threads takes a while and queries
        take that lock on a view-cache miss); ``_reg_lock`` orders registration changes.
        Raises 429 ``too_many_streams`` / ``too_many_registrations`` past the caps. If the
        subscription cannot start, the previous state is restored and the error re-raised.
        """
        with self._reg_lock:
            with self._lock:
                old = self._registrations.get(reg.key)
                if old is not None and old.same_as(reg):
                    return {"status": "ok", "changed": False, "warnings": list(reg.warnings)}
                resubscribe = old is None or _source(old) != _source(reg)
                if old is None and len(self._registrations) >= _MAX_REGISTRATIONS:
                    raise RequestError(429, "too_many_registrations", f"{_MAX_REGISTRATIONS} registrations")
                if resubscribe:
                    self._check_streams(old, reg)
                self._registrations[reg.key] = reg
                self._views.clear()
                # Same stream (e.g. Motor's pool-mode re-registration repeating the URL under
                # cpu/disk): the record changes, the subscription and its index stay.
                stops = self._unbook(old) if resubscribe and old is not None else []
                starts = self._book(reg) if resubscribe else []
            try:
                _run(stops, starts)
            except Exception:
                log.exception("register %s dp %d: following %s failed", reg.instance_id, reg.dp_rank, reg.stream)
                self._roll_back(old, reg)
                raise
        for warning in reg.warnings:
            log.warning("register %s dp %d: %s", reg.instance_id, reg.dp_rank, warning)
        log.info(
            "registered %s dp %d model=%s tenant=%s block_size=%d stream=%s mode=%s",
            reg.instance_id, reg.dp_rank, reg.model, reg.tenant, reg.block_size, reg.stream, reg.mode,
        )  # fmt: skip
        self.metrics.registrations.inc(changed=str(old is not None).lower())
        return {"status": "ok", "changed": True, "warnings": list(reg.warnings)}

    def _streams(self) -> dict[tuple[tuple[str, str, int], str], int]:
        """Subscriptions followed now: ``(index key, URL) -> subscriber count`` (under ``_lock``)."""
        return {(key, url): cost for key, entry in self._indexes.items() for url, cost in entry.costs.items()}

    def _check_streams(self, old: Registration | None, reg: Registration) -> None:
        """429 when replacing ``old`` by ``reg`` would follow more than ``max_streams`` (under ``_lock``)."""
        streams = self._streams()
        before = sum(streams.values())
        if old is not None and old.stream is not None:
            entry = self._indexes.get(_index_key(old))
            if entry is not None and entry.users.get(old.stream, set()) <= {old.key}:
                streams.pop((_index_key(old), old.stream), None)
        if reg.stream is not None:
            streams[(_index_key(reg), reg.stream)] = _cost(reg)
        after = sum(streams.values())
        limit = self.config.max_streams
        if after > limit and after > before:
            detail = f"following {reg.stream} would make {after} subscriptions > max_streams {limit}"
            raise RequestError(429, "too_many_streams", detail)

    def _book(self, reg: Registration) -> list[tuple[KvAffinity, Registration]]:
        """Records ``reg`` as a user of its stream (under ``_lock``); returns the subscription to start."""
        key = _index_key(reg)
        entry = self._indexes.get(key)
        if entry is None:
            cfg = self.scoring_config(reg.block_size)
            entry = self._indexes[key] = _Index(self._factory(cfg, self.config.capacity_blocks), {})
        if reg.stream is None:
            return []
        entry.users.setdefault(reg.stream, set()).add(reg.key)
        entry.costs[reg.stream] = _cost(reg)
        # Idempotent for the same source; a different mode or replay URL replaces the subscription.
        return [(entry.affinity, reg)]

    def _unbook(self, reg: Registration) -> list[tuple[KvAffinity, str]]:
        """Forgets ``reg`` as a user of its stream (under ``_lock``); returns the subscription to
        stop when it was the last registration naming that URL."""
        entry = self._indexes.get(_index_key(reg))
        if entry is None or reg.stream is None:
            return []
        users = entry.users.get(reg.stream)
        if users is None:
            return []
        users.discard(reg.key)
        if users:
            return []
        del entry.users[reg.stream]
        entry.costs.pop(reg.stream, None)
        return [(entry.affinity, reg.stream)]

    def _roll_back(self, old: Registration | None, reg: Registration) -> None:
        """Undoes a registration whose subscription failed: ``old`` again (re-followed), or nothing."""
        with self._lock:
            if self._registrations.get(reg.key) is reg:
                if old is None:
                    del self._registrations[reg.key]
                else:
                    self._registrations[reg.key] = old
            self._views.clear()
            stops = self._unbook(reg)
            starts = self._book(old) if old is not None else []
            entry = self._indexes.get(_index_key(reg))
            users = entry.users.get(reg.stream, set()) if entry is not None and reg.stream is not None else set()
            if users and not stops:  # a failed replace may have stopped the URL other registrations share
                survivor = self._registrations.get(next(iter(users)))
                if survivor is not None:
                    starts += self._book(survivor)
        try:
            _run(stops, starts)
        except Exception:
            log.exception("register %s dp %d: restoring the previous subscription failed", reg.instance_id, reg.dp_rank)

    def unregister(self, unreg: Unregistration) -> int:
        with self._reg_lock:
            with self._lock:
                gone = [
                    reg
                    for key, reg in self._registrations.items()
                    if reg.instance_id == unreg.instance_id
                    and reg.tenant == unreg.tenant
                    and (unreg.dp_rank is None or reg.dp_rank == unreg.dp_rank)
                    and (unreg.model is None or reg.model == unreg.model)
                ]
                stops: list[tuple[KvAffinity, str]] = []
                for reg in gone:
                    del self._registrations[reg.key]
                    stops += self._unbook(reg)
                if gone:
                    self._views.clear()
            _run(stops, [])  # joins subscriber threads: outside _lock, so queries go on
        return len(gone)

    def registrations(self, model: str | None = None, tenant: str | None = None) -> list[Registration]:
        with self._lock:
            return [
                r
                for r in self._registrations.values()
                if (model is None or r.model == model) and (tenant is None or r.tenant == tenant)
            ]

    def scoring_config(self, block_size: int) -> KvAffinityConfig:
        """The configured weights at ``block_size`` (cached, bounded: building one validates it)."""
        cfg = self._configs.get(block_size)
        if cfg is None:
            cfg = dataclasses.replace(self.config.kv_affinity, block_size=block_size)
            if len(self._configs) >= _CONFIGS_MAX:  # block_size is network input: never grow forever
                self._configs = {}
            self._configs[block_size] = cfg
        return cfg

    def affinity(self, model: str, tenant: str, block_size: int) -> KvAffinity | None:
        with self._lock:
            entry = self._indexes.get((model, tenant, block_size))
            return entry.affinity if entry else None

    def close(self) -> None:
        with self._reg_lock:
            with self._lock:
                entries = list(self._indexes.values())
                self._indexes.clear()
                self._registrations.clear()
                self._views.clear()
            for entry in entries:
                entry.affinity.close()

    # ------------------------------------------------------------------ queries

    def _view(self, model: str, tenant: str, block_size: int) -> _View:
        """The cached grouping of ``(model, tenant)``'s registrations; 404 ``NoIndexer`` without any."""
        key = (model, tenant, block_size)
        view = self._views.get(key)  # lock-free read: a registration change replaces the whole dict entry
        if view is not None:
            return view
        with self._lock:
            regs = [r for r in self._registrations.values() if r.model == model and r.tenant == tenant]
            if not regs:
                self.metrics.missed_registration(model, tenant)
                raise RequestError(404, "NoIndexer", f"no registration for model {model!r} tenant {tenant!r}")
            entry = self._indexes.get(key)
            view = _View(regs, entry.affinity if entry else None, _plans(regs, block_size))
            if len(self._views) >= _VIEWS_MAX:
                self._views.clear()
            self._views[key] = view
        return view

    def instance_hits(
        self, model: str, tenant: str, block_size: int, fetch: Callable[[KvAffinity], Mapping[str, Any]]
    ) -> tuple[Hits, dict[str, list[int]], list[Registration]]:
        """Per registered instance its hits (engine ranks, or registered dps when it has several).

        Raises 404 ``NoIndexer`` when nothing is registered for ``(model, tenant)``.
        """
        view = self._view(model, tenant, block_size)
        raw = fetch(view.affinity) if view.affinity is not None else {}
        hits: Hits = {}
        dps: dict[str, list[int]] = {}
        for plan in view.plans:
            dps[plan.instance] = list(plan.dps)
            if plan.single:
                hits[plan.instance] = dict(raw.get(plan.streams[0][1], {})) if plan.streams else {}
                continue
            per_dp: dict[int, TierCounts] = {}
            for dp, stream in plan.streams:  # several endpoints: each registered dp reports its own stream's best rank
                folded = fold_engine_dps(raw.get(stream, {}), self.config.kv_affinity)
                if folded is not None:
                    per_dp[dp] = folded
            hits[plan.instance] = per_dp
        return hits, dps, list(view.regs)

    def query(self, model: str, tenant: str, block_size: int, token_ids: Sequence[int]) -> dict[str, Any]:
        started = time.perf_counter()
        keys = sequence_keys(token_ids, block_size)  # the HTTP path's array("I"): hashed from its buffer
        return self._keys_response(model, tenant, block_size, keys, len(token_ids) // block_size, started)

    def query_by_hash(self, model: str, tenant: str, block_size: int, local_hashes: Sequence[int]) -> dict[str, Any]:
        started = time.perf_counter()
        keys = chain_hashes(local_hashes)
        return self._keys_response(model, tenant, block_size, keys, len(keys), started)

    def query_keys(
        self, model: str, tenant: str, block_size: int, keys: list[int], blocks: int, started: float | None = None
    ) -> dict[str, Any]:
        """``/query``'s answer for a prompt's chained block keys (``blocks`` full blocks asked)."""
        return self._keys_response(model, tenant, block_size, keys, blocks, started or time.perf_counter())

    def _keys_response(
        self, model: str, tenant: str, block_size: int, keys: list[int], blocks: int, started: float
    ) -> dict[str, Any]:
        """``conductor_response(*instance_hits(..), fold=True, shape=..)`` fused for the hot path (same JSON)."""
        view = self._view(model, tenant, block_size)
        cfg, shape = self.scoring_config(block_size), self.config.query_shape
        best = self._best_ranks(view, keys, block_size)
        out, observed = _conductor_answer(view.plans, best, block_size, cfg, shape)
        self.metrics.observe_hits(model, observed, blocks, started, block_size)
        return {tenant: out}

    def _best_ranks(self, view: _View, keys: list[int], block_size: int) -> Mapping[str, tuple[int, TierCounts]]:
        """Per stream holding block 0: ``(engine rank, hit)`` of its best rank (``best_rank``)."""
        if view.affinity is None:
            return {}
        best = view.affinity.best_for_keys(keys)  # one pass while only NPU holds blocks
        if best is not None:
            return best
        cfg = self.scoring_config(block_size)
        out: dict[str, tuple[int, TierCounts]] = {}
        for stream, ranks in view.affinity.hits_for_keys(keys).items():
            found = best_rank(ranks, cfg)
            if found is not None:
                out[stream] = (found[0], found[1])
        return out

    def select(
        self,
        model: str,
        tenant: str,
        block_size: int,
        candidates: Sequence[Candidate],
        token_ids: Sequence[int],
    ) -> Any:
        """Motor's decision over what ``/query`` answers it.

        When any registered instance holds a block of the prompt, every registered instance
        is scored, zero hits included (the conductor lists them all, so Motor weighs an idle
        cold instance against a loaded warm one). When none holds any, the decision is
        load_balance with reason "no prefix hit on any candidate" (the report's cold request).
        """
        cfg = self.scoring_config(block_size)
        hits: Hits | None = None
        if len(token_ids) >= block_size:
            try:
                found, _, _ = self.instance_hits(model, tenant, block_size, lambda aff: aff.query(token_ids))
            except RequestError:
                found = {}
            if any(x.npu_blocks + x.cpu_blocks + x.disk_blocks for h in found.values() for x in h.values()):
                hits = found
        decision = select(cfg, candidates, hits, len(token_ids))
        if decision.reason in ("no index data", "no index data for any candidate"):
            decision = dataclasses.replace(decision, reason="no prefix hit on any candidate")
        return decision

    # ------------------------------------------------------------------ tokenizers

    def tokenizer_for(self, model: str) -> Any:
        path = self.config.tokenizers.get(model) or self.config.tokenizer_path
        if not path:
            raise RequestError(
                400, "no_tokenizer", "prompt/messages need a tokenizer: set tokenizer_path (or tokenizers) in --config"
            )
        with self._lock:
            tok = self._tokenizers.get(path)
        if tok is None:
            from motor_adapter.tokenize import TokenizerError, load_tokenizer

            try:
                tok = load_tokenizer(path, trust_remote_code=self.config.trust_remote_code)
            except TokenizerError as exc:
                raise RequestError(500, "tokenizer_unavailable", str(exc)) from exc
            with self._lock:
                self._tokenizers[path] = tok
        return tok

    def tokens_of(self, model: str, body: Mapping[str, Any]) -> list[int]:
        """``token_ids`` as given, else ``prompt``/``messages`` through the model's tokenizer."""
        if body.get("token_ids") is not None:
            return token_ids_of(body["token_ids"])
        if body.get("prompt") is None and body.get("messages") is None:
            raise RequestError(400, "bad_field", "the body needs token_ids, prompt or messages")
        from motor_adapter.tokenize import TokenizerError, encode_request

        tok = self.tokenizer_for(model)
        try:
            return encode_request(tok, body)
        except TokenizerError as exc:
            raise RequestError(400, "bad_prompt", str(exc)) from exc
        except Exception as exc:  # a chat template may raise anything on odd input
            raise RequestError(400, "bad_prompt", f"{type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ views

    def workers(self) -> dict[str, Any]:
        regs = self.registrations()
        health = self.stream_health()
        grouped: dict[tuple[str, str, str], dict[str, Any]] = {}
        for reg in sorted(regs, key=lambda r: r.key):
            worker = grouped.setdefault(
                (reg.tenant, reg.model, reg.instance_id),
                {
                    "instance_id": reg.instance_id,
                    "model_name": reg.model,
                    "tenant_id": reg.tenant,
                    "block_size": reg.block_size,
                    "endpoints": {},
                    "health": {},
                },
            )
            worker["endpoints"][str(reg.dp_rank)] = reg.worker_endpoint()
            if reg.stream is not None:
                worker["health"][str(reg.dp_rank)] = [
                    _as_dict(h) for h in health.get((reg.model, reg.tenant, reg.block_size, reg.stream), [])
                ]
        return {"workers": list(grouped.values())}

    def stream_health(self) -> dict[tuple[str, str, int, str], list[Any]]:
        with self._lock:
            entries = list(self._indexes.items())
        out: dict[tuple[str, str, int, str], list[Any]] = {}
        for (model, tenant, block_size), entry in entries:
            for stream, healths in entry.affinity.health().items():
                out[(model, tenant, block_size, stream)] = list(healths)
        return out

    def render_metrics(self) -> str:
        return self.metrics.render(self.stream_health(), self.registrations())


def _conductor_answer(
    plans: Sequence[_Plan],
    best: Mapping[str, tuple[int, TierCounts]],
    block_size: int,
    cfg: KvAffinityConfig,
    shape: str,
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str, int, TierCounts]]]:
    """``/query``'s per-instance entries (:func:`scoring.instance_entry` in ``shape``) from each
    stream's best rank, and the hits listed (instance, dp key, engine rank, hit) for the metrics.
    Every registered dp is listed."""
    out: dict[str, dict[str, Any]] = {}
    observed: list[tuple[str, str, int, TierCounts]] = []
    for plan in plans:
        if plan.single:  # one endpoint: its engine ranks fold into the registered dp
            found = best.get(plan.streams[0][1]) if plan.streams else None
            if found is None:
                entry = dp_entry(None, None, block_size)
            else:
                entry = dp_entry(found[1], found[0], block_size)
                observed.append((plan.instance, plan.keys[0], found[0], found[1]))
            out[plan.instance] = instance_entry({plan.keys[0]: entry}, cfg, block_size, shape)
            continue
        per_dp: dict[int, TierCounts] = {}
        for dp, stream in plan.streams:  # several endpoints: each registered dp reports its own stream's best rank
            found = best.get(stream)
            if found is not None:
                per_dp[dp] = found[1]
        entries: dict[str, dict[str, Any]] = {}
        for dp, dp_key in zip(plan.dps, plan.keys, strict=True):
            hit = per_dp.get(dp)
            if hit is None:
                entries[dp_key] = dp_entry(None, dp, block_size)
                continue
            entries[dp_key] = dp_entry(hit, dp, block_size)
            observed.append((plan.instance, dp_key, dp, hit))
        out[plan.instance] = instance_entry(entries, cfg, block_size, shape)
    return out, observed


# --------------------------------------------------------------------------- metrics

_STREAM_FIELDS = (
    ("batches", "counter", "Batches applied from the stream (heartbeats included)"),
    ("events", "counter", "KV events applied"),
    ("gaps", "counter", "Sequence gaps detected"),
    ("replays", "counter", "Gaps filled by a replay"),
    ("snapshots", "counter", "Snapshots applied"),
    ("decode_errors", "counter", "Payloads that failed to decode"),
    ("dropped_block_size", "counter", "Events dropped for a block_size other than the registered one"),
    ("restarts", "counter", "Publisher restarts detected"),
    ("reconnects", "counter", "Reconnections"),
    ("connected", "gauge", "1 while the stream is live"),
    ("last_event_age_s", "gauge", "Seconds since the last batch with events"),
)


_TIERS = (("npu", "npu_blocks"), ("cpu", "cpu_blocks"), ("disk", "disk_blocks"))
_LABELS_MAX = 4096
_MISSED_SERIES_MAX = 256  # model names come from the network: a bounded set of series, then "<other>"
_MISSED_LOG_INTERVAL_S = 60.0


def _hit_labels(instance: str, dp: str, rank: int, tier: int) -> metrics.Labels:
    """``instance_hits``' label set, sorted by name as ``Counter.inc`` sorts them."""
    return (("dp", dp), ("engine_dp_rank", str(rank)), ("instance", instance), ("tier", _TIERS[tier][0]))


class _Metrics:
    def __init__(self) -> None:
        reg = metrics.Registry()
        self.registry = reg
        self.requests = reg.counter("motor_kv_adapter_requests_total", "HTTP requests by path and status")
        self.bad_requests = reg.counter("motor_kv_adapter_bad_requests_total", "Refused requests by path and reason")
        self.registrations = reg.counter("motor_kv_adapter_registrations_total", "Registrations that changed state")
        self.latency = reg.histogram("motor_kv_adapter_query_seconds", "Query latency (index lookup and response)")
        self.query_blocks = reg.counter("motor_kv_adapter_query_blocks_total", "Full prompt blocks queried")
        self.hit_blocks = reg.counter(
            "motor_kv_adapter_query_hit_blocks_total", "Blocks of the best instance's hit, summed over queries"
        )
        self.instance_hits = reg.counter(
            "motor_kv_adapter_instance_hit_blocks_total", "Hit blocks per instance, registered dp, engine rank and tier"
        )
        self.unregistered = reg.counter(
            "motor_kv_adapter_unregistered_queries_total",
            "Queries for a model with no registration (404 NoIndexer: Motor falls back to load_balance)",
        )
        self._missed: dict[tuple[str, str], list[float]] = {}  # (model, tenant) -> [next log time, count since]
        # Live counter cells of the query hot path, per model and per (instance, dp key, engine rank).
        self._model_cells: dict[str, tuple[metrics.Labels, list[float], list[float]]] = {}
        self._hit_cells: dict[tuple[str, str, int], list[Union[list[float], None]]] = {}

    def observe_hits(
        self, model: str, hits: Sequence[tuple[str, str, int, TierCounts]], blocks: int, started: float, block_size: int
    ) -> None:
        """One query: its latency, its blocks, and per ``(instance, dp key, engine rank, hit)`` the hit tiers.

        Hot path: counts go into cached live cells (:meth:`metrics.Counter.cell`), no label
        set is built or hashed per query.
        """
        per_model = self._model_cells.get(model)
        if per_model is None:
            if len(self._model_cells) >= _LABELS_MAX:
                self._model_cells.clear()  # only a cache: the counters keep their series
            labels: metrics.Labels = (("model", model),)
            queried_cell, hit_cell = self.query_blocks.cell(labels), self.hit_blocks.cell(labels)
            per_model = self._model_cells[model] = (labels, queried_cell, hit_cell)
        model_labels, queried, hit_blocks = per_model
        self.latency.observe_labels(time.perf_counter() - started, model_labels)
        queried[0] += blocks
        best = 0
        for instance, dp, rank, hit in hits:
            counts = (hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks)
            best = max(best, sum(counts))
            cells = self._hit_cells.get((instance, dp, rank))
            if cells is None:
                if len(self._hit_cells) >= _LABELS_MAX:
                    self._hit_cells.clear()
                cells = self._hit_cells[(instance, dp, rank)] = [None, None, None]
            for tier, count in enumerate(counts):
                if count:
                    cell = cells[tier]
                    if cell is None:  # a tier's series appears with its first block, as before
                        cell = cells[tier] = self.instance_hits.cell(_hit_labels(instance, dp, rank, tier))
                    cell[0] += count
        hit_blocks[0] += min(best, blocks)

    def missed_registration(self, model: str, tenant: str) -> None:
        """Counts a query nothing is registered for; logs it once per interval per (model, tenant)."""
        labels = (model, tenant) if len(self._missed) < _MISSED_SERIES_MAX or (model, tenant) in self._missed else None
        self.unregistered.inc(model=labels[0] if labels else "<other>", tenant=labels[1] if labels else "<other>")
        if labels is None:
            return
        now = time.monotonic()
        entry = self._missed.setdefault(labels, [0.0, 0.0])
        entry[1] += 1
        if now < entry[0]:
            return
        log.warning(
            "%d quer%s for model %r tenant %r found no registration since the last report: Motor registers an "
            "instance once, when it adds it, so an adapter that was not running then (or lost it) never learns it; "
            "re-add the instance in Motor, or send its registration with `motor-kv-adapter register` "
            "(docs/operations.md)",
            entry[1],
            "y" if entry[1] == 1 else "ies",
            model,
            tenant,
        )
        entry[0], entry[1] = now + _MISSED_LOG_INTERVAL_S, 0.0

    def render(self, health: Mapping[tuple[str, str, int, str], list[Any]], regs: Sequence[Registration]) -> str:
        names: dict[tuple[str, str, int, str], str] = {}
        for reg in regs:
            if reg.stream is not None:
                key = (reg.model, reg.tenant, reg.block_size, reg.stream)
                names[key] = ",".join(sorted(filter(None, {names.get(key, ""), f"{reg.instance_id}/{reg.dp_rank}"})))
        extra: list[metrics.Gauge] = []
        ratio = metrics.Gauge("motor_kv_adapter_query_hit_ratio", "Hit blocks / queried blocks since start")
        for labels, total in self.query_blocks.items().items():
            model = dict(labels)["model"]
            ratio.set(self.hit_blocks.value(model=model) / total if total else 0.0, model=model)
        extra.append(ratio)
        for field, kind, help_text in _STREAM_FIELDS:
            gauge = metrics.Gauge(
                f"motor_kv_adapter_stream_{field}" + ("_total" if kind == "counter" else ""), help_text
            )
            gauge.kind = kind
            for key, healths in health.items():
                for h in healths:
                    value = getattr(h, field, None)
                    if value is None:
                        continue
                    rank = getattr(h, "dp_rank_override", None)
                    gauge.set(
                        float(value),
                        model=key[0],
                        tenant=key[1],
                        stream=getattr(h, "endpoint", key[3]),
                        registrations=names.get(key, ""),
                        dp_rank="all" if rank is None else rank,
                    )
            extra.append(gauge)
        return self.registry.render(extra)


# --------------------------------------------------------------------------- HTTP


def _as_dict(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()


def _json_response(data: Any) -> web.Response:
    return web.Response(body=_ENCODER.encode(data), content_type="application/json")


def _answer(request: web.Request, data: Any) -> web.Response:
    """A query answer: msgpack when the client's Accept names a msgpack type, else JSON."""
    accept = request.headers.get("Accept")
    if accept and "msgpack" in accept and any(kind in accept for kind in MSGPACK_TYPES):
        return web.Response(body=_MSGPACK_ENCODER.encode(data), content_type=MSGPACK_TYPES[0])
    return _json_response(data)


@dataclasses.dataclass(frozen=True)
class _Prompt:
    """What a ``/query`` body asks, hashed: the part of a query that depends on the body alone."""

    model: str
    tenant: str
    block_size: int
    keys: list[int]  # shared by every hit of the cache: never mutated
    blocks: int


class _PromptCache:
    """Hashed ``/query`` bodies by their exact bytes: a prompt sent again (a retry, a repeated
    prompt, several routers asking for the same request) skips decoding, tokenizing and
    hashing. Keyed by XXH3-128 of the body, confirmed by comparing the stored body (a
    collision is a miss, never a wrong answer). Bounded in entries and bytes, least recently
    used first out. Only touched from the event loop thread."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 32 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, bool], tuple[bytes, _Prompt]] = {}
        self._bytes = 0

    @staticmethod
    def key(raw: bytes, is_msgpack: bool) -> tuple[int, bool]:
        return _xxh3_128(raw), is_msgpack

    def get(self, key: tuple[int, bool], raw: bytes) -> _Prompt | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._entries[key] = entry  # most recent last
        return entry[1] if entry[0] == raw else None

    def put(self, key: tuple[int, bool], raw: bytes, prompt: _Prompt) -> None:
        size = _entry_bytes(raw, prompt)
        if size > self.max_bytes // 8:
            return  # one huge body must not flush the cache
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= _entry_bytes(*old)
        self._entries[key] = (raw, prompt)
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self._bytes -= _entry_bytes(*self._entries.pop(oldest))


def _entry_bytes(raw: bytes, prompt: _Prompt) -> int:
    return len(raw) + 8 * len(prompt.keys)


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


class _Handlers:
    def __init__(self, state: AdapterState, registry: DurableRegistrations) -> None:
        self.state = state
        self.registry = registry
        self.config = state.config
        self._json = msgspec.json.Decoder()
        self._msgpack = msgspec.msgpack.Decoder()
        self._query_json = msgspec.json.Decoder(QueryBody)
        self._query_msgpack = msgspec.msgpack.Decoder(QueryBody)
        self._prompts = _PromptCache()
        self._register_lock = registry.lock  # restores and other replicas' changes take it too

    async def body(self, request: web.Request) -> dict[str, Any]:
        data = await self._decode(request, self._msgpack, self._json)
        if not isinstance(data, dict):
            raise RequestError(400, "bad_body", f"the body must be an object, got {type(data).__name__}")
        return data

    async def query_body(self, request: web.Request) -> QueryBody:
        body: QueryBody = await self._decode(request, self._query_msgpack, self._query_json)
        return body

    async def _decode(self, request: web.Request, msgpack_decoder: Any, json_decoder: Any) -> Any:
        raw, is_msgpack = await self._raw(request)
        return self._parse(raw, is_msgpack, msgpack_decoder, json_decoder)

    async def _raw(self, request: web.Request) -> tuple[bytes, bool]:
        """The body (bounded) and whether it is msgpack."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(413, "body_too_large", f"{request.content_length} bytes > limit {limit}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise RequestError(413, "body_too_large", f"body larger than {limit} bytes") from exc
        if len(raw) > limit:
            raise RequestError(413, "body_too_large", f"{len(raw)} bytes > limit {limit}")
        return raw, request.content_type in MSGPACK_TYPES

    @staticmethod
    def _parse(raw: bytes, is_msgpack: bool, msgpack_decoder: Any, json_decoder: Any) -> Any:
        try:
            return msgpack_decoder.decode(raw) if is_msgpack else json_decoder.decode(raw)
        except msgspec.ValidationError as exc:  # well-formed, wrong shape: name the field
            reason = "bad_field" if "at `$." in str(exc) else "bad_body"
            raise RequestError(400, reason, str(exc)) from exc
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep for Any fields
            kind = "msgpack" if is_msgpack else "JSON"
            raise RequestError(400, f"invalid_{kind.lower()}", f"the body is not valid {kind}: {exc}") from exc

    def authorize(self, request: web.Request) -> None:
        token = self.config.auth_token
        if not token:
            return
        given = request.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
            raise RequestError(401, "unauthorized", "this endpoint needs Authorization: Bearer <token>")

    async def register(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = await self.body(request)
        try:
            reg = parse_registration(body)
        except RegistrationError as exc:
            raise RequestError(400, "bad_registration", str(exc)) from exc
        async with self._register_lock:  # starting/stopping subscribers joins threads: off the loop
            result = await asyncio.to_thread(self.state.register, reg)
            result = await self.registry.registered(body, reg, result)  # write-through, bounded wait
        return web.json_response(result)

    async def unregister(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = await self.body(request)
        try:
            unreg = parse_unregistration(body)
        except RegistrationError as exc:
            raise RequestError(400, "bad_registration", str(exc)) from exc
        async with self._register_lock:
            removed = await asyncio.to_thread(self.state.unregister, unreg)
            removed += await self.registry.unregistered(unreg)  # write-through (and unrestorable records)
        if not removed:
            raise RequestError(404, "InstanceNotFound", f"{unreg.instance_id} dp {unreg.dp_rank} is not registered")
        return web.json_response({"status": "ok", "removed": removed})

    def _common(self, body: Mapping[str, Any]) -> tuple[str, str, int]:
        model = _field_str(body, "model")
        tenant = body.get("tenant_id") or DEFAULT_TENANT
        if not isinstance(tenant, str):
            raise RequestError(400, "bad_field", "tenant_id must be a string")
        return model, tenant, _field_block_size(body, 128)

    async def _tokens(self, model: str, body: Mapping[str, Any]) -> list[int]:
        if body.get("token_ids") is not None:
            return token_ids_of(body["token_ids"])
        return await asyncio.to_thread(self.state.tokens_of, model, body)  # tokenizers are slow

    async def query(self, request: web.Request) -> web.Response:
        raw, is_msgpack = await self._raw(request)
        started = time.perf_counter()
        cache_key = self._prompts.key(raw, is_msgpack)
        prompt = self._prompts.get(cache_key, raw)
        if prompt is None:
            body: QueryBody = self._parse(raw, is_msgpack, self._query_msgpack, self._query_json)
            model, tenant, block_size = body.common()
            tokens: Sequence[int] | None = body.token_ids
            if tokens is None:
                fields = {"prompt": body.prompt, "messages": body.messages, "tools": body.tools}
                tokens = await asyncio.to_thread(self.state.tokens_of, model, fields)
            keys = sequence_keys(u32_tokens(tokens), block_size)
            prompt = _Prompt(model, tenant, block_size, keys, len(tokens) // block_size)
            self._prompts.put(cache_key, raw, prompt)
        p = prompt
        return _answer(request, self.state.query_keys(p.model, p.tenant, p.block_size, p.keys, p.blocks, started))

    async def query_by_hash(self, request: web.Request) -> web.Response:
        body = await self.query_body(request)
        model, tenant, block_size = body.common()
        if body.block_hashes is None:
            raise RequestError(400, "bad_field", "block_hashes (a list of 64-bit local block hashes) is required")
        if any(not _I64_MIN <= h <= _U64_MASK for h in body.block_hashes):
            raise RequestError(400, "bad_field", "block_hashes must hold 64-bit integers (u64, or i64)")
        hashes = [h & _U64_MASK for h in body.block_hashes]
        return _answer(request, self.state.query_by_hash(model, tenant, block_size, hashes))

    async def select(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        model, tenant, _ = self._common(body)
        block_size = _field_block_size(body, self.config.kv_affinity.block_size)
        candidates = _candidates(body.get("candidates"))
        tokens = await self._tokens(model, body)
        decision = self.state.select(model, tenant, block_size, candidates, tokens)
        line = decision.log_line(role=str(body.get("role", "prefill")), req_id=str(body.get("req_id", "-")))
        decision_logger.info("%s", line)
        return web.json_response({**decision.to_dict(), "log_line": line})

    async def explain(self, request: web.Request) -> web.Response:
        from motor_adapter.explain import explain

        body = await self.body(request)
        model, tenant, block_size = self._common(body)
        tokens: list[int] | None = None
        tokenizer_error: str | None = None
        try:
            tokens = await self._tokens(model, body)
        except RequestError as exc:
            if body.get("token_ids") is not None:
                raise
            tokenizer_error = exc.detail
        bos = body.get("bos_token_id")
        if not isinstance(bos, int) or isinstance(bos, bool):
            bos = None
        if bos is None and body.get("token_ids") is None and tokens is not None:
            bos = getattr(self.state.tokenizer_for(model), "bos_token_id", None)
        report = await asyncio.to_thread(
            explain,
            self.state,
            model,
            tenant,
            block_size,
            tokens or [],
            tokenizer_error=tokenizer_error,
            bos_token_id=bos,
        )
        return web.json_response(report)

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.workers())

    async def registry_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry.status())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.state.render_metrics() + self.registry.render_metrics()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


def _candidates(value: Any) -> list[Candidate]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "bad_field", "candidates must be a non-empty list of {instance_id, load}")
    out: list[Candidate] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("instance_id"), str):
            raise RequestError(400, "bad_field", f"each candidate needs a string instance_id, got {item!r}")
        load = _load(item.get("load", 0))
        endpoint = item.get("endpoint")
        out.append(Candidate(item["instance_id"], load, endpoint if isinstance(endpoint, str) else None))
    return out


def _load(value: Any) -> float:
    """A candidate's load: a finite number >= 0 (a huge int overflows float, NaN/inf never rank)."""
    load = math.nan
    shown = type(value).__name__
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int beyond float range (its repr may fail too)
            load = float(value)
        shown = repr(load) if not math.isnan(load) or isinstance(value, float) else "an integer beyond float range"
    if not (math.isfinite(load) and load >= 0):
        raise RequestError(400, "bad_field", f"candidate load must be a finite number >= 0, got {shown}")
    return load


_UNLIMITED_PATHS = frozenset({"/health", "/metrics"})


def _rate_limit(config: ServiceConfig) -> list[Any]:
    """Refuses a client IP over its token bucket with 429 (counted by ``errors``); no middleware
    at all when no rate is set (one layer less on every request)."""
    if not config.rate_limit_rps:
        return []
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)

    @web.middleware
    async def limit(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        path_limited = request.path not in _UNLIMITED_PATHS
        if path_limited and not limiter.allow(request.remote or "-", time.monotonic()):
            raise RequestError(429, "rate_limited", f"over {config.rate_limit_rps:g} requests/s per client")
        response: web.StreamResponse = await handler(request)
        return response

    return [limit]


_REQUEST_LABELS: dict[tuple[str, int], metrics.Labels] = {}


def _request_labels(path: str, status: int) -> metrics.Labels:
    """``requests``' label set, built once per (route, status): paths are routes, so few."""
    labels = _REQUEST_LABELS.get((path, status))
    if labels is None:
        if len(_REQUEST_LABELS) >= _LABELS_MAX:
            _REQUEST_LABELS.clear()
        labels = _REQUEST_LABELS[(path, status)] = (("path", path), ("status", str(status)))
    return labels


def build_app(state: AdapterState, registry: DurableRegistrations | None = None) -> web.Application:
    """The HTTP app; ``registry`` defaults to the store ``state.config.registry`` names (memory when unset).

    Raises :class:`~motor_adapter.registry.store.RegistryError` for a registry spec it cannot use.
    """
    if registry is None:
        store = open_store(state.config.registry or "memory")
        registry = DurableRegistrations(state, store, dead_after_s=state.config.registry_dead_after_s)
    handlers = _Handlers(state, registry)
    metric = state.metrics

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        path = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        try:
            response: web.StreamResponse = await handler(request)
        except RequestError as exc:
            metric.bad_requests.inc(path=path, reason=exc.reason)
            log.info("%s %s refused: %s", request.method, path, exc)
            response = _error(exc.status, exc.reason, exc.detail)
        except web.HTTPException as exc:  # 404/405 from routing
            metric.bad_requests.inc(path=path, reason=f"http_{exc.status}")
            response = _error(exc.status, exc.reason or "error", exc.text or "")
        except Exception as exc:  # a bug, not the client's fault: answer JSON, count it, keep serving
            metric.bad_requests.inc(path=path, reason="internal_error")
            log.exception("%s %s failed", request.method, path)
            response = _error(500, "internal_error", f"{type(exc).__name__} (see the adapter's log)")
        metric.requests.inc_labels(_request_labels(path, response.status))
        return response

    # aiohttp enforces the limit too (chunked bodies); ours gives the JSON message.
    app = web.Application(
        middlewares=[errors, *_rate_limit(state.config)], client_max_size=state.config.max_body_bytes + 1
    )
    app.router.add_post("/register", handlers.register)
    app.router.add_post("/unregister", handlers.unregister)
    app.router.add_post("/query", handlers.query)
    app.router.add_post("/query_by_hash", handlers.query_by_hash)
    app.router.add_post("/select", handlers.select)
    app.router.add_post("/explain", handlers.explain)
    app.router.add_get("/workers", handlers.workers)
    app.router.add_get("/registry", handlers.registry_status)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)

    async def start_registry(app: web.Application) -> None:
        await registry.start()  # a bad state file fails the start here, before the port opens

    async def close_registry(app: web.Application) -> None:
        await registry.close()  # before the state closes: closing forgets nothing in the store

    async def close_state(app: web.Application) -> None:
        await asyncio.to_thread(state.close)

    app.on_startup.append(start_registry)
    app.on_shutdown.append(close_registry)
    app.on_cleanup.append(close_state)
    return app


def run_server(config: ServiceConfig) -> None:
    """Serves until interrupted (``motor-kv-adapter serve``)."""
    state = AdapterState(config)
    web.run_app(build_app(state), host=config.host, port=config.port, access_log=None, print=None)
