"""The adapter's Prometheus series (``GET /metrics``): requests, queries, hits per instance and tier, streams."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from motor_adapter import metrics
from motor_adapter.rank_loads import InstanceLoads
from motor_adapter.rank_render import AnswerTally
from motor_adapter.registration import Registration
from motor_adapter.scoring import TierCounts
from sglang_kvpub.core.tiers import TIERS

__all__ = ["AdapterMetrics", "HitTally", "LABELS_MAX", "RANK_METRICS"]

# The routing-quality series per instance and rank (docs/operations.md, docs/grafana-routing.json).
RANK_METRICS = (
    "motor_kv_adapter_scored_hit_tokens_total",
    "motor_kv_adapter_rank_cached_tokens_total",
    "motor_kv_adapter_rank_prefill_tokens_total",
    "motor_kv_adapter_rank_load_tokens",
    "motor_kv_adapter_rank_requests",
    "motor_kv_adapter_instance_rank_load_skew",
    "motor_kv_adapter_dispatch_decisions_total",
    "motor_kv_adapter_rank_loads_age_seconds",
)

log = logging.getLogger(__name__)

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


_TIERS = tuple((tier, f"{tier}_blocks") for tier in TIERS)
LABELS_MAX = 4096
_MISSED_SERIES_MAX = 256  # model names come from the network: a bounded set of series, then "<other>"
_MISSED_LOG_INTERVAL_S = 60.0


class HitTally(NamedTuple):
    """One query's hit counts on resolved series: ``(cell, blocks)`` per tier hit
    (:meth:`metrics.Counter.cell`), and the best hit's blocks (what ``query_hit_blocks``
    adds, capped at the blocks asked)."""

    adds: tuple[tuple[Any, int], ...]
    best: int


class _ModelCells:
    """A model's series on the query hot path, and its queried and hit blocks not yet added
    to them: summed here and added when the counters are read (a lock per add in the library)."""

    __slots__ = ("blocks", "hit", "hits", "latency", "queried")

    def __init__(self, latency: metrics.HistogramSeries, queried: Any, hit: Any) -> None:
        self.latency = latency
        self.queried = queried  # query_blocks' series
        self.hit = hit  # hit_blocks' series
        self.blocks = 0
        self.hits = 0


def _hit_labels(instance: str, dp: str, rank: int, tier: int) -> metrics.Labels:
    """``instance_hits``' label set, sorted by name as ``Counter.inc`` sorts them."""
    return (("dp", dp), ("engine_dp_rank", str(rank)), ("instance", instance), ("tier", _TIERS[tier][0]))


class AdapterMetrics:
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
        self.scored_tokens = reg.counter(
            "motor_kv_adapter_scored_hit_tokens_total",
            "Prompt tokens /query scored as a hit on the rank that would serve the request, per instance and rank",
        )
        self.http_events = reg.counter(
            "motor_kv_adapter_http_events_total",
            "KV events received by POST /events, by result (applied, ignored, unregistered)",
        )
        self._scored_cells: dict[tuple[str, int], Any] = {}
        self._missed: dict[tuple[str, str], list[float]] = {}  # (model, tenant) -> [next log time, count since]
        # Resolved series of the query hot path, per model and per (instance, dp key, engine rank).
        self._model_cells: dict[str, _ModelCells] = {}
        self.query_blocks.fold_before_read(self._fold_query_blocks)
        self.hit_blocks.fold_before_read(self._fold_query_blocks)
        # The rank-aware answers rendered in C count their hits and scored tokens here.
        self.answer_tally = AnswerTally()
        self.instance_hits.fold_before_read(self.answer_tally.fold)
        self.scored_tokens.fold_before_read(self.answer_tally.fold)
        self._repeat_hits = self.instance_hits.repeat
        self._repeat_scored = self.scored_tokens.repeat
        self._hit_cells: dict[tuple[str, str, int], list[Any]] = {}

    def observe_hits(
        self, model: str, hits: Sequence[tuple[str, str, int, TierCounts]], blocks: int, started: float, block_size: int
    ) -> None:
        """One query: its latency, its blocks, and per ``(instance, dp key, engine rank, hit)`` the hit tiers."""
        self.observe_tally(model, self.tally(hits), blocks, started)

    def tally(self, hits: Sequence[tuple[str, str, int, TierCounts]]) -> HitTally:
        """What counting ``hits`` adds, resolved to series (:meth:`metrics.Counter.cell`):
        a caller that sees the same hits again keeps the tally and counts it again with
        :meth:`observe_tally`, with no label set built or hashed."""
        best = 0
        adds: list[tuple[Any, int]] = []
        for instance, dp, rank, hit in hits:
            counts = (hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks)
            best = max(best, sum(counts))
            cells = self._hit_cells.get((instance, dp, rank))
            if cells is None:
                if len(self._hit_cells) >= LABELS_MAX:
                    self._hit_cells.clear()
                cells = self._hit_cells[(instance, dp, rank)] = [None, None, None]
            for tier, count in enumerate(counts):
                if count:
                    cell = cells[tier]
                    if cell is None:  # a tier's series appears with its first block, as before
                        cell = cells[tier] = self.instance_hits.cell(_hit_labels(instance, dp, rank, tier))
                    adds.append((cell, count))
        return HitTally(tuple(adds), best)

    def observe_scored(self, instance: str, rank: int, tokens: int) -> None:
        """One instance of one ``/query`` answer: ``tokens`` scored as a hit on engine rank ``rank``."""
        self.scored_cell(instance, rank).inc(tokens)

    def scored_cells(self, scored: Sequence[tuple[str, int, int]]) -> tuple[tuple[Any, int], ...]:
        """:meth:`observe_scored`'s cells for ``(instance, rank, tokens)`` each, resolved once:
        a caller that sees the same answer again adds them with :meth:`observe_cells`."""
        return tuple((self.scored_cell(instance, rank), tokens) for instance, rank, tokens in scored)

    def scored_cell(self, instance: str, rank: int) -> Any:
        """The series of ``scored_tokens`` for ``(instance, rank)`` (it appears with it)."""
        cell = self._scored_cells.get((instance, rank))
        if cell is None:
            if len(self._scored_cells) >= LABELS_MAX:
                self._scored_cells.clear()  # only a cache: the counter keeps its series
            labels = (("engine_dp_rank", str(rank)), ("instance", instance))
            cell = self._scored_cells[(instance, rank)] = self.scored_tokens.cell(labels)
        return cell

    def observe_cells(self, cells: tuple[tuple[Any, int], ...]) -> None:
        """``scored_tokens``' adds of an answer (:meth:`scored_cells`), counted once more."""
        if cells:
            self._repeat_scored(cells)

    def observe_tally(self, model: str, tally: HitTally, blocks: int, started: float) -> None:
        """One query of ``model``: its latency, its ``blocks`` and its hits (a :meth:`tally`)."""
        if tally.adds:
            self._repeat_hits(tally.adds)  # the same tally's cells are folded in once per read
        self.observe_query(model, tally.best, blocks, started)

    def observe_query(self, model: str, best: int, blocks: int, started: float) -> None:
        """One query of ``model``: its latency, its ``blocks`` and the largest hit's (``best``),
        its hits counted already."""
        per_model = self._model_cells.get(model)
        if per_model is None:
            if len(self._model_cells) >= LABELS_MAX:
                self._fold_query_blocks()
                self._model_cells.clear()  # only a cache: the counters keep their series
            labels: metrics.Labels = (("model", model),)
            per_model = self._model_cells[model] = _ModelCells(
                self.latency.series(labels), self.query_blocks.cell(labels), self.hit_blocks.cell(labels)
            )
        per_model.latency.observe(time.perf_counter() - started)
        per_model.blocks += blocks
        per_model.hits += best if best < blocks else blocks

    def _fold_query_blocks(self) -> None:
        """The queried and hit blocks summed since the last read, added to their series."""
        for per_model in self._model_cells.values():
            if per_model.blocks:
                per_model.queried.inc(per_model.blocks)
                per_model.blocks = 0
            if per_model.hits:
                per_model.hit.inc(per_model.hits)
                per_model.hits = 0

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

    def render(
        self,
        health: Mapping[tuple[str, str, int, str], list[Any]],
        regs: Sequence[Registration],
        loads: Sequence[tuple[str, InstanceLoads]] = (),
    ) -> str:
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
        extra += _removed_series(health)
        extra += _rank_series(loads)
        return self.registry.render(extra)


def _removed_series(health: Mapping[tuple[str, str, int, str], list[Any]]) -> list[metrics.Gauge]:
    """Blocks removed per instance, engine rank and reason, and batches of one rank missed
    (the stream's rank order), as the streams counted them."""
    removed = metrics.Gauge(
        "motor_kv_adapter_removed_blocks_total", "Blocks removed per instance, engine rank and BlockRemoved.reason"
    )
    gaps = metrics.Gauge(
        "motor_kv_adapter_stream_rank_gaps_total", "Batches of one engine rank missed live (the stream's rank order)"
    )
    removed.kind = gaps.kind = "counter"
    for key, healths in health.items():
        for h in healths:
            for (rank, reason), count in (getattr(h, "removed", None) or {}).items():
                removed.set(float(count), model=key[0], instance=h.instance_id, engine_dp_rank=rank, reason=reason)
            for rank, missed in (getattr(h, "rank_gaps", None) or {}).items():
                gaps.set(float(missed), model=key[0], instance=h.instance_id, engine_dp_rank=rank)
    return [removed, gaps]


def _rank_series(loads: Sequence[tuple[str, InstanceLoads]]) -> list[metrics.Gauge]:
    """What the instances' rank-load messages said last (wire.LoadReport), per instance and rank."""

    def series(name: str, kind: str, help_text: str) -> metrics.Gauge:
        gauge = metrics.Gauge(name, help_text)
        gauge.kind = kind
        return gauge

    cached = series(
        "motor_kv_adapter_rank_cached_tokens_total", "counter", "Prompt tokens the rank served from its cache"
    )
    prefill = series(
        "motor_kv_adapter_rank_prefill_tokens_total", "counter", "Prompt tokens the rank computed (not cached)"
    )
    load = series("motor_kv_adapter_rank_load_tokens", "gauge", "The rank's load in tokens, as its dispatcher costs it")
    requests = series("motor_kv_adapter_rank_requests", "gauge", "Requests running or waiting on the rank")
    skew = series(
        "motor_kv_adapter_instance_rank_load_skew",
        "gauge",
        "Busiest rank's load / the ranks' mean load (1: even; under lock step the busiest paces every step)",
    )
    decisions = series(
        "motor_kv_adapter_dispatch_decisions_total", "counter", "The instance dispatcher's decisions by reason"
    )
    age = series("motor_kv_adapter_rank_loads_age_seconds", "gauge", "Seconds since the instance's last rank loads")
    now = time.monotonic()
    for instance, figures in loads:
        for rank, value in enumerate(figures.loads):
            cached.set(figures.cached_tokens_total[rank], instance=instance, dp_rank=rank)
            prefill.set(figures.prefill_tokens_total[rank], instance=instance, dp_rank=rank)
            load.set(value, instance=instance, dp_rank=rank)
            requests.set(figures.requests[rank], instance=instance, dp_rank=rank)
        mean = sum(figures.loads) / len(figures.loads) if figures.loads else 0.0
        skew.set(max(figures.loads) / mean if mean > 0 else 1.0, instance=instance)
        for reason, count in figures.dispatch.items():
            decisions.set(count, instance=instance, reason=reason)
        age.set(round(now - figures.received, 3), instance=instance)
    return [cached, prefill, load, requests, skew, decisions, age]


def query_memo_text(memo: Any) -> str:
    """The ``/query`` handler's prefix memo (``QueryKeysMemo``, docs/native.md "Prefix reuse")
    in the exposition: how many new bodies reused a recent body's leading blocks, how many
    blocks they skipped, and what it holds.  Empty without the C helpers (no memo)."""
    if memo is None:
        return ""
    series = (
        (
            "query_prefix_reuse_total",
            "counter",
            "New /query bodies that took leading blocks from a recent body",
            memo.hits,
        ),
        (
            "query_prefix_reused_blocks_total",
            "counter",
            "Blocks those bodies neither decoded nor hashed",
            memo.reused_blocks,
        ),
        (
            "query_prefix_memo_exact_total",
            "counter",
            "/query bodies the memo held byte for byte: their prompt again, nothing decoded or hashed",
            memo.exact_hits,
        ),
        ("query_prefix_memo_bodies", "gauge", "Recent /query bodies remembered for their leading blocks", len(memo)),
        ("query_prefix_memo_bytes", "gauge", "Bytes those bodies count against the memo's bound", memo.bytes),
    )
    gauges: list[metrics.Gauge] = []
    for name, kind, help_text, value in series:
        gauge = metrics.Gauge(f"motor_kv_adapter_{name}", help_text)
        gauge.kind = kind
        gauge.set(float(value))
        gauges.append(gauge)
    return metrics.Registry().render(gauges)
