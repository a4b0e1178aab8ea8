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
    RankAnswered,
    cost_params,
    longest_hit_answer,
    rank_answer,
)
from motor_adapter.query_cache import ClaimedSlot, Effects, LastRender, QueryCache, WalkEntry
from motor_adapter.rank_loads import Claim, RankLoadBook
from motor_adapter.registration import Registration
from motor_adapter.scoring import KvAffinityConfig, TierCounts, best_rank, matched_tokens
from sglang_kvpub.core.rank_cost import CostParams

__all__ = ["View", "answer", "best_ranks", "claimed_hits", "make_view"]

_CLAIMED_MAX = 64  # claimed prompts kept per walk result (the cold walk's is shared by bursts)


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
        book = affinity.loads
        changes = book.changes  # read first: a change while answering is seen next time
        now = time.monotonic()
        walk = affinity.best_for_keys(keys)  # None: CPU/disk hold blocks (nothing is cached then)
        entry = view.cache.entry(walk) if walk is not None else None
        # The commit's and the claim's key: the last block key, chained over every block.
        ranked = _rank_aware(view, metrics, entry, keys, isl, spread, changes, now, keys[-1] if keys else spread)
        if ranked is not None:
            metrics.observe_query(model, ranked.blocks, blocks, started)
            return ranked.answer
    walk, remembered = best_ranks(view, keys)
    entry = view.cache.entry(walk) if remembered else WalkEntry(walk)
    if entry.longest_hit is None:
        out, observed = longest_hit_answer(view.plans, walk, view.cfg.block_size, view.cfg, view.shape)
        entry.longest_hit = (Answer({view.tenant: out}, {}), metrics.tally(observed))
    done, tally = entry.longest_hit
    metrics.observe_tally(model, tally, blocks, started)
    return done


def _rank_aware(
    view: View,
    metrics: AdapterMetrics,
    entry: Union[WalkEntry, None],
    keys: list[int],
    isl: int,
    spread: int,
    changes: int,
    now: float,
    prompt: int,
) -> Union[LastRender, None]:
    """The rank-aware answer, its side effects made (its metrics counted, ``prompt``
    committed), None when no instance has fresh loads: the walk result's last one again
    while it holds (:meth:`LastRender.holds`), else rendered in C when the view renders
    there, else :func:`answer.rank_answer` in Python (the reference: where C declines, or a
    figure would not print exactly).  ``entry``: the walk result's cache entry (None: CPU or
    disk hold blocks, nothing is kept).  A prompt an answer committed since its instance's
    last report (the same last block key) is answered by :func:`_claimed`."""
    affinity = view.affinity
    assert affinity is not None
    book = affinity.loads
    # One lookup: a new prompt misses it; a group's next member, a retry or a poll finds it.
    held = book.claims.get(prompt)
    if held is not None:
        slots = entry.claimed if entry is not None else None
        slot = slots.get(prompt) if slots is not None else None
        # Its last answer again, as below: while it holds (no report came, the loads are
        # fresh), the claim holds too.
        if slot is not None and slot.claim is held:
            last = slot.last
            if last is not None and last.holds(isl, spread, changes, now):
                _redo(view, last, book, metrics, prompt)
                return last
        claimed = _claimed(view, metrics, entry, keys, isl, spread, changes, now, prompt, held, slot)
        if claimed is not None:
            return claimed
    if entry is not None:
        last = entry.last
        if last is not None and last.holds(isl, spread, changes, now):
            _redo(view, last, book, metrics, prompt)
            return last
    return _answered(view, metrics, entry, entry, None, keys, isl, spread, changes, now, prompt)


def _answered(
    view: View,
    metrics: AdapterMetrics,
    entry: Union[WalkEntry, None],
    kept: Union[WalkEntry, ClaimedSlot, None],
    held: Union[Claim, None],
    keys: list[int],
    isl: int,
    spread: int,
    changes: int,
    now: float,
    prompt: int,
) -> Union[LastRender, None]:
    """The rank-aware answer of the walk's hits - with ``held``'s rank holding the whole
    prompt when claimed - rendered in C from ``kept.table`` (built on first use) when the
    view renders there, else by the reference; kept as ``kept.last``.  ``kept``: where the
    table and last answer live (the walk result's entry, or a claimed prompt's slot in it;
    None when nothing is kept, as ``entry``)."""
    affinity = view.affinity
    assert affinity is not None
    book = affinity.loads
    static = view.rank_static
    if entry is not None and kept is not None and static is not None:
        table = kept.table
        if table is None:  # the per-rank hits of these walk ends: one walk more when they first appear
            table = kept.table = rank_render.RankTable(
                static, view.params, entry.walk, _walk_hits(entry, affinity, keys, held), view.cfg.block_size,
                _cells_of(view, metrics),
            )  # fmt: skip
        done = _rendered(static, table, book, metrics, now, isl, spread, changes, prompt)
        if done is not None:
            kept.last = done
            return done
    done = _reference(view, metrics, _walk_hits(entry, affinity, keys, held), now, isl, spread, changes, prompt)
    if kept is not None and done is not None:
        kept.last = done
    return done


def _walk_hits(
    entry: Union[WalkEntry, None], affinity: KvAffinity, keys: list[int], held: Union[Claim, None]
) -> Mapping[str, Mapping[int, TierCounts]]:
    """The walk's per-rank hits (kept in ``entry`` when there is one), with ``held``'s rank
    holding every block of the prompt when it is claimed."""
    hits = _hits(entry, affinity, keys) if entry is not None else affinity.hits_for_keys(keys)
    return hits if held is None else _with_claim(hits, held, len(keys))


def _rendered(
    static: rank_render.RankStatic,
    table: rank_render.RankTable,
    book: RankLoadBook,
    metrics: AdapterMetrics,
    now: float,
    isl: int,
    spread: int,
    changes: int,
    prompt: int,
) -> Union[LastRender, None]:
    """``table``'s answer rendered in C, its side effects made; None when the C declines or
    no instance has fresh loads (the caller answers by the reference)."""
    got = rank_render.render(static, table, book, now, isl, spread)
    if not got:
        return None
    json, best_blocks, until, plan = got
    done = LastRender(isl, spread, changes, until, best_blocks, Answer(None, {JSON_TYPE: json}), None, table, plan)
    rank_render.apply(static, table, book, plan, metrics.answer_tally, prompt)
    return done


def _reference(
    view: View,
    metrics: AdapterMetrics,
    hits: Mapping[str, Mapping[int, TierCounts]],
    now: float,
    isl: int,
    spread: int,
    changes: int,
    prompt: int,
) -> Union[LastRender, None]:
    """The rank-aware answer of ``hits`` by :func:`answer.rank_answer`, its side effects
    made; None when no instance has fresh loads."""
    assert view.affinity is not None
    book = view.affinity.loads
    tokens, until = book.tokens(view.rank_streams, now)
    fresh = [token is not None for token in tokens]
    if not any(fresh):
        return None
    ranked = rank_answer(
        view.tenant, view.plans, view.rank_plans, hits, book, fresh, now, isl, spread, view.cfg, view.shape, metrics
    )
    done = LastRender(isl, spread, changes, until, ranked.tally.best, ranked.answer, _effects(ranked, book, metrics))
    _redo(view, done, book, metrics, prompt)
    return done


def _claimed(
    view: View,
    metrics: AdapterMetrics,
    entry: Union[WalkEntry, None],
    keys: list[int],
    isl: int,
    spread: int,
    changes: int,
    now: float,
    prompt: int,
    held: Claim,
    slot: Union[ClaimedSlot, None],
) -> Union[LastRender, None]:
    """:func:`_rank_aware`'s answer for a prompt claimed by ``held`` (the book's claim on
    ``prompt``) when its last one does not hold: the walk's hits with the claimed rank
    holding every block of the prompt (:func:`claimed_hits`), answered, remembered and
    rendered as an unclaimed prompt is, per prompt in the walk result's entry (``slot``, its
    :class:`ClaimedSlot` there if any).  None when the claim no longer holds (or no instance
    has fresh loads): answer the prompt as unclaimed."""
    assert view.affinity is not None
    # The last key is chained over every block: the claim covers len(keys) blocks.
    if not keys or view.affinity.loads.claim(prompt, now) is not held:
        return None
    if entry is not None:
        if slot is None or slot.claim.instance != held.instance or slot.claim.rank != held.rank:
            slots = entry.claimed
            if slots is None:
                slots = entry.claimed = {}
            elif len(slots) >= _CLAIMED_MAX:
                slots.clear()
            slot = slots[prompt] = ClaimedSlot(held)
        else:
            slot.claim = held  # the same rank under a later report: the table still holds
    return _answered(view, metrics, entry, slot, held, keys, isl, spread, changes, now, prompt)


def claimed_hits(
    book: RankLoadBook, hits: Mapping[str, Mapping[int, TierCounts]], keys: list[int], now: float
) -> Mapping[str, Mapping[int, TierCounts]]:
    """``hits`` (instance -> rank -> hit) as a rank-aware answer of the prompt with block
    keys ``keys`` counts them at ``now``: with the rank that holds the book's claim on the
    prompt (:meth:`RankLoadBook.claim`) holding every block of it."""
    held = book.claim(keys[-1], now) if keys else None
    return hits if held is None else _with_claim(hits, held, len(keys))


def _with_claim(
    hits: Mapping[str, Mapping[int, TierCounts]], held: Claim, blocks: int
) -> Mapping[str, Mapping[int, TierCounts]]:
    """``hits`` with the claimed rank holding ``blocks`` blocks on the device (a new mapping)."""
    merged = dict(hits)
    own = dict(hits.get(held.instance, {}))
    own[held.rank] = TierCounts(blocks, 0, 0)
    merged[held.instance] = own
    return merged


def _redo(view: View, last: LastRender, book: RankLoadBook, metrics: AdapterMetrics, prompt: int) -> None:
    """The side effects of serving ``last`` (again) for ``prompt``: the reference's bound
    ones, else the C answer's through :func:`rank_render.apply`."""
    if last.effects is not None:
        last.effects(prompt)
    else:
        assert view.rank_static is not None and last.table is not None and last.plan is not None
        rank_render.apply(view.rank_static, last.table, book, last.plan, metrics.answer_tally, prompt)


def _hits(entry: WalkEntry, affinity: KvAffinity, keys: list[int]) -> Mapping[str, Mapping[int, TierCounts]]:
    """The per-rank hits of ``entry``'s walk ends (``hits_for_keys``), kept in the entry."""
    if entry.hits is None:
        entry.hits = affinity.hits_for_keys(keys)
    return entry.hits


def _effects(ranked: RankAnswered, book: RankLoadBook, metrics: AdapterMetrics) -> Effects:
    """What serving the Python answer ``ranked`` does, bound: count its hits and scored tokens,
    and commit the prompt's uncached part to the rank it names (Motor picks this instance and
    its dispatcher this rank), counted there until the instance's next report."""
    adds, scored, commit = ranked.tally.adds, ranked.scored, ranked.commit

    def make(prompt: int) -> None:
        if adds:
            metrics.instance_hits.repeat(adds)
        metrics.observe_cells(scored)
        if commit is not None:
            book.commit(commit[0], commit[1], commit[2], prompt)

    return make


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
