"""The adapter's state: registrations, one prefix index per (model, tenant, block_size), queries.

One :class:`~motor_adapter.affinity.KvAffinity` (one prefix index) per ``(model, tenant,
block_size)``; one subscription per distinct stream URL in it, shared by every registration
naming that URL. ``/query`` lists every registered dp of the model, zeros included (conductor
semantics), with a fanned-in instance's engine ranks folded into its registered dp and
``engine_dp_rank`` naming the rank that holds the prefix.

Over 450 lines on purpose: :class:`AdapterState` is one lock (``_lock``) over registrations,
subscriptions and the cached query views; the invariants between them (a view is rebuilt
when a registration changes, a subscription lives while a registration uses its stream) are
easier to keep when every method that takes the lock is in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union

import msgspec

from motor_adapter import rank_render
from motor_adapter.adapter_metrics import AdapterMetrics, HitTally
from motor_adapter.affinity import KvAffinity
from motor_adapter.http_contract import RequestError, as_dict, token_ids_of
from motor_adapter.rank_loads import InstanceLoads, RankLoadBook
from motor_adapter.registration import (
    Registration,
    Unregistration,
)
from motor_adapter.scoring import (
    Candidate,
    KvAffinityConfig,
    RankScored,
    TierCounts,
    best_rank,
    dp_entry,
    fold_engine_dps,
    instance_entry,
    matched_tokens,
    motor_values,
    pick_instance,
    prefill_cost,
    select,
)
from motor_adapter.settings import ServiceConfig
from sglang_kvpub.core.hashing import chain_hashes, sequence_keys
from sglang_kvpub.core.rank_cost import CostParams, score_ranks, spread_key, spread_key_of_local, spread_start

__all__ = ["JSON_TYPE", "AdapterState", "AffinityFactory", "Answer", "Hits"]

log = logging.getLogger(__name__)

_MAX_REGISTRATIONS = 1 << 16  # registration records (cheap, but a flood must not grow them forever)
_CONFIGS_MAX = 64  # cached scoring configs: block_size comes from the network

AffinityFactory = Callable[[KvAffinityConfig, Union[int, None]], KvAffinity]
JSON_TYPE = "application/json"  # Answer.encoded's key for the JSON encoding
_JSON_DECODER = msgspec.json.Decoder()
Hits = dict[str, dict[int, TierCounts]]


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
    # Rendered instance entries by (instance, what its streams' best ranks hold): a handful
    # of hits recur across queries, and building an entry cost more than walking the index.
    answers: dict[tuple[Any, ...], _Rendered] = dataclasses.field(default_factory=dict)
    # Whole answers by the index's remembered result they render (by identity: the index
    # hands out the same dict for the same walk ends; the entry keeps it alive).
    by_best: dict[int, _Answered] = dataclasses.field(default_factory=dict)
    # The rank-aware path (AdapterState._answer_by_rank): its instances, whole answers by
    # (walk result, isl, spread, loads tokens), per-rank hits by walk result, each instance's
    # score and entry by what it is a function of.  Each entry keeps its identity-keyed inputs.
    rank_plans: tuple[_Plan, ...] = ()
    rank_streams: tuple[str, ...] = ()  # their streams
    loads_seen: list[Any] = dataclasses.field(default_factory=list)  # [book changes, valid until, _Loads]
    by_rank: dict[tuple[Any, ...], _RankAnswered] = dataclasses.field(default_factory=dict)
    rank_seen: set[int] = dataclasses.field(default_factory=set)  # hashes of by_rank keys seen once
    rank_hits: dict[int, tuple[Mapping[str, Any], Mapping[str, Mapping[int, TierCounts]]]] = dataclasses.field(
        default_factory=dict
    )
    rank_shapes: dict[tuple[Any, ...], _HitsShape] = dataclasses.field(default_factory=dict)
    rank_scores: dict[tuple[Any, ...], _InstanceScores] = dataclasses.field(default_factory=dict)
    rank_entries: dict[tuple[Any, ...], tuple[RankScored, dict[str, Any], HitTally]] = dataclasses.field(
        default_factory=dict
    )
    # The C renderer's inputs (motor_adapter.rank_render): the view's, None when it does not
    # render this view; and per walk result, by its identity.
    rank_static: Union[rank_render.RankStatic, None] = None
    rank_params: Union[CostParams, None] = None  # the rank cost's constants at this block size
    rank_tables: dict[int, rank_render.RankTable] = dataclasses.field(default_factory=dict)
    # The last rendered answer: (walk result, isl, spread, book changes, rendered, table, its
    # Answer once made - the one object a repeat of it is given, its encodings included -, its
    # side effects bound: rank_render.effects).
    rank_last: list[Any] = dataclasses.field(default_factory=lambda: [None] * 8)


_Observed = tuple[str, str, int, TierCounts]  # (instance, dp key, engine rank, hit): the metrics' view of a hit
_Rendered = tuple[dict[str, Any], tuple[_Observed, ...], tuple[Any, ...]]  # entry, its hits, what they came from
_ANSWERS_MAX = 4096  # rendered entries per view: hit depths x ranks x instances seen; then start over


class Answer:
    """A ``/query`` answer (``body``) and its encodings by format (``encoded``, filled by
    the HTTP layer): remembered answers share both, so a repeat encodes nothing.  An answer
    rendered in C (:mod:`motor_adapter.rank_render`) comes as its JSON encoding; its body is
    decoded from it when first asked for (a msgpack client, ``/explain``, tests).  Never
    mutate either."""

    __slots__ = ("_body", "encoded")

    def __init__(self, body: Union[dict[str, Any], None], encoded: dict[str, bytes]) -> None:
        if body is None and JSON_TYPE not in encoded:
            raise ValueError("an Answer needs its body or its JSON encoding")
        self._body = body
        self.encoded = encoded

    @property
    def body(self) -> dict[str, Any]:
        if self._body is None:
            self._body = _JSON_DECODER.decode(self.encoded[JSON_TYPE])
        return self._body


_Answered = tuple[Mapping[str, Any], Answer, HitTally]  # the index's result it renders, the answer, its tally


@dataclasses.dataclass(frozen=True)
class _RankAnswered:
    """A rank-aware answer with what a repeat of it replays: the metrics (its hits' tally, the
    scored tokens' counter cells) and the commit ``(stream, rank, tokens)`` it makes."""

    answer: Answer
    tally: HitTally
    scored: tuple[tuple[list[float], int], ...]
    commit: Union[tuple[str, int, float], None]
    best: Union[Mapping[str, Any], None] = None  # the walk result it renders (kept alive: keyed by its id)


# Small on purpose: prompts that differ (a new spread key, a commit per answer) fill the memos
# with entries never asked for again, and thousands of kept answers (nested dicts) made every
# full garbage collection walk them - 187 us per answer in-process with 4096, against ~50.
_RANK_MEMO_MAX = 256
_NO_RANKS: Mapping[int, TierCounts] = {}  # an instance with no hit: one object (memo keys use identities)


_VIEWS_MAX = 256  # distinct (model, tenant, block_size) asked for; bounded against odd block sizes


def _plans(regs: Sequence[Registration], block_size: int) -> tuple[_Plan, ...]:
    groups: dict[str, list[Registration]] = {}
    for reg in regs:  # registration order: the response lists instances in it
        groups.setdefault(reg.instance_id, []).append(reg)
    plans = []
    for instance, members in groups.items():
        dps = sorted(r.dp_rank for r in members)
        usable = tuple(
            (r.dp_rank, r.index_name) for r in members if r.block_size == block_size and r.index_name is not None
        )
        plans.append(_Plan(instance, dps, tuple(str(dp) for dp in dps), usable, len(members) == 1))
    return tuple(plans)


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
        self._tokenizers: dict[str, Any] = {}
        self._configs: dict[int, KvAffinityConfig] = {}
        self._views: dict[tuple[str, str, int], _View] = {}  # cleared on every registration change
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
            plans = _plans(regs, block_size)
            rank_plans = tuple(plan for plan in plans if plan.single and plan.streams)
            rank_streams = tuple(plan.streams[0][1] for plan in rank_plans)
            static = rank_render.static_inputs(
                tenant,
                [plan.instance for plan in rank_plans],
                [plan.keys[0] for plan in rank_plans],
                rank_streams,
                len(rank_plans) == len(plans),
                self.config.query_shape,
            )
            params = _cost_params(self.scoring_config(block_size))
            view = _View(
                regs,
                entry.affinity if entry else None,
                plans,
                rank_plans=rank_plans,
                rank_streams=rank_streams,
                rank_static=static if rank_render.renders(params) else None,
                rank_params=params,
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

    def query_keys(
        self, model: str, tenant: str, block_size: int, keys: list[int], blocks: int, started: float | None = None
    ) -> dict[str, Any]:
        """``/query``'s answer for a prompt's chained block keys (``blocks`` full blocks asked)."""
        return self.answer_keys(model, tenant, block_size, keys, blocks, started or time.perf_counter()).body

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
        """``conductor_response(*instance_hits(..), fold=True, shape=..)`` fused for the hot path
        (same JSON), remembered per result of the index's one-pass walk: the same walk ends
        give the same answer object, its encodings included. Never mutate it.

        When an instance's stream sends rank loads (wire.LoadReport), the answer scores every
        instance by the rank that would serve the request instead (:meth:`_answer_by_rank`):
        ``isl`` is the prompt's length (default ``blocks * block_size``), ``spread`` its
        tie-break key (``rank_cost.spread_key``, the dispatcher computes the same)."""
        view = self._views.get((model, tenant, block_size)) or self._view(model, tenant, block_size)
        affinity = view.affinity
        if view.rank_static is not None and affinity is not None and affinity.loads.figured:
            best_walk = affinity.best_for_keys(keys)  # None: CPU/disk hold blocks (the reference answers)
            if best_walk is not None:
                size = isl if isl is not None else blocks * block_size
                prompt = keys[-1] if keys else spread  # the commit's key: once per prompt between two reports
                book = affinity.loads
                changes = book.changes  # read first: a change while rendering is seen next time
                now = time.monotonic()
                last = view.rank_last
                if last[0] is best_walk and last[1] == size and last[2] == spread and last[3] == changes:
                    again: rank_render.Rendered = last[4]
                    if now < again[2]:  # the last answer holds: given again, its side effects made again
                        last[7](prompt)
                        self.metrics.observe_query(model, again[1], blocks, started)
                        answer: Answer = last[6]  # one object for every repeat, its encodings included
                        if answer is None:
                            answer = last[6] = Answer(None, {JSON_TYPE: again[0]})
                        return answer
                got = self._rank_answer_native(view, block_size, keys, best_walk, size, spread, prompt, changes, now)
                if got:  # its commit and metrics made; False: no fresh loads; None: the reference renders it
                    self.metrics.observe_query(model, got[1], blocks, started)
                    return Answer(None, {JSON_TYPE: got[0]})
        loads = _loads_tokens(view)
        if loads is not None:
            size = isl if isl is not None else blocks * block_size
            return self._answer_by_rank(view, model, tenant, block_size, keys, blocks, started, size, spread, loads)
        best, remembered = self._best_ranks(view, keys, block_size)
        done = view.by_best.get(id(best)) if remembered else None
        if done is None or done[0] is not best:
            cfg, shape = self.scoring_config(block_size), self.config.query_shape
            out, observed = _conductor_answer(view.plans, best, block_size, cfg, shape, view.answers)
            done = (best, Answer({tenant: out}, {}), self.metrics.tally(observed))
            if remembered:
                if len(view.by_best) >= _ANSWERS_MAX:
                    view.by_best.clear()
                view.by_best[id(best)] = done
        self.metrics.observe_tally(model, done[2], blocks, started)
        return done[1]

    def _answer_by_rank(
        self,
        view: _View,
        model: str,
        tenant: str,
        block_size: int,
        keys: list[int],
        blocks: int,
        started: float,
        isl: int,
        spread: int,
        loads: _Loads,
    ) -> Answer:
        """Every instance scored by the rank that would serve the request - that rank's hit and
        load, ``rank_cost.score_ranks``, the dispatcher's own function - and answered in the
        values Motor's unchanged cost reads (:func:`scoring.motor_values`): ``DP`` for the
        Ascend source's cost, ``GPU`` for 3.0.0b2's largest-GPU rule.  ``dp_detail`` names the
        rank (``scored_rank``; ``engine_dp_rank`` and the tiers: its real hit, None without one;
        ``rank_load``, ``rank_cost``).

        Remembered while only NPU holds blocks, keyed by what the answer is a function of: the
        index's remembered walk result (by identity: one object per walk ends, a new one when a
        holding or a worker changes), ``isl``, ``spread`` and each instance's loads token
        (``loads``, :meth:`RankLoadBook.token`: a new report or a commit changes it).  Each
        instance's score is remembered alike (its hits, its token, ``isl``, the scan's start),
        so a query that changes one instance's loads scores only that one again.  The answer's
        commit (the prompt's uncached tokens to the rank it names) runs on every query."""
        affinity = view.affinity
        assert affinity is not None
        best = affinity.best_for_keys(keys)  # the walk's remembered result, or None (CPU/disk hold blocks)
        ranked: Union[_RankAnswered, None]
        if best is None:
            all_hits = affinity.hits_for_keys(keys)
            ranked = self._rank_answer(view, tenant, block_size, all_hits, loads, isl, spread, None)
        else:
            key = (id(best), isl, spread, loads.tokens)
            ranked = view.by_rank.get(key)
            if ranked is None or ranked.best is not best:
                found = view.rank_hits.get(id(best))
                if found is None or found[0] is not best:
                    # The per-rank hits of these walk ends: one walk more (counted by the index)
                    # when the walk ends first appear, none after.
                    found = (best, affinity.hits_for_keys(keys))
                    _remember(view.rank_hits, id(best), found)
                ranked = self._rank_answer(view, tenant, block_size, found[1], loads, isl, spread, best)
                # Kept from its second sight on (a doorkeeper of key hashes, as the prompt
                # cache's): answers that never recur - a new prompt, loads its own commit just
                # moved - would only churn the memo and the garbage collector.
                digest = hash(key)
                if digest in view.rank_seen:
                    _remember(view.by_rank, key, ranked)
                else:
                    if len(view.rank_seen) >= _ANSWERS_MAX:
                        view.rank_seen.clear()
                    view.rank_seen.add(digest)
        if ranked.commit is not None:
            # The answer makes Motor pick this instance and its dispatcher this rank: count the
            # prompt's uncached part there until the instance's next report.
            stream, rank, tokens = ranked.commit
            affinity.loads.commit(stream, rank, tokens, keys[-1] if keys else spread)
        self.metrics.observe_cells(ranked.scored)
        self.metrics.observe_tally(model, ranked.tally, blocks, started)
        return ranked.answer

    def _rank_answer_native(
        self,
        view: _View,
        block_size: int,
        keys: list[int],
        best: Mapping[str, Any],
        isl: int,
        spread: int,
        prompt: int,
        changes: int,
        now: float,
    ) -> Union[rank_render.Rendered, Literal[False], None]:
        """The rank-aware answer of walk result ``best`` rendered in C (``rank_render.render``:
        False without fresh loads, None when it declines, and the reference answers), its
        commit (keyed by ``prompt``) and metrics made, under the book's ``changes`` read
        before (and at monotonic ``now``).

        The last one is kept (``view.rank_last``): asked again for the same walk result,
        ``isl`` and ``spread`` while the book has not changed (its ``changes``: every report,
        effective commit and forget) and no instance has gone stale, :meth:`answer_keys`
        gives it again without rendering, its commit and metrics made again by the effects
        bound at its render (``rank_render.effects``) - a prompt asked again and
        again (a retry, several routers, a poll) costs no render, and a stream of new prompts
        costs one slot, not a memo to fill and clear."""
        static, affinity = view.rank_static, view.affinity
        assert static is not None and affinity is not None
        book = affinity.loads
        table = view.rank_tables.get(id(best))
        if table is None or table.best is not best:
            # The per-rank hits of these walk ends: one walk more when they first appear.
            params = view.rank_params
            assert params is not None
            all_hits = affinity.hits_for_keys(keys)
            table = rank_render.RankTable(
                static, params, best, all_hits, block_size, self._rank_cells(view, block_size)
            )
            _remember(view.rank_tables, id(best), table)
        rendered = rank_render.render(static, table, book, now, isl, spread)
        if rendered:
            metrics = self.metrics
            made = rank_render.effects(
                static, table, book, rendered[3], metrics.instance_hits.repeat, metrics.scored_tokens.repeat
            )
            made(prompt)
            view.rank_last[:] = (best, isl, spread, changes, rendered, table, None, made)
        return rendered

    def _rank_cells(
        self, view: _View, block_size: int
    ) -> Callable[[rank_render.RankTable, int, int], rank_render.Cells]:
        """The metrics cells of instance ``i``'s rank ``rank`` in a table, as the reference
        resolves them for an answer naming that rank: its hit's tiers, and the scored-tokens
        cell when the hit can score tokens (no series appears before it counts)."""
        cfg = self.scoring_config(block_size)

        def resolve(table: rank_render.RankTable, i: int, rank: int) -> rank_render.Cells:
            plan = view.rank_plans[i]
            hit = table.all_hits[plan.streams[0][1]][rank]
            adds = self.metrics.tally([(plan.instance, plan.keys[0], rank, hit)]).adds
            scores = matched_tokens(hit, cfg, 1 << 62) > 0
            return adds, self.metrics.scored_cell(plan.instance, rank) if scores else None

        return resolve

    def _rank_answer(
        self,
        view: _View,
        tenant: str,
        block_size: int,
        all_hits: Mapping[str, Mapping[int, TierCounts]],
        loads: _Loads,
        isl: int,
        spread: int,
        best_walk: Union[Mapping[str, Any], None],
    ) -> _RankAnswered:
        """:meth:`_answer_by_rank`'s answer, computed; with ``best_walk`` (the walk result it
        renders), each instance's score and entry come from the view's memos when their inputs
        were seen (``all_hits``' dicts are then the remembered ones, stable by identity)."""
        remember = best_walk is not None
        assert view.affinity is not None
        cfg, shape = self.scoring_config(block_size), self.config.query_shape
        params = _cost_params(cfg)
        book = view.affinity.loads
        plans = view.rank_plans
        scored: list[RankScored] = []
        longest: list[int] = []
        for plan, token in zip(plans, loads.tokens, strict=True):
            stream = plan.streams[0][1]
            ranks = all_hits.get(stream, _NO_RANKS)
            score_key = (stream, id(ranks), token, isl)
            scores = view.rank_scores.get(score_key) if remember else None
            if scores is None or scores.ranks is not ranks:
                figures = book.get(stream, loads.now) if token is not None else None
                size = figures.dp_size if figures is not None else 0
                shape_key = (stream, id(ranks), size)
                hits_shape = view.rank_shapes.get(shape_key) if remember else None
                if hits_shape is None or hits_shape.ranks is not ranks:
                    hits_shape = _HitsShape(ranks, size, block_size)
                    if remember:
                        _remember(view.rank_shapes, shape_key, hits_shape)
                scores = _InstanceScores(hits_shape, figures, book, stream, isl, cfg, params)
                if remember:
                    _remember(view.rank_scores, score_key, scores)
            scored.append(scores.at(spread))
            longest.append(scores.longest)
        out: dict[str, dict[str, Any]] = {}
        tallies: list[HitTally] = []
        counted: list[tuple[str, int, int]] = []
        commit: Union[tuple[str, int, float], None] = None
        if scored:
            best = pick_instance(scored, spread)
            dp_values, gpu_values = motor_values(scored, best, cfg, isl)
            top = scored[best]
            if top.rank is not None and loads.tokens[best] is not None:
                commit = (plans[best].streams[0][1], top.rank, isl - top.matched)
            for i, (plan, s) in enumerate(zip(plans, scored, strict=True)):
                entry_key = (plan.instance, id(s), longest[i])
                rendered = view.rank_entries.get(entry_key) if remember else None
                if rendered is None or rendered[0] is not s:
                    own = (
                        [(plan.instance, plan.keys[0], s.rank, s.hit)]
                        if s.hit is not None and s.rank is not None
                        else []
                    )
                    entry = _rank_entry(plan, s, longest[i], block_size, cfg, shape)
                    rendered = (s, entry, self.metrics.tally(own))
                    if remember:
                        _remember(view.rank_entries, entry_key, rendered)
                # What depends on the other instances too (Motor's values), set per answer on a
                # shallow copy: the remembered entry and its nested dicts are shared, never mutated.
                entry = dict(rendered[1])
                entry["GPU"] = gpu_values[i]
                if shape == "tokens":
                    entry["DP"] = {plan.keys[0]: dp_values[i]}
                out[plan.instance] = entry
                tallies.append(rendered[2])
                if s.rank is not None and s.matched > 0:
                    counted.append((plan.instance, s.rank, s.matched))
        observed: list[_Observed] = []
        for plan in view.plans:  # several endpoints per instance: each dp its own stream's best rank
            if plan.instance in out:
                continue
            per_stream: list[Union[tuple[int, TierCounts], None]] = []
            for _, stream in plan.streams:
                best_of = best_rank(all_hits.get(stream, {}), cfg)
                per_stream.append((best_of[0], best_of[1]) if best_of else None)
            entry_out, hits = _instance_answer(plan, tuple(per_stream), block_size, cfg, shape)
            out[plan.instance] = entry_out
            observed.extend(hits)
        if observed:
            tallies.append(self.metrics.tally(observed))
        # Counting is additive: the answer's tally is its instances' (each resolved once).
        tally = HitTally(tuple(add for t in tallies for add in t.adds), max((t.best for t in tallies), default=0))
        scored_cells = self.metrics.scored_cells(counted)
        return _RankAnswered(Answer({tenant: out}, {}), tally, scored_cells, commit, best_walk)

    def _best_ranks(
        self, view: _View, keys: list[int], block_size: int
    ) -> tuple[Mapping[str, tuple[int, TierCounts]], bool]:
        """Per stream holding block 0: ``(engine rank, hit)`` of its best rank (``best_rank``),
        and whether that mapping is the index's remembered one (handed out again for the
        same walk: see ``PrefixIndex.deepest_npu``) rather than built for this query."""
        if view.affinity is None:
            return {}, False
        best = view.affinity.best_for_keys(keys)  # one pass while only NPU holds blocks
        if best is not None:
            return best, True
        cfg = self.scoring_config(block_size)
        out: dict[str, tuple[int, TierCounts]] = {}
        for stream, ranks in view.affinity.hits_for_keys(keys).items():
            found = best_rank(ranks, cfg)
            if found is not None:
                out[stream] = (found[0], found[1])
        return out, False

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


class _Loads(NamedTuple):
    """Each single-endpoint instance's loads token (``RankLoadBook.token``, in
    ``view.rank_plans`` order) read at ``now`` (monotonic)."""

    tokens: tuple[Union[tuple[int, int], None], ...]
    now: float


def _loads_tokens(view: _View) -> Union[_Loads, None]:
    """The view's :class:`_Loads` when any instance has fresh rank loads, else None (answer by
    the longest hit)."""
    affinity = view.affinity
    if affinity is None or not affinity.loads.figured:
        return None
    book, now = affinity.loads, time.monotonic()
    seen = view.loads_seen
    changes = book.changes  # read first: a change while the tokens are read is seen next time
    if seen and seen[0] == changes and now < seen[1]:
        loads: Union[_Loads, None] = seen[2]
        return loads
    tokens, until = book.tokens(view.rank_streams, now)
    loads = _Loads(tokens, now) if any(token is not None for token in tokens) else None
    view.loads_seen[:] = [changes, until, loads]
    return loads


def _remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """``memo[key] = value``, the memo started over past :data:`_RANK_MEMO_MAX` entries."""
    if len(memo) >= _RANK_MEMO_MAX:
        memo.clear()
    memo[key] = value


class _HitsShape:
    """What an instance's scoring needs of its ranks' hits alone (no loads): its longest hit in
    tokens, each rank's tiers below ``size`` and the ranks to scan - once per hits, not per report."""

    __slots__ = ("longest", "order", "ranks", "tiers")

    def __init__(self, ranks: Mapping[int, TierCounts], size: int, block_size: int) -> None:
        self.ranks = ranks
        self.longest = max((h.total_blocks for h in ranks.values()), default=0) * block_size
        self.tiers = {r: (h.npu_blocks, h.cpu_blocks, h.disk_blocks) for r, h in ranks.items() if r < size}
        self.order = list(range(size))


class _InstanceScores:
    """One instance's scores for one prompt length under one loads state, by the scan's start
    (``rank_cost.spread_start``: ties only).  Without load figures the instance is scored by
    its longest hit, as before loads existed.  ``longest``: its longest hit in tokens."""

    __slots__ = (
        "by_choice",
        "by_start",
        "isl",
        "load_sum",
        "longest",
        "no_loads",
        "now",
        "order",
        "params",
        "ranks",
        "tiers",
    )

    def __init__(
        self,
        shape: _HitsShape,
        figures: Union[InstanceLoads, None],
        book: RankLoadBook,
        stream: str,
        isl: int,
        cfg: KvAffinityConfig,
        params: CostParams,
    ) -> None:
        ranks = self.ranks = shape.ranks
        self.isl = isl
        self.params = params
        self.longest = shape.longest
        self.by_start: dict[int, RankScored] = {}
        self.by_choice: dict[int, RankScored] = {}  # one object per rank chosen: entries are remembered by it
        size = figures.dp_size if figures is not None else 0
        self.no_loads: Union[RankScored, None] = None
        if figures is None or size == 0:  # no load figures: the longest hit, as before
            found = best_rank(ranks, cfg)
            hit = found[1] if found else None
            matched = matched_tokens(hit, cfg, isl)
            cost = cfg.prefill_load_scale * prefill_cost(matched, cfg, isl)
            self.no_loads = RankScored(found[0] if found else None, hit, matched, cost)
            return
        self.now = book.current(figures, stream)
        self.load_sum = sum(self.now)
        self.tiers = shape.tiers  # shared, never mutated (score_ranks reads them)
        self.order = shape.order

    def at(self, spread: int) -> RankScored:
        """The instance's :class:`RankScored` for a prompt of tie-break key ``spread``."""
        if self.no_loads is not None:
            return self.no_loads
        start = spread_start(spread, len(self.order))
        found = self.by_start.get(start)
        if found is None:
            chosen = score_ranks(self.tiers, self.now, self.order, start, self.isl, self.params)
            found = self.by_choice.get(chosen.rank)
            if found is None:  # the same rank chosen from another start: the same figures
                hit = self.ranks.get(chosen.rank)
                found = RankScored(chosen.rank, hit, chosen.matched, chosen.cost, self.load_sum, chosen.load)
                self.by_choice[chosen.rank] = found
            self.by_start[start] = found
        return found


def _rank_entry(
    plan: _Plan, s: RankScored, longest: int, block_size: int, cfg: KvAffinityConfig, shape: str
) -> dict[str, Any]:
    """One instance's entry of a rank-aware answer but Motor's values (``GPU``, and ``DP`` in
    the "tokens" shape), which depend on the other instances (shared: never mutated)."""
    key = plan.keys[0]
    # engine_dp_rank names the rank the figures belong to (None: no hit, as before);
    # scored_rank the rank that would serve the request, hit or not.
    entry = dp_entry(s.hit, s.rank if s.matched > 0 else None, block_size)
    entry["scored_rank"] = s.rank
    entry["rank_cost"] = round(s.cost, 1)
    entry["rank_load"] = round(s.load, 1)
    answer = instance_entry({key: entry}, cfg, block_size, shape)
    answer["longest_matched"] = longest
    return answer


_PARAMS: dict[KvAffinityConfig, CostParams] = {}


def _cost_params(cfg: KvAffinityConfig) -> CostParams:
    """The shared rank cost's constants under the configured weights and hot-spot guard."""
    params = _PARAMS.get(cfg)
    if params is None:
        if len(_PARAMS) >= 64:
            _PARAMS.clear()
        params = _PARAMS[cfg] = CostParams(
            cfg.block_size,
            cfg.w_npu,
            cfg.w_cpu,
            cfg.w_disk,
            cfg.prefill_load_scale,
            cfg.overlap_credit,
            cfg.load_weight,
            cfg.hotspot_spread,
            cfg.hotspot_relative,
        )
    return params


def _conductor_answer(
    plans: Sequence[_Plan],
    best: Mapping[str, tuple[int, TierCounts]],
    block_size: int,
    cfg: KvAffinityConfig,
    shape: str,
    rendered: dict[tuple[Any, ...], _Rendered],
) -> tuple[dict[str, dict[str, Any]], list[_Observed]]:
    """``/query``'s per-instance entries (:func:`scoring.instance_entry` in ``shape``) from each
    stream's best rank, and the hits listed (instance, dp key, engine rank, hit) for the metrics.
    Every registered dp is listed.  Entries come from ``rendered`` (the view's memo, valid for
    its one ``block_size``, ``cfg`` and ``shape``) when the same hits were rendered before: the
    answer's entries are shared between answers and never mutated."""
    out: dict[str, dict[str, Any]] = {}
    observed: list[_Observed] = []
    for plan in plans:
        found = tuple(best.get(stream) for _, stream in plan.streams)
        # A hit by identity: the index interns its hits, and the memo keeps `found` alive.
        key = (plan.instance, *[None if f is None else (f[0], id(f[1])) for f in found])
        done = rendered.get(key)
        if done is None:
            if len(rendered) >= _ANSWERS_MAX:
                rendered.clear()
            entry, hits = _instance_answer(plan, found, block_size, cfg, shape)
            done = rendered[key] = (entry, hits, found)
        out[plan.instance] = done[0]
        observed.extend(done[1])
    return out, observed


def _instance_answer(
    plan: _Plan,
    found: tuple[Union[tuple[int, TierCounts], None], ...],
    block_size: int,
    cfg: KvAffinityConfig,
    shape: str,
) -> tuple[dict[str, Any], tuple[_Observed, ...]]:
    """One instance's entry from its streams' best ranks (``found``, in ``plan.streams`` order)."""
    observed: list[_Observed] = []
    if plan.single:  # one endpoint: its engine ranks fold into the registered dp
        best = found[0] if found else None
        if best is None:
            entry = dp_entry(None, None, block_size)
        else:
            entry = dp_entry(best[1], best[0], block_size)
            observed.append((plan.instance, plan.keys[0], best[0], best[1]))
        return instance_entry({plan.keys[0]: entry}, cfg, block_size, shape), tuple(observed)
    per_dp: dict[int, TierCounts] = {}
    for (dp, _), best in zip(plan.streams, found, strict=True):  # several endpoints: each dp its own stream's best rank
        if best is not None:
            per_dp[dp] = best[1]
    entries: dict[str, dict[str, Any]] = {}
    for dp, dp_key in zip(plan.dps, plan.keys, strict=True):
        hit = per_dp.get(dp)
        if hit is None:
            entries[dp_key] = dp_entry(None, dp, block_size)
            continue
        entries[dp_key] = dp_entry(hit, dp, block_size)
        observed.append((plan.instance, dp_key, dp, hit))
    return instance_entry(entries, cfg, block_size, shape), tuple(observed)
