"""What each instance's ranks are prefilling, as hits a query can count on.

The plugin's dispatcher records the block keys of the prompts each rank is prefilling or has
queued, and the instance's rank-load message carries them (``wire.RankLoad.pending``;
:class:`~motor_adapter.rank_loads.RankLoadBook` keeps the last ones of each instance).  A
prompt sharing them will find them cached on that rank once those prefills end, at the cost
of the wait already in the rank's load: the same merge the dispatcher makes
(:func:`sglang_kvpub.core.rank_cost.with_pending`), so the answer scores each instance by the
rank its dispatcher will take, and Motor's unchanged cost picks the instance whose rank will
hold the prefix soonest.  Figures older than the book's ``stale_after_s`` count for nothing.

Only what the instance reports.  What the adapter's own answers sent somewhere since is
counted elsewhere, and only for the same whole prompt: an answer's commit claims its prompt
on the rank it names until the instance's next report (``RankLoadBook.claim``), and
``motor_adapter/query.py`` answers that prompt asked again - the next member of a GRPO
group, as well as a retry or a poll - with the rank holding all of it.  A prompt merely
sharing a prefix with one in flight within that report period does not follow it here; the
instance's dispatcher still sends it to the rank prefilling it.
"""

from __future__ import annotations

from collections.abc import Mapping

from motor_adapter.rank_loads import RankLoadBook
from sglang_kvpub.core.tiers import TierHit

__all__ = ["merge_pending", "prompt_pending"]


def prompt_pending(book: RankLoadBook, keys: list[int], now: float) -> bool:
    """Whether a fresh report names the prompt's first block as pending on some rank: then
    the query's hits need :func:`merge_pending` (one set lookup per instance with pending)."""
    pending = book.pending
    if not pending or not keys:
        return False
    first, stale = keys[0], book.stale_after_s
    fresh = (ranks for received, ranks in list(pending.values()) if now - received <= stale)
    return any(first in held for ranks in fresh for held in ranks)


def merge_pending(
    hits: Mapping[str, Mapping[int, TierHit]], book: RankLoadBook, keys: list[int], now: float
) -> Mapping[str, Mapping[int, TierHit]]:
    """``hits`` (instance -> rank -> hit) with each rank's pending prefix of the prompt where it
    is longer than the rank's hit (counted on the device, as the dispatcher counts it)."""
    if not keys:
        return hits
    depths: dict[str, dict[int, int]] = {}
    stale = book.stale_after_s
    for instance, (received, ranks) in list(book.pending.items()):
        if now - received > stale:
            continue
        for rank, held in enumerate(ranks):
            depth = 0
            for key in keys:
                if key not in held:
                    break
                depth += 1
            if depth:
                depths.setdefault(instance, {})[rank] = depth
    if not depths:
        return hits
    merged = dict(hits)
    for instance, ranks_of in depths.items():
        own = hits.get(instance, {})
        changed: dict[int, TierHit] | None = None
        for rank, depth in ranks_of.items():
            hit = own.get(rank)
            if hit is None or depth > hit.total_blocks:
                if changed is None:
                    changed = dict(own)
                changed[rank] = TierHit(depth, 0, 0)
        if changed is not None:
            merged[instance] = changed
    return merged
