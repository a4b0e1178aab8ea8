"""The rank-aware ``/query`` answer rendered in C (``motor_adapter._answer``, docs/native.md).

``motor_adapter.answer.rank_answer`` is the reference: per instance the rank that would serve the
request, Motor's values, the entry, rendered as a dict and encoded.  For the common shape -
every registered instance one fanned-in stream, the "tokens" answer shape, the NPU tier
alone holding blocks - the C helper computes the same answer in one call and writes the
JSON bytes msgspec would write for that dict, so a new prompt's answer costs no Python per
instance.  This module builds its inputs: once per view (the instances' JSON names) and
once per walk result (each instance's hits as tuples, and the metrics series of the ranks
answers name, resolved on first use).  The answer's side effects - the commit of its prompt
to the rank it names, its metrics - are made here in Python (:func:`apply`; the metrics
counted by :class:`AnswerTally` and added to their series when read), as the reference makes
them: the C only reads.  When the helper is not built, ``KVPUB_NATIVE=0`` is
set, or it declines an answer (a figure that would not render exactly), the reference runs.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union

import msgspec

from motor_adapter import native
from motor_adapter.rank_loads import RankLoadBook
from sglang_kvpub.core.rank_cost import CostParams
from sglang_kvpub.core.tiers import TierHit

__all__ = [
    "NATIVE",
    "AnswerTally",
    "RankStatic",
    "RankTable",
    "Rendered",
    "apply",
    "render",
    "renders",
    "static_inputs",
]


NATIVE: Any = native.MODULE  # the router's C helpers, or None (the reference answers)

# (adds of the instance-hit counters, the scored-tokens counter's series or None) of one rank
Cells = tuple[tuple[tuple[Any, int], ...], Any]


class RankStatic(NamedTuple):
    """A view's part of the inputs: the tenant and each instance's name and dp key, JSON-encoded."""

    tenant: bytes
    names: tuple[bytes, ...]
    keys: tuple[bytes, ...]
    streams: tuple[str, ...]  # each instance's stream: its key in RankLoadBook's live loads


# What the answer makes the caller do: the chosen instance, the commit's rank (-1: none) and
# tokens, and (instance, rank, matched) of each instance whose scored rank holds a hit, as
# native int64 triples in one bytes object.
Plan = tuple[int, int, int, bytes]
# The helper's answer, a plain tuple (no object more per answer): its JSON, the largest hit's
# blocks (for the query's hit-blocks metric), until when it holds while the book does not change
# (monotonic: the first fresh instance going stale), and its :data:`Plan`.
Rendered = tuple[bytes, int, float, Plan]


def static_inputs(
    tenant: str,
    instances: Sequence[str],
    dp_keys: Sequence[str],
    streams: Sequence[str],
    every_instance: bool,
    shape: str,
) -> Union[RankStatic, None]:
    """The view's inputs, or None when the helper does not render this view's answers: not
    built, another answer shape, or an instance the rank-aware path does not list (several
    endpoints, or none at this block size: the reference renders those)."""
    if NATIVE is None or shape != "tokens" or not every_instance or not instances:
        return None
    encode = msgspec.json.encode
    names = tuple(encode(i) for i in instances)
    return RankStatic(encode(tenant), names, tuple(encode(k) for k in dp_keys), tuple(streams))


class RankTable:
    """One walk result's part of the inputs (remembered per view by the result's identity):
    the board (one bytes object, ``_answer.c`` reads it front to back: the cost's constants,
    the tenant, and per instance its JSON name and dp key, its longest hit in tokens and its
    ``(rank, npu, cpu, disk)`` hits), and the metrics cells of each instance's ranks
    (``cells[i]``: rank -> :data:`Cells`, filled by ``resolve(i, rank)``)."""

    __slots__ = ("all_hits", "best", "board", "cells", "resolve", "waiting")

    def __init__(
        self,
        static: RankStatic,
        params: CostParams,
        best: Mapping[str, Any],
        all_hits: Mapping[str, Mapping[int, TierHit]],
        block_size: int,
        resolve: Callable[[RankTable, int, int], Cells],
    ) -> None:
        self.best = best  # kept alive: the table is remembered by its id
        self.all_hits = all_hits
        words = array("q", (len(static.names), params.block_size))
        weights = (params.w_npu, params.w_cpu, params.w_disk, params.prefill_load_scale, params.overlap_credit)
        board = bytearray(words.tobytes() + array("d", (*weights, params.load_weight)).tobytes())
        _text(board, static.tenant)
        for name, key, stream in zip(static.names, static.keys, static.streams, strict=True):
            ranks = all_hits.get(stream, {})
            longest = max((h.total_blocks for h in ranks.values()), default=0) * block_size
            board += array("q", (len(name), len(key), longest, len(ranks))).tobytes()
            _text(board, name, counted=False)
            _text(board, key, counted=False)
            board += array(
                "q", [x for rank, h in ranks.items() for x in (rank, h.npu_blocks, h.cpu_blocks, h.disk_blocks)]
            ).tobytes()
        self.board = bytes(board)
        self.cells: tuple[dict[int, Cells], ...] = tuple({} for _ in static.names)
        # The counted instances of this table's answers not yet added to the counters -> how many
        # answers named them (:class:`AnswerTally`).
        self.waiting: dict[bytes, int] = {}
        self.resolve = lambda i, rank: resolve(self, i, rank)


def _text(board: bytearray, text: bytes, counted: bool = True) -> None:
    """``text`` onto the board padded to 8 bytes, after its length when ``counted``."""
    if counted:
        board += array("q", (len(text),)).tobytes()
    board += text + b"\0" * (-len(text) % 8)


def render(
    static: RankStatic,
    table: RankTable,
    book: RankLoadBook,
    now: float,
    isl: int,
    spread: int,
) -> Union[Rendered, Literal[False], None]:
    """The answer (:data:`Rendered`) for a prompt of ``isl`` tokens and tie-break key
    ``spread`` under each instance's loads in ``book`` at ``now`` (monotonic); False when no
    instance has fresh loads (answer by the longest hit); None: run the reference.  Nothing
    is changed: :func:`apply` makes its commit and metrics.  The caller checks
    :func:`renders` of the cost's parameters once."""
    got: Union[Rendered, Literal[False], None] = NATIVE.rank_answer(
        table.board, static.streams, book.live(), now, book.stale_after_s, isl, spread
    )
    return got


def apply(
    static: RankStatic, table: RankTable, book: RankLoadBook, plan: Plan, tally: AnswerTally, prompt: int
) -> None:
    """The side effects of an answer of ``table`` (its :data:`Plan`) for the prompt whose
    commit key is ``prompt``: its metrics counted (each instance's own hit on its scored rank
    and the tokens scored as hits, through ``tally``) and the prompt's uncached tokens
    committed to the rank the answer names (:meth:`RankLoadBook.commit`), as the reference's
    answer does."""
    chosen, rank, tokens, counted = plan
    tally.count(table, counted)
    if rank >= 0:
        book.commit(static.streams[chosen], rank, tokens, prompt)


class AnswerTally:
    """The metrics of rendered answers, kept as counts of each table's counted instances and
    added to the counters' series when they are read (:meth:`fold`, which the counters call
    before every read) or when ``max_waiting`` distinct ones wait.  A new prompt's answer then
    costs one dict add; resolving its instances' series and adding to each one costs a lock
    per series, and a new prompt with rank loads flowing names a new mix of ranks nearly every
    time.  Integer amounts: the series end with the sums they would have had added one by one."""

    def __init__(self, max_waiting: int = 1024) -> None:
        self.max_waiting = max_waiting
        self._tables: list[RankTable] = []  # the tables with counts waiting, each once
        self._waiting = 0

    def count(self, table: RankTable, counted: bytes) -> None:
        """One more answer of ``table`` whose counted instances are ``counted`` (a :data:`Plan`'s)."""
        waiting = table.waiting
        if not waiting:
            self._tables.append(table)
        times = waiting.get(counted)
        if times is None:
            waiting[counted] = 1
            self._waiting += 1
            if self._waiting >= self.max_waiting:
                self.fold()
        else:
            waiting[counted] = times + 1

    def fold(self) -> None:
        """Adds every waiting count to the counters' series (the hit tiers, the scored tokens)."""
        tables, self._tables, self._waiting = self._tables, [], 0
        adds: dict[Any, int] = {}  # one add per series
        for table in tables:
            waiting, table.waiting = table.waiting, {}
            for counted, times in waiting.items():
                triples = array("q", counted)
                for k in range(0, len(triples), 3):
                    i, at, matched = triples[k], triples[k + 1], triples[k + 2]
                    cells = table.cells[i].get(at)
                    if cells is None:
                        cells = table.cells[i][at] = table.resolve(i, at)
                    for cell, amount in cells[0]:
                        adds[cell] = adds.get(cell, 0) + amount * times
                    if matched > 0 and cells[1] is not None:
                        adds[cells[1]] = adds.get(cells[1], 0) + matched * times
        for cell, amount in adds.items():
            cell.inc(amount)


def renders(params: CostParams) -> bool:
    """Whether the helper answers under ``params``: it has no hot-spot guard (the adapter never sets one)."""
    return params.hotspot_spread is None and params.hotspot_relative is None
