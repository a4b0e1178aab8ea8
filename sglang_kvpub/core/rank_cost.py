"""The rank that serves a prompt: one cost, used by both halves (router and in-instance dispatch).

The adapter scores each instance by the rank that would serve the request, and the
instance's cache-aware dispatcher sends the request to a rank: both call
:func:`score_ranks` with the same inputs shape, so they pick the same rank whenever they see
the same hits and loads (the dispatcher's loads are fresher: it may do better).  Per rank::

    matched_r = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
    cost_r    = prefill_load_scale * max(0, isl - overlap_credit * matched_r) + load_weight * load_r

the lowest wins (Motor's kv_cache_affinity "unified" cost, per rank); equal costs go to the
first in the candidates rotated by :func:`spread_start` - a function of the prompt, so two
processes agree on it and distinct prompts spread over the ranks.  Then the optional hot-spot
guard (off by default): when the winner's load exceeds the least loaded candidate's by more
than ``max(hotspot_spread, hotspot_relative * mean load)`` the least loaded wins (reason
``hotspot``).

Under attention-DP lock step the busiest rank paces every step, so a scheduler should
minimise the resulting maximum rank load, ``max(max_{q != r} load_q, load_r + isl -
matched_r)``; the rank of least ``cost_r`` always minimises it (docs/dispatch.md, "The cost
under lock step"), and among the ranks that do it is the one that finishes this request
first.

Pure: no SGLang, no ZMQ; the C helper ``dispatch_score`` (docs/native.md) computes the same
figures when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from sglang_kvpub.core import hashing

__all__ = [
    "DEFAULT_HOTSPOT_SPREAD",
    "DEFAULT_HOTSPOT_RELATIVE",
    "REASON_CODES",
    "CostParams",
    "RankScore",
    "score_ranks",
    "spread_key",
    "spread_key_of_local",
    "spread_start",
    "with_pending",
]

# The hot-spot guard is off by default: with load_weight 1 the cost already bounds a pile-up (a
# rank holding a hit takes at most `matched` tokens more queue than the least loaded), and under
# lock step the cost's choice minimises the resulting maximum rank load, which the guard can
# only move away from (docs/dispatch.md).  Set both (tokens, x mean load) to turn it on.
DEFAULT_HOTSPOT_SPREAD: float | None = None
DEFAULT_HOTSPOT_RELATIVE: float | None = None
REASON_CODES = ("cache_hit", "no_hit", "hotspot")  # RankScore.reason indexes this

Hit = tuple[int, int, int]  # (npu, cpu, disk) blocks of one rank


class CostParams(NamedTuple):
    """The cost's constants (Motor's defaults), the same on both halves."""

    block_size: int
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0
    load_weight: float = 1.0
    hotspot_spread: float | None = DEFAULT_HOTSPOT_SPREAD
    hotspot_relative: float | None = DEFAULT_HOTSPOT_RELATIVE

    def matched(self, hit: Hit, isl: int) -> int:
        weighted = hit[0] * self.w_npu + hit[1] * self.w_cpu + hit[2] * self.w_disk
        return min(round(weighted * self.block_size), isl)

    def prefill(self, matched: int, isl: int) -> float:
        return self.prefill_load_scale * max(0.0, isl - self.overlap_credit * matched)


class RankScore(NamedTuple):
    """The chosen rank, why (an index into :data:`REASON_CODES`), its matched tokens, cost and load."""

    rank: int
    reason: int
    matched: int
    cost: float
    load: float


def spread_key_of_local(last_local_hash: int) -> int:
    """The tie-break key from the local hash of the prompt's last full block."""
    return last_local_hash & 0xFFFFFFFFFFFFFFFF


def spread_key(token_ids: Sequence[int], block_size: int) -> int:
    """The tie-break key of a prompt: the local hash (XXH3-64, the router's seed) of its last
    full block - one hash of ``block_size`` ids: the adapter has it from the query's block
    hashes, the dispatcher computes it per request.  A prompt shorter than one block (which
    Motor never asks about) hashes what it has."""
    blocks = len(token_ids) // block_size if block_size > 0 else 0
    if blocks <= 0:
        return spread_key_of_local(hashing.local_block_hash(token_ids)) if len(token_ids) else 0
    end = blocks * block_size
    return spread_key_of_local(hashing.local_block_hash(token_ids[end - block_size : end]))


def spread_start(key: int, candidates: int) -> int:
    """Where the scan over ``candidates`` ranks starts: equal costs go to the first from there."""
    return key % candidates if candidates > 0 else 0


def with_pending(hits: Mapping[int, Hit], pending: Mapping[int, int], params: CostParams) -> dict[int, Hit]:
    """``hits`` with each rank's pending prefix (``pending``: rank -> leading blocks of the
    prompt the rank is prefilling or has queued, :mod:`sglang_kvpub.core.pending`) counted as
    held on the device where it is longer than what the rank holds: pages being prefilled
    are a hit once the prefill ends, and the wait until then is in the rank's load (the
    pending prompt is queued or running there).  The cost itself is unchanged."""
    merged = dict(hits)
    for rank, blocks in pending.items():
        cached = merged.get(rank)
        if (
            cached is None
            or blocks * params.w_npu > cached[0] * params.w_npu + cached[1] * params.w_cpu + cached[2] * params.w_disk
        ):
            merged[rank] = (blocks, 0, 0)
    return merged


def score_ranks(
    hits: Mapping[int, Hit], loads: Sequence[float], ranks: list[int], start: int, isl: int, params: CostParams
) -> RankScore:
    """The rank for a prompt of ``isl`` tokens among ``ranks`` (non-empty, each indexing
    ``loads``), given each rank's hit (``hits``: rank -> (npu, cpu, disk) blocks, only the
    ranks holding a prefix) - the module docstring's cost, ties and guard.  The scan starts
    at ``ranks[start]`` (:func:`spread_start`).  In one C call when the helpers are built."""
    native = hashing.NATIVE
    if native is not None and type(hits) is dict:
        best, reason, matched, cost, load = native.dispatch_score(
            hits,
            loads,
            ranks,
            start,
            isl,
            params.block_size,
            (params.w_npu, params.w_cpu, params.w_disk),
            params.prefill_load_scale,
            params.overlap_credit,
            params.load_weight,
            params.hotspot_spread,
            params.hotspot_relative,
        )
        return RankScore(best, reason, matched, cost, load)
    return _score_ranks_py(hits, loads, ranks, start, isl, params)


def _score_ranks_py(
    hits: Mapping[int, Hit], loads: Sequence[float], ranks: list[int], start: int, isl: int, params: CostParams
) -> RankScore:
    """:func:`score_ranks` in Python: the reference the C helper follows."""
    if not ranks or not 0 <= start < len(ranks):
        raise ValueError("score_ranks needs ranks and a start within them")
    order = ranks[start:] + ranks[:start]
    rank_loads = [float(loads[rank]) for rank in order]
    weight = params.load_weight
    miss = params.prefill(0, isl)
    costs = []
    for rank, load in zip(order, rank_loads, strict=True):
        hit = hits.get(rank)
        prefill = miss if hit is None else params.prefill(params.matched(hit, isl), isl)
        costs.append(prefill + weight * load)
    best_cost = min(costs)
    at = costs.index(best_cost) if best_cost < math.inf else 0  # first among equals, from `start`
    best = order[at]
    hit = hits.get(best)
    matched = params.matched(hit, isl) if hit is not None and best_cost < math.inf else 0
    reason = 0 if matched > 0 else 1
    least_load = min(rank_loads)
    if _hotspot(params, rank_loads[at] - least_load, sum(rank_loads) / len(order)):
        at = rank_loads.index(least_load)
        best, reason = order[at], 2
        hit = hits.get(best)
        matched = params.matched(hit, isl) if hit is not None else 0
        best_cost = params.prefill(matched, isl) + weight * least_load
    return RankScore(best, reason, matched, float(best_cost), rank_loads[at])


def _hotspot(params: CostParams, spread: float, mean: float) -> bool:
    """Whether the chosen rank, ``spread`` above the least loaded, is a hot spot."""
    if spread <= 0 or (params.hotspot_spread is None and params.hotspot_relative is None):
        return False
    limit = params.hotspot_spread if params.hotspot_spread is not None else 0.0
    if params.hotspot_relative is not None:
        limit = max(limit, params.hotspot_relative * mean)
    return spread > limit
