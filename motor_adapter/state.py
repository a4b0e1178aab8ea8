"""The adapter's state: registrations and one prefix index per (model, tenant, block_size).

One :class:`~motor_adapter.affinity.KvAffinity` (one prefix index) per ``(model, tenant,
block_size)``; one subscription per distinct stream URL in it, shared by every registration
naming that URL.  :class:`AdapterState` is one lock (``_lock``) over registrations,
subscriptions and the query views (:class:`motor_adapter.query.View`, rebuilt when a
registration changes); a query itself runs in :mod:`motor_adapter.query`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from motor_adapter import query as query_path
from motor_adapter.adapter_metrics import AdapterMetrics
from motor_adapter.affinity import KvAffinity
from motor_adapter.answer import JSON_TYPE, Answer
from motor_adapter.http_contract import RequestError, as_dict
from motor_adapter.rank_loads import InstanceLoads
from motor_adapter.registration import (
    Registration,
    Unregistration,
)
from motor_adapter.scoring import (
    Candidate,
    KvAffinityConfig,
    TierCounts,
    fold_engine_dps,
    select,
)
from motor_adapter.settings import ServiceConfig
from motor_adapter.tokenize import Tokenizers
from sglang_kvpub.core.hashing import chain_hashes, sequence_keys
from sglang_kvpub.core.rank_cost import spread_key, spread_key_of_local

__all__ = ["JSON_TYPE", "AdapterState", "AffinityFactory", "Answer", "Hits"]

log = logging.getLogger(__name__)

_MAX_REGISTRATIONS = 1 << 16  # registration records (cheap, but a flood must not grow them forever)
_CONFIGS_MAX = 64  # cached scoring configs: block_size comes from the network

AffinityFactory = Callable[[KvAffinityConfig, Union[int, None]], KvAffinity]
Hits = dict[str, dict[int, TierCounts]]


@dataclasses.dataclass
class _Index:
    affinity: KvAffinity
    users: dict[str, set[tuple[str, str, str, int]]]  # stream URL -> registration keys
    costs: dict[str, int] = dataclasses.field(default_factory=dict)  # stream URL -> subscriptions it runs


_VIEWS_MAX = 256  # distinct (model, tenant, block_size) asked for; bounded against odd block sizes


def _index_key(reg: Registration) -> tuple[str, str, int]:
    return (reg.model, reg.tenant, reg.block_size)


def _cost(reg: Registration) -> int:
    """Subscriptions a registration's stream runs: one, one per rank in compat mode, none for
    a registration whose blocks come by ``POST /events``."""
    return 0 if reg.stream is None else reg.compat_dp_size or 1


def _run(stops: Sequence[tuple[KvAffinity, str]], starts: Sequence[tuple[KvAffinity, Registration]]) -> None:
    """Stops, then starts, subscriptions (joins and spawns threads: never under ``_lock``)."""
    for affinity, url in stops:
        affinity.remove_instance(url)
    for affinity, reg in starts:
        if reg.stream is None:  # HTTP-only: its index name is followed with no subscriber
            assert reg.index_name is not None
            affinity.add_pushed(reg.index_name)
            continue
        affinity.add_instance(reg.stream, reg.stream, reg.replay_endpoint, compat_dp_size=reg.compat_dp_size)


def _source(reg: Registration) -> tuple[Any, ...]:
    """What a subscription depends on: equal sources share one subscriber and its index."""
    return (reg.model, reg.tenant, reg.block_size, reg.index_name, reg.replay_endpoint, reg.compat_dp_size)


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
        self.tokenizers = Tokenizers(config.tokenizers, config.tokenizer_path, config.trust_remote_code)
        self._configs: dict[int, KvAffinityConfig] = {}
        self._views: dict[tuple[str, str, int], query_path.View] = {}  # cleared on every registration change
        self.metrics = AdapterMetrics()

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
        name = reg.index_name
        if name is None:
            return []
        entry.users.setdefault(name, set()).add(reg.key)
        entry.costs[name] = _cost(reg)
        # Idempotent for the same source; a different mode or replay URL replaces the subscription.
        return [(entry.affinity, reg)]

    def _unbook(self, reg: Registration) -> list[tuple[KvAffinity, str]]:
        """Forgets ``reg`` as a user of its stream (under ``_lock``); returns the subscription to
        stop when it was the last registration naming that URL."""
        entry = self._indexes.get(_index_key(reg))
        name = reg.index_name
        if entry is None or name is None:
            return []
        users = entry.users.get(name)
        if users is None:
            return []
        users.discard(reg.key)
        if users:
            return []
        del entry.users[name]
        entry.costs.pop(name, None)
        return [(entry.affinity, name)]

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
            name = reg.index_name
            users = entry.users.get(name, set()) if entry is not None and name is not None else set()
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

    def _view(self, model: str, tenant: str, block_size: int) -> query_path.View:
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
            affinity = entry.affinity if entry else None
            view = query_path.make_view(
                tenant, regs, affinity, self.scoring_config(block_size), self.config.query_shape
            )
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
        spread = spread_key(token_ids, block_size)
        blocks = len(token_ids) // block_size
        return self.answer_keys(model, tenant, block_size, keys, blocks, started, len(token_ids), spread).body

    def query_by_hash(self, model: str, tenant: str, block_size: int, local_hashes: Sequence[int]) -> dict[str, Any]:
        started = time.perf_counter()
        keys = chain_hashes(local_hashes)
        spread = spread_key_of_local(local_hashes[-1]) if local_hashes else 0
        return self.answer_keys(model, tenant, block_size, keys, len(keys), started, None, spread).body

    def answer_keys(
        self,
        model: str,
        tenant: str,
        block_size: int,
        keys: list[int],
        blocks: int,
        started: float,
        isl: int | None = None,
        spread: int = 0,
    ) -> Answer:
        """``/query``'s answer (:func:`motor_adapter.query.answer`) for a prompt's chained block
        keys: ``blocks`` full blocks asked, ``isl`` the prompt's length (default ``blocks *
        block_size``), ``spread`` its tie-break key (``rank_cost.spread_key``). Never mutate it."""
        view = self._views.get((model, tenant, block_size)) or self._view(model, tenant, block_size)
        size = isl if isl is not None else blocks * block_size
        return query_path.answer(view, self.metrics, model, keys, blocks, started, size, spread)

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
                    as_dict(h) for h in health.get((reg.model, reg.tenant, reg.block_size, reg.stream), [])
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

    def rank_loads(self) -> list[tuple[str, InstanceLoads]]:
        """Every followed instance stream's last rank loads, named by the instances registered on it."""
        regs = self.registrations()
        with self._lock:
            entries = list(self._indexes.items())
        out = []
        for (model, tenant, block_size), entry in entries:
            for stream, figures in entry.affinity.loads.items():
                names = sorted(
                    {
                        r.instance_id
                        for r in regs
                        if (r.model, r.tenant, r.block_size, r.stream) == (model, tenant, block_size, stream)
                    }
                )
                out.append((",".join(names) or stream, figures))
        return out

    def render_metrics(self) -> str:
        return self.metrics.render(self.stream_health(), self.registrations(), self.rank_loads())
