"""One ``/query``, from a prompt's block keys to its :class:`~motor_adapter.answer.Answer`.

:func:`answer` reads top to bottom: the index's one-pass walk; with rank loads flowing, the
rank-aware answer (rendered in C when :mod:`motor_adapter.rank_render` renders the view, else
:func:`answer.rank_answer`); else the longest-hit answer (:func:`answer.longest_hit_answer`).
The one cache in front of them is the view's :class:`~motor_adapter.query_cache.QueryCache`,
by walk result.  A :class:`View` is what a query of ``(model, tenant, block_size)`` needs of the
registrations, grouped once per registration change by :class:`motor_adapter.state.AdapterState`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Union

from motor_adapter import rank_render
from motor_adapter.adapter_metrics import AdapterMetrics
from motor_adapter.affinity import KvAffinity
from motor_adapter.answer import (
    JSON_TYPE,
    Answer,
    Plan,
    cost_params,
    longest_hit_answer,
    rank_answer,
)
from motor_adapter.query_cache import LastRender, QueryCache, WalkEntry
from motor_adapter.registration import Registration
from motor_adapter.scoring import KvAffinityConfig, TierCounts, best_rank, matched_tokens
from sglang_kvpub.core.rank_cost import CostParams

__all__ = ["View", "answer", "best_ranks", "make_view"]


@dataclasses.dataclass(frozen=True)
class View:
    """What a query of ``(model, tenant, block_size)`` needs, grouped once per registration change."""

    tenant: str
    regs: list[Registration]
    affinity: Union[KvAffinity, None]
    plans: tuple[Plan, ...]  # every registered instance, in registration order
    rank_plans: tuple[Plan, ...]  # the single-endpoint ones: scored by rank when loads flow
    rank_streams: tuple[str, ...]  # their streams
    cfg: KvAffinityConfig  # the configured weights at this block size
    shape: str  # the answer shape (ServiceConfig.query_shape)
    params: CostParams  # the rank cost's constants at this block size
    rank_static: Union[rank_render.RankStatic, None]  # the C renderer's view inputs; None: not rendered in C
    cache: QueryCache = dataclasses.field(default_factory=QueryCache)


def make_view(
    tenant: str, regs: Sequence[Registration], affinity: Union[KvAffinity, None], cfg: KvAffinityConfig, shape: str
) -> View:
    plans = _plans(regs, cfg.block_size)
    rank_plans = tuple(plan for plan in plans if plan.single and plan.streams)
    rank_streams = tuple(plan.streams[0][1] for plan in rank_plans)
    static = rank_render.static_inputs(
        tenant,
        [plan.instance for plan in rank_plans],
        [plan.keys[0] for plan in rank_plans],
        rank_streams,
        len(rank_plans) == len(plans),
        shape,
    )
    params = cost_params(cfg)
    renders = static if rank_render.renders(params) else None
    return View(tenant, list(regs), affinity, plans, rank_plans, rank_streams, cfg, shape, params, renders)


def _plans(regs: Sequence[Registration], block_size: int) -> tuple[Plan, ...]:
    groups: dict[str, list[Registration]] = {}
    for reg in regs:  # registration order: the response lists instances in it
        groups.setdefault(reg.instance_id, []).append(reg)
    plans = []
    for instance, members in groups.items():
        dps = sorted(r.dp_rank for r in members)
        usable = tuple(
            (r.dp_rank, r.index_name) for r in members if r.block_size == block_size and r.index_name is not None
        )
        plans.append(Plan(instance, dps, tuple(str(dp) for dp in dps), usable, len(members) == 1))
    return tuple(plans)


def answer(
    view: View,
    metrics: AdapterMetrics,
    model: str,
    keys: list[int],
    blocks: int,
    started: float,
    isl: int,
    spread: int,
) -> Answer:
    """``/query``'s answer for a prompt's chained block keys (``blocks`` full blocks asked,
    ``isl`` tokens, tie-break key ``spread``: ``rank_cost.spread_key``, the dispatcher computes
    the same), its metrics counted and, when rank-aware, its commit made.  Never mutate it."""
    affinity = view.affinity
    if affinity is not None and affinity.loads.figured:
        if view.rank_static is not None:
            walk = affinity.best_for_keys(keys)  # None: CPU/disk hold blocks (the reference answers)
            if walk is not None:
                rendered = _rendered(view, metrics, view.cache.entry(walk), keys, isl, spread)
                if rendered is not None:
                    metrics.observe_query(model, rendered.blocks, blocks, started)
                    return rendered.answer
        now = time.monotonic()
        tokens, _ = affinity.loads.tokens(view.rank_streams, now)
        fresh = [token is not None for token in tokens]
        if any(fresh):
            return _by_rank(view, metrics, model, keys, blocks, started, isl, spread, fresh, now)
    walk, remembered = best_ranks(view, keys)
    entry = view.cache.entry(walk) if remembered else WalkEntry(walk)
    if entry.longest_hit is None:
        out, observed = longest_hit_answer(view.plans, walk, view.cfg.block_size, view.cfg, view.shape)
        entry.longest_hit = (Answer({view.tenant: out}, {}), metrics.tally(observed))
    done, tally = entry.longest_hit
    metrics.observe_tally(model, tally, blocks, started)
    return done


def _rendered(
    view: View, metrics: AdapterMetrics, entry: WalkEntry, keys: list[int], isl: int, spread: int
) -> Union[LastRender, None]:
    """The rank-aware answer of ``entry``'s walk result rendered in C, its commit and metrics
    made; None when no instance has fresh loads or the renderer declines (a figure it would
    not print exactly): the caller answers in Python then."""
    static, affinity = view.rank_static, view.affinity
    assert static is not None and affinity is not None
    book = affinity.loads
    changes = book.changes  # read first: a change while rendering is seen next time
    now = time.monotonic()
    prompt = keys[-1] if keys else spread  # the commit's key: once per prompt between two reports
    last = entry.last
    if last is not None and last.isl == isl and last.spread == spread and last.changes == changes and now < last.until:
        last.effects(prompt)  # the same answer again (LastRender.holds): its commit and metrics made again
        return last
    table = entry.table
    if table is None:  # the per-rank hits of these walk ends: one walk more when they first appear
        all_hits = affinity.hits_for_keys(keys)
        table = entry.table = rank_render.RankTable(
            static, view.params, entry.walk, all_hits, view.cfg.block_size, _cells_of(view, metrics)
        )
    got = rank_render.render(static, table, book, now, isl, spread)
    if not got:
        return None
    json, best_blocks, until, plan = got
    made = rank_render.effects(static, table, book, plan, metrics.instance_hits.repeat, metrics.scored_tokens.repeat)
    made(prompt)
    entry.last = LastRender(isl, spread, changes, until, best_blocks, Answer(None, {JSON_TYPE: json}), made)
    return entry.last


def _cells_of(view: View, metrics: AdapterMetrics) -> Callable[[rank_render.RankTable, int, int], rank_render.Cells]:
    """The metrics cells of instance ``i``'s rank ``rank`` in a table, as :func:`rank_answer`
    resolves them for an answer naming that rank: its hit's tiers, and the scored-tokens
    cell when the hit can score tokens (no series appears before it counts)."""

    def resolve(table: rank_render.RankTable, i: int, rank: int) -> rank_render.Cells:
        plan = view.rank_plans[i]
        hit = table.all_hits[plan.streams[0][1]][rank]
        adds = metrics.tally([(plan.instance, plan.keys[0], rank, hit)]).adds
        scores = matched_tokens(hit, view.cfg, 1 << 62) > 0
        return adds, metrics.scored_cell(plan.instance, rank) if scores else None

    return resolve


def _by_rank(
    view: View,
    metrics: AdapterMetrics,
    model: str,
    keys: list[int],
    blocks: int,
    started: float,
    isl: int,
    spread: int,
    fresh: Sequence[bool],
    now: float,
) -> Answer:
    """:func:`answer.rank_answer` computed in Python, its commit made and metrics counted."""
    affinity = view.affinity
    assert affinity is not None
    all_hits = affinity.hits_for_keys(keys)
    ranked = rank_answer(
        view.tenant, view.plans, view.rank_plans, all_hits, affinity.loads, fresh, now, isl, spread,
        view.cfg, view.shape, metrics,
    )  # fmt: skip
    if ranked.commit is not None:
        # The answer makes Motor pick this instance and its dispatcher this rank: count the
        # prompt's uncached part there until the instance's next report.
        stream, rank, tokens = ranked.commit
        affinity.loads.commit(stream, rank, tokens, keys[-1] if keys else spread)
    metrics.observe_cells(ranked.scored)
    metrics.observe_tally(model, ranked.tally, blocks, started)
    return ranked.answer


def best_ranks(view: View, keys: list[int]) -> tuple[Mapping[str, tuple[int, TierCounts]], bool]:
    """Per stream holding block 0: ``(engine rank, hit)`` of its best rank (``best_rank``),
    and whether that mapping is the index's walk result (one object per walk ends, see
    :mod:`motor_adapter.query_cache`) rather than built for this query."""
    if view.affinity is None:
        return {}, False
    walk = view.affinity.best_for_keys(keys)  # one pass while only NPU holds blocks
    if walk is not None:
        return walk, True
    out: dict[str, tuple[int, TierCounts]] = {}
    for stream, ranks in view.affinity.hits_for_keys(keys).items():
        found = best_rank(ranks, view.cfg)
        if found is not None:
            out[stream] = (found[0], found[1])
    return out, False
