"""``/query``'s two answer shapes, one function each, computed from what the index holds.

- :func:`longest_hit_answer`: every registered instance by its streams' best ranks (the
  conductor's answer; no rank loads flowing).
- :func:`rank_answer`: every instance scored by the rank that would serve the request - that
  rank's hit and load, ``rank_cost.score_ranks``, the dispatcher's own function - in the values
  Motor's unchanged cost reads (:func:`scoring.motor_values`).  :mod:`motor_adapter.rank_render`
  renders the same answer in C for the common shape; this is its reference and its fallback.

Both list every registered dp, zeros included (conductor semantics); an answer's entries are
fresh dicts per computation, and an :class:`Answer` once made is never mutated (the query
cache hands the same one out again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import msgspec

from motor_adapter.adapter_metrics import AdapterMetrics, HitTally
from motor_adapter.rank_loads import RankLoadBook
from motor_adapter.scoring import (
    KvAffinityConfig,
    RankScored,
    TierCounts,
    best_rank,
    dp_entry,
    instance_entry,
    matched_tokens,
    motor_values,
    pick_instance,
    prefill_cost,
)
from sglang_kvpub.core.rank_cost import CostParams, score_ranks, spread_start

__all__ = [
    "JSON_TYPE",
    "Answer",
    "Observed",
    "Plan",
    "RankAnswered",
    "cost_params",
    "instance_answer",
    "longest_hit_answer",
    "rank_answer",
]

JSON_TYPE = "application/json"  # Answer.encoded's key for the JSON encoding
_JSON_DECODER = msgspec.json.Decoder()
Observed = tuple[str, str, int, TierCounts]  # (instance, dp key, engine rank, hit): the metrics' view of a hit


class Answer:
    """A ``/query`` answer (``body``) and its encodings by format (``encoded``, filled by
    the HTTP layer): a cached answer shares both, so a repeat encodes nothing.  An answer
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """One registered instance as ``/query`` renders it at one block_size."""

    instance: str
    dps: list[int]  # registered dps, sorted
    keys: tuple[str, ...]  # the same as JSON keys
    streams: tuple[tuple[int, str], ...]  # (dp, stream URL) of the registrations usable at this block_size
    single: bool  # one registration: its stream's engine ranks fold into its dp


class RankAnswered(NamedTuple):
    """A rank-aware answer and what serving it does: the metrics (its hits' tally, the scored
    tokens' counter cells) and the commit ``(stream, rank, tokens)`` it makes."""

    answer: Answer
    tally: HitTally
    scored: tuple[tuple[Any, int], ...]
    commit: Union[tuple[str, int, float], None]


_PARAMS: dict[KvAffinityConfig, CostParams] = {}


def cost_params(cfg: KvAffinityConfig) -> CostParams:
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


# ---------------------------------------------------------------------------- longest hit


def longest_hit_answer(
    plans: Sequence[Plan],
    best: Mapping[str, tuple[int, TierCounts]],
    block_size: int,
    cfg: KvAffinityConfig,
    shape: str,
) -> tuple[dict[str, dict[str, Any]], list[Observed]]:
    """Per-instance entries (:func:`scoring.instance_entry` in ``shape``) from each stream's
    best rank (``best``), and the hits listed for the metrics."""
    out: dict[str, dict[str, Any]] = {}
    observed: list[Observed] = []
    for plan in plans:
        entry, hits = instance_answer(
            plan, tuple(best.get(stream) for _, stream in plan.streams), block_size, cfg, shape
        )
        out[plan.instance] = entry
        observed.extend(hits)
    return out, observed


def instance_answer(
    plan: Plan,
    found: tuple[Union[tuple[int, TierCounts], None], ...],
    block_size: int,
    cfg: KvAffinityConfig,
    shape: str,
) -> tuple[dict[str, Any], tuple[Observed, ...]]:
    """One instance's entry from its streams' best ranks (``found``, in ``plan.streams`` order)."""
    observed: list[Observed] = []
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


# ---------------------------------------------------------------------------- rank-aware


def rank_answer(
    tenant: str,
    plans: Sequence[Plan],
    rank_plans: Sequence[Plan],
    all_hits: Mapping[str, Mapping[int, TierCounts]],
    book: RankLoadBook,
    fresh: Sequence[bool],
    now: float,
    isl: int,
    spread: int,
    cfg: KvAffinityConfig,
    shape: str,
    metrics: AdapterMetrics,
) -> RankAnswered:
    """The rank-aware answer of a prompt of ``isl`` tokens and tie-break key ``spread``.

    ``rank_plans``: the single-endpoint instances, scored by rank (``fresh[i]``: whether the
    i-th has fresh loads in ``book`` at monotonic ``now``; without them it is scored by its
    longest hit); ``dp_detail`` names the rank (``scored_rank``; ``engine_dp_rank`` and the
    tiers: its real hit, None without one; ``rank_load``, ``rank_cost``).  Instances with
    several endpoints are answered as in :func:`longest_hit_answer`.  Nothing is changed:
    the caller makes the commit (the prompt's uncached tokens to the rank the answer names)
    and counts the metrics."""
    block_size = cfg.block_size
    params = cost_params(cfg)
    scored: list[RankScored] = []
    longest: list[int] = []
    for plan, is_fresh in zip(rank_plans, fresh, strict=True):
        stream = plan.streams[0][1]
        figures = book.get(stream, now) if is_fresh else None
        s, most = _score(all_hits.get(stream, {}), figures, book, stream, isl, spread, cfg, params)
        scored.append(s)
        longest.append(most)
    out: dict[str, dict[str, Any]] = {}
    tallies: list[HitTally] = []
    counted: list[tuple[str, int, int]] = []
    commit: Union[tuple[str, int, float], None] = None
    if scored:
        best = pick_instance(scored, spread)
        dp_values, gpu_values = motor_values(scored, best, cfg, isl, fresh)
        top = scored[best]
        if top.rank is not None and fresh[best]:
            commit = (rank_plans[best].streams[0][1], top.rank, isl - top.matched)
        for i, (plan, s) in enumerate(zip(rank_plans, scored, strict=True)):
            own = [(plan.instance, plan.keys[0], s.rank, s.hit)] if s.hit is not None and s.rank is not None else []
            entry = _rank_entry(plan, s, longest[i], block_size, cfg, shape)
            entry["GPU"] = gpu_values[i]  # Motor's values depend on the other instances too
            if shape == "tokens":
                entry["DP"] = {plan.keys[0]: dp_values[i]}
            out[plan.instance] = entry
            tallies.append(metrics.tally(own))
            if s.rank is not None and s.matched > 0:
                counted.append((plan.instance, s.rank, s.matched))
    observed: list[Observed] = []
    for plan in plans:  # several endpoints per instance: each dp its own stream's best rank
        if plan.instance in out:
            continue
        per_stream: list[Union[tuple[int, TierCounts], None]] = []
        for _, stream in plan.streams:
            best_of = best_rank(all_hits.get(stream, {}), cfg)
            per_stream.append((best_of[0], best_of[1]) if best_of else None)
        entry_out, hits = instance_answer(plan, tuple(per_stream), block_size, cfg, shape)
        out[plan.instance] = entry_out
        observed.extend(hits)
    if observed:
        tallies.append(metrics.tally(observed))
    # Counting is additive: the answer's tally is its instances' (each resolved once).
    tally = HitTally(tuple(add for t in tallies for add in t.adds), max((t.best for t in tallies), default=0))
    return RankAnswered(Answer({tenant: out}, {}), tally, metrics.scored_cells(counted), commit)


def _score(
    ranks: Mapping[int, TierCounts],
    figures: Any,
    book: RankLoadBook,
    stream: str,
    isl: int,
    spread: int,
    cfg: KvAffinityConfig,
    params: CostParams,
) -> tuple[RankScored, int]:
    """One instance's :class:`RankScored` and its longest hit in tokens.  Without load figures
    (``figures`` None, or no ranks) it is scored by its longest hit, as before loads existed."""
    longest = max((h.total_blocks for h in ranks.values()), default=0) * cfg.block_size
    size = figures.dp_size if figures is not None else 0
    if figures is None or size == 0:
        found = best_rank(ranks, cfg)
        hit = found[1] if found else None
        matched = matched_tokens(hit, cfg, isl)
        cost = cfg.prefill_load_scale * prefill_cost(matched, cfg, isl)
        return RankScored(found[0] if found else None, hit, matched, cost), longest
    loads, total = book.current(figures, stream)
    tiers = {r: (h.npu_blocks, h.cpu_blocks, h.disk_blocks) for r, h in ranks.items() if r < size}
    chosen = score_ranks(tiers, loads, list(range(size)), spread_start(spread, size), isl, params)
    scored = RankScored(chosen.rank, ranks.get(chosen.rank), chosen.matched, chosen.cost, total, chosen.load)
    return scored, longest


def _rank_entry(
    plan: Plan, s: RankScored, longest: int, block_size: int, cfg: KvAffinityConfig, shape: str
) -> dict[str, Any]:
    """One instance's entry of a rank-aware answer but Motor's values (``GPU``, and ``DP`` in
    the "tokens" shape), which depend on the other instances."""
    key = plan.keys[0]
    # engine_dp_rank names the rank the figures belong to (None: no hit);
    # scored_rank the rank that would serve the request, hit or not.
    entry = dp_entry(s.hit, s.rank if s.matched > 0 else None, block_size)
    entry["scored_rank"] = s.rank
    entry["rank_cost"] = round(s.cost, 1)
    entry["rank_load"] = round(s.load, 1)
    answer = instance_entry({key: entry}, cfg, block_size, shape)
    answer["longest_matched"] = longest
    return answer
