"""The ``/query`` path's one cache: what was computed for one walk result of the index.

The index's one-pass walk (``KvAffinity.best_for_keys``, ``PrefixIndex.deepest_npu``) hands
out the same mapping object for queries whose walks end alike, and a new object once
anything that walk read changes (a block stored or removed, a worker coming or going).  So
the one invalidation rule: **an entry holds for exactly the walk result object it was made
from**.  The entry keeps that object alive, so the object's ``id()`` - the entry's key - can
never be reused by another object while the entry exists.  A registration change drops the
whole cache with its view (:class:`motor_adapter.query.View`); past ``max_entries`` it starts
over.  What an entry holds (each filled on first use):

- ``longest_hit``: the longest-hit answer and its metrics tally - a function of the walk
  result alone (the view fixes the instances, block size and answer shape);
- ``hits``: the per-rank hits of the walk's ends (``KvAffinity.hits_for_keys``), which the
  rank-aware answer scores;
- ``table``: the C renderer's per-walk inputs (:class:`motor_adapter.rank_render.RankTable`);
- ``last``: the last rank-aware answer of it (rendered in C or computed in Python), with the
  inputs besides the walk result it is a function of (the prompt's length and tie-break key,
  the load book's change count) and until when its loads stay fresh: the same inputs again
  give it again, its side effects made again;
- ``claimed``: per prompt asked while claimed (``RankLoadBook.claim``, by its last block
  key), a :class:`ClaimedSlot`: the table and last answer of these walk ends with the claimed
  rank holding the whole prompt, kept as ``table`` and ``last`` are (a prompt's key fixes its
  blocks, so the table holds while the claim names the same rank; bounded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

from motor_adapter import rank_render
from motor_adapter.adapter_metrics import HitTally
from motor_adapter.answer import Answer
from motor_adapter.rank_loads import Claim
from motor_adapter.scoring import TierCounts

__all__ = ["ClaimedSlot", "Effects", "LastRender", "QueryCache", "WalkEntry"]

# The reference answer's side effects, bound once: called with the prompt's commit key.
Effects = Callable[[int], None]


class LastRender(NamedTuple):
    """A rank-aware answer and what it is a function of besides the walk result."""

    isl: int
    spread: int
    changes: int  # RankLoadBook.changes read before rendering: every report, commit and forget moves it
    until: float  # monotonic: the first fresh instance going stale
    blocks: int  # the largest hit's blocks (the query's hit-blocks metric)
    answer: Answer
    # Its commit and metrics, made again for each query it answers: the reference's bound
    # (effects), or the C answer's table and plan (rank_render.apply makes them; no object
    # per answer on the path every new prompt takes).
    effects: Union[Effects, None] = None
    table: Union[rank_render.RankTable, None] = None
    plan: Union[rank_render.Plan, None] = None

    def holds(self, isl: int, spread: int, changes: int, now: float) -> bool:
        return self.isl == isl and self.spread == spread and self.changes == changes and now < self.until


class ClaimedSlot:
    """One claimed prompt's part of a :class:`WalkEntry`: the claim it was last answered
    under, the C renderer's table of the walk's hits with the claim's rank holding the whole
    prompt (None until rendered), and the last answer under that claim."""

    __slots__ = ("claim", "last", "table")

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.table: Union[rank_render.RankTable, None] = None
        self.last: Union[LastRender, None] = None


class WalkEntry:
    """The cached answers of one walk result (``walk``, kept alive by the entry)."""

    __slots__ = ("claimed", "hits", "last", "longest_hit", "table", "walk")

    def __init__(self, walk: Mapping[str, Any]) -> None:
        self.walk = walk
        self.longest_hit: Union[tuple[Answer, HitTally], None] = None
        self.hits: Union[Mapping[str, Mapping[int, TierCounts]], None] = None
        self.table: Union[rank_render.RankTable, None] = None
        self.last: Union[LastRender, None] = None
        self.claimed: Union[dict[int, ClaimedSlot], None] = None  # made on the first claimed prompt


class QueryCache:
    """Walk result -> :class:`WalkEntry`, bounded (see the module's invalidation rule)."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: dict[int, WalkEntry] = {}

    def entry(self, walk: Mapping[str, Any]) -> WalkEntry:
        """The entry of ``walk``, made empty on its first sight."""
        found = self._entries.get(id(walk))  # the entry holds `walk`: this id is no other object's
        if found is None:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            found = self._entries[id(walk)] = WalkEntry(walk)
        return found

    def __len__(self) -> int:
        return len(self._entries)
