"""Cache-aware DP dispatch inside one SGLang instance (plugin option ``dp_dispatch: "cache_aware"``).

SGLang's DataParallelController sends a request without an explicit rank round-robin (or
by load), so a hot prefix lands on the rank that holds it only 1/N of the time.  The
controller process also runs the fan-in, which sees every rank's KV events: this module
keeps a :class:`~sglang_kvpub.core.index.PrefixIndex` of them and sends each request to the
rank with the lowest Motor-style cost::

    matched_r = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
    cost_r    = prefill_load_scale * max(0, isl - overlap_credit * matched_r) + load_weight * load_r

with the router's block keys (:mod:`sglang_kvpub.core.hashing`) and the router's scoring
function (:func:`sglang_kvpub.core.rank_cost.score_ranks`, ties from a start the prompt fixes),
so the rank the adapter scored an instance by is the rank this dispatcher picks when it sees
the same loads.  Hot-spot guard: when the chosen rank's
load exceeds the least loaded candidate's by more than ``max(hotspot_spread,
hotspot_relative * mean load)``, the least loaded candidate wins instead (reason
``hotspot``).  A prompt shorter than one block goes to the least loaded rank (reason
``short_prompt``).

The SGLang edge (the controller hooks and the fan-in feed) lives in
:mod:`sglang_kvpub.engine.dispatch_hook`; this module is the pure policy and names no SGLang
class.  See docs/dispatch.md.

Never blocks: a decision takes the index lock for one walk over the prompt's keys, which
are hashed lazily as the walk pulls them (block 0 before the lock, later blocks in growing
chunks), so hashing stops at the first block no rank holds - a cold prompt hashes one
block, a hit little more than its depth; the fan-in applies events in chunks of at most
``observe_chunk_blocks`` blocks, so the lock is never held for a whole large batch.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import msgspec

from sglang_kvpub.core.hashing import BASE_SEED, lora_seed, sequence_keys
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.core.pending import PendingPrefixes
from sglang_kvpub.core.rank_cost import (
    DEFAULT_HOTSPOT_RELATIVE,
    DEFAULT_HOTSPOT_SPREAD,
    CostParams,
    score_ranks,
    spread_key,
    spread_start,
    with_pending,
)
from sglang_kvpub.wire import AllBlocksCleared, BlockStored, Event, EventBatch

__all__ = [
    "REASON_CACHE_HIT",
    "REASON_NO_HIT",
    "REASON_HOTSPOT",
    "REASON_SHORT_PROMPT",
    "REASON_NO_CANDIDATES",
    "REASON_NO_TOKENS",
    "REASON_EXPLICIT",
    "REASON_ERROR",
    "REASONS",
    "DispatchDecision",
    "InflightLoad",
    "CacheAwareDispatcher",
]

log = logging.getLogger(__name__)

# Decision reasons (metrics keys).  ``rank`` is None for the last four: SGLang's policy runs.
REASON_CACHE_HIT = "cache_hit"  # lowest cost, some rank holds a prefix
REASON_NO_HIT = "no_hit"  # no rank holds block 0: lowest cost = least loaded
REASON_HOTSPOT = "hotspot"  # guard: the cheapest rank was overloaded, least loaded instead
REASON_SHORT_PROMPT = "short_prompt"  # shorter than one block: no hit anywhere, the least loaded rank
REASON_NO_CANDIDATES = "no_candidates"  # no active rank with a load figure
REASON_NO_TOKENS = "no_tokens"  # input_embeds / multimodal-only request: nothing to hash
REASON_EXPLICIT = "explicit"  # routed_dp_rank set: SGLang routed it (counted by the hook)
REASON_ERROR = "error"  # the dispatcher failed: SGLang's policy ran
REASONS = (
    REASON_CACHE_HIT,
    REASON_NO_HIT,
    REASON_HOTSPOT,
    REASON_SHORT_PROMPT,
    REASON_NO_CANDIDATES,
    REASON_NO_TOKENS,
    REASON_EXPLICIT,
    REASON_ERROR,
)

LOCAL_INSTANCE = "local"
_NO_HIT = (0, 0, 0)
_SCORE_REASONS = (REASON_CACHE_HIT, REASON_NO_HIT, REASON_HOTSPOT)  # rank_cost.REASON_CODES, as decision reasons


# --------------------------------------------------------------------------- decisions


class DispatchDecision(NamedTuple):
    """One dispatch: ``rank`` None means "SGLang's own policy"; ``matched_tokens`` and the
    tier blocks are the chosen rank's hit; ``cost``/``load`` its figures (None if unranked).
    A named tuple, not a frozen dataclass: made once per request on the controller's hot
    path, where a dataclass's per-field ``object.__setattr__`` costs a microsecond."""

    rank: int | None
    reason: str
    isl: int
    matched_tokens: int = 0
    npu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0
    load: float | None = None
    cost: float | None = None
    pending_tokens: int = 0  # of matched_tokens, those the rank is still prefilling (pending prefixes)

    def log_line(self) -> str:
        """Motor's ``scheduled`` line shape, logged by the controller at info level per request."""
        if self.rank is None:
            return f"dp_dispatch policy=default matched=None reason={self.reason} isl={self.isl}"
        return (
            f"dp_dispatch policy=cache_aware dp_rank={self.rank} reason={self.reason} isl={self.isl} "
            f"matched={self.matched_tokens} hbm={self.npu_blocks} cpu={self.cpu_blocks} disk={self.disk_blocks} "
            f"load={self.load:g} score={self.cost:g}"
        )


class InflightLoad:
    """Fallback load per rank when SGLang's load snapshots are missing or stale: the
    prefill tokens this controller dispatched, decaying with ``half_life_s`` (the
    controller never sees completions, so "in flight" is estimated, not counted)."""

    def __init__(self, dp_size: int, half_life_s: float = 2.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self._rate = math.log(2.0) / half_life_s
        self._values = [0.0] * dp_size
        self._stamp: float | None = None

    def _decay(self, now: float) -> None:
        if self._stamp is None:
            self._stamp = now
        elapsed = now - self._stamp
        if elapsed > 0:
            factor = math.exp(-self._rate * elapsed)
            self._values = [v * factor for v in self._values]
            self._stamp = now

    def add(self, rank: int, tokens: float, now: float | None = None) -> None:
        self._decay(time.monotonic() if now is None else now)
        if 0 <= rank < len(self._values):
            self._values[rank] += tokens

    def values(self, now: float | None = None) -> list[float]:
        self._decay(time.monotonic() if now is None else now)
        return list(self._values)


class CacheAwareDispatcher:
    """Picks a DP rank per request from the ranks' cached prefixes and loads (module docstring).

    ``observe`` is called from the fan-in thread, ``choose`` from the controller loop; both
    are thread safe.  ``index`` may be shared (then ``instance`` names this engine in it).
    """

    def __init__(
        self,
        dp_size: int,
        block_size: int,
        *,
        load_weight: float = 1.0,
        prefill_load_scale: float = 1.0,
        overlap_credit: float = 1.0,
        hotspot_spread: float | None = DEFAULT_HOTSPOT_SPREAD,
        hotspot_relative: float | None = DEFAULT_HOTSPOT_RELATIVE,
        w_npu: float = 1.0,
        w_cpu: float = 1.0,
        w_disk: float = 0.0,
        index: PrefixIndex | None = None,
        instance: str = LOCAL_INSTANCE,
        capacity_blocks: int | None = 2_000_000,
        observe_chunk_blocks: int = 64,
        pending: PendingPrefixes | bool = False,
    ) -> None:
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        if index is not None and index.block_size != block_size:
            raise ValueError(f"index block_size {index.block_size} != dispatcher block_size {block_size}")
        self.dp_size = dp_size
        self.block_size = block_size
        self.load_weight = load_weight
        self.prefill_load_scale = prefill_load_scale
        self.overlap_credit = overlap_credit
        self.hotspot_spread = hotspot_spread
        self.hotspot_relative = hotspot_relative
        self.weights = (w_npu, w_cpu, w_disk)
        self.params = CostParams(
            block_size,
            w_npu,
            w_cpu,
            w_disk,
            prefill_load_scale,
            overlap_credit,
            load_weight,
            hotspot_spread,
            hotspot_relative,
        )
        self.index = (
            index
            if index is not None
            else PrefixIndex(block_size, capacity_blocks=capacity_blocks, npu_walk_table=True)
        )
        self.instance = instance
        self.observe_chunk_blocks = max(1, observe_chunk_blocks)
        self.inflight = InflightLoad(dp_size)
        # What each rank is prefilling or has queued (docs/dispatch.md, "Pending prefixes").
        self.pending: PendingPrefixes | None = (
            pending if isinstance(pending, PendingPrefixes) else PendingPrefixes(dp_size) if pending else None
        )
        self._anonymous = itertools.count()  # ids of requests chosen without one
        # Per rank: (wall time, tokens) committed since SGLang's last load snapshot of it.
        self.commits: list[list[tuple[float, float]]] = [[] for _ in range(dp_size)]
        self._rank_list = list(range(dp_size))  # never handed out for mutation
        self._counts: collections.Counter[str] = collections.Counter()
        self._matched_tokens = 0
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ events

    def observe(self, batch: EventBatch, dp_rank: int | None = None) -> None:
        """One rank batch (``dp_rank``, else ``batch.dp_rank``, else 0) into the index, in
        chunks of at most ``observe_chunk_blocks`` blocks so ``choose`` never waits long."""
        rank = dp_rank if dp_rank is not None else (batch.dp_rank if batch.dp_rank is not None else 0)
        chunk: list[Event] = []
        blocks = 0
        for event in batch.events:
            for piece in self._pieces(event):
                chunk.append(piece)
                blocks += 1 if isinstance(piece, AllBlocksCleared) else len(piece.block_hashes)
                if blocks >= self.observe_chunk_blocks:
                    self.index.apply_batch(self.instance, EventBatch(batch.ts, chunk, rank), rank)
                    chunk, blocks = [], 0
        if chunk:
            self.index.apply_batch(self.instance, EventBatch(batch.ts, chunk, rank), rank)
        pending = self.pending
        if pending is not None and not pending.empty((rank,)):
            pending.settle(rank, lambda key: rank in self.index.longest_prefixes(self.instance, (key,)))

    def _pieces(self, event: Event) -> Iterable[Event]:
        """A merged store longer than a chunk, split into parent-linked stores."""
        size = self.observe_chunk_blocks
        if type(event) is not BlockStored or len(event.block_hashes) <= size:
            return (event,)
        pieces: list[Event] = []
        hashes = event.block_hashes
        tokens_per_block = event.block_size or self.block_size
        for start in range(0, len(hashes), size):
            end = min(start + size, len(hashes))
            parent = event.parent_block_hash if start == 0 else hashes[start - 1]
            pieces.append(
                msgspec.structs.replace(
                    event,
                    block_hashes=hashes[start:end],
                    parent_block_hash=parent,
                    token_ids=event.token_ids[start * tokens_per_block : end * tokens_per_block],
                )
            )
        return pieces

    def rank_restarted(self, dp_rank: int) -> None:
        """The rank's cache is gone (new rank epoch): forget what it held and was prefilling."""
        self.index.clear_rank(self.instance, dp_rank)
        if self.pending is not None:
            self.pending.clear_rank(dp_rank)

    def request_ended(self, rid: Hashable) -> bool:
        """The engine ended request ``rid`` before its pages were published (an abort): its
        prefix is no longer pending.  False when it was not."""
        return self.pending.drop(rid) if self.pending is not None else False

    # ------------------------------------------------------------------ decisions

    def choose(
        self,
        token_ids: Sequence[int],
        loads: Sequence[float],
        *,
        candidates: Sequence[int] | None = None,
        lora_name: str | None = None,
        spread: int | None = None,
        rid: Hashable | None = None,
    ) -> DispatchDecision:
        """The rank for a prompt given per-rank ``loads`` (indexed by rank; any unit, the
        same as the prefill cost's - SGLang's token counts by default).  ``candidates``:
        the ranks allowed (default all with a load figure).  ``spread``: the prompt's
        tie-break key (:func:`~sglang_kvpub.core.rank_cost.spread_key`, computed when not
        given).  ``rid``: the request's id, under which its prefix is pending on the chosen
        rank until that rank publishes it (:meth:`request_ended` drops it).  Counted per reason."""
        decision, keys = self._decide(token_ids, loads, candidates, lora_name, spread)
        self.count(decision.reason, decision.matched_tokens)
        pending = self.pending
        if pending is not None and decision.rank is not None and decision.isl >= self.block_size:
            self._note_pending(pending, decision.rank, decision, keys, token_ids, lora_name, rid)
        return decision

    def _note_pending(
        self,
        pending: PendingPrefixes,
        rank: int,
        decision: DispatchDecision,
        keys: list[int] | None,
        token_ids: Sequence[int],
        lora_name: str | None,
        rid: Hashable | None,
    ) -> None:
        """The chosen rank will hold the prompt's blocks once it has prefilled them: pending
        there, unless it holds (or is already prefilling) them all."""
        blocks = decision.isl // self.block_size
        held = decision.npu_blocks + decision.cpu_blocks + decision.disk_blocks
        if decision.pending_tokens and keys is not None:
            # It waits for a prefill already there: the engine counts it in the rank's load as
            # if it computed those tokens, the rank will not (PendingPrefixes.waits).
            pending.ride(rank, keys, decision.npu_blocks, decision.pending_tokens)
        if held >= blocks:
            return
        if keys is None:
            keys = sequence_keys(token_ids, self.block_size, lora_name)
        if pending.depths(keys, (rank,)).get(rank, 0) >= blocks:
            return
        pending.add(next(self._anonymous) if rid is None else rid, rank, keys)

    def count(self, reason: str, matched_tokens: int = 0) -> None:
        with self._stats_lock:
            self._counts[reason] += 1
            self._matched_tokens += matched_tokens

    def _decide(
        self,
        token_ids: Sequence[int],
        loads: Sequence[float],
        candidates: Sequence[int] | None,
        lora_name: str | None,
        spread: int | None = None,
    ) -> tuple[DispatchDecision, list[int] | None]:
        """The decision, and the prompt's block keys when pending prefixes needed them."""
        isl = len(token_ids)
        ranks = self._ranks(candidates, len(loads))
        if not ranks:
            return DispatchDecision(None, REASON_NO_CANDIDATES, isl), None
        short = isl < self.block_size
        # A prompt shorter than one block holds no block anywhere: the least loaded rank.
        hits = cached = {} if short else self._hits(token_ids, lora_name)
        keys = None
        pending = self.pending
        if pending is not None and pending.credited():
            loads = pending.waits(loads)  # riders are not the rank's work (PendingPrefixes.waits)
        if not short and pending is not None and not pending.empty(ranks):
            keys = sequence_keys(token_ids, self.block_size, lora_name)
            ahead = pending.depths(keys, ranks)
            if ahead:
                hits = with_pending(hits, ahead, self.params)
        # Equal costs go to the first rank from a start the prompt fixes (the adapter computes
        # the same), so distinct cold prompts spread over the ranks and both halves agree.
        key = spread_key(token_ids, self.block_size) if spread is None else spread
        best, reason, matched, cost, load = score_ranks(
            hits, loads, ranks, spread_start(key, len(ranks)), isl, self.params
        )
        npu, cpu, disk = hits.get(best, _NO_HIT)
        why = REASON_SHORT_PROMPT if short and reason != 2 else _SCORE_REASONS[reason]
        ahead_tokens = 0
        if hits is not cached and matched:
            held = cached.get(best)
            ahead_tokens = max(0, matched - (self.params.matched(held, isl) if held is not None else 0))
        decision = DispatchDecision(best, why, isl, matched, npu, cpu, disk, float(load), float(cost), ahead_tokens)
        return decision, keys

    def _ranks(self, candidates: Sequence[int] | None, size: int) -> list[int]:
        """The candidate ranks with a load figure (the caller's list when all have one)."""
        if candidates is None:
            if size >= self.dp_size:
                return self._rank_list
            candidates = self._rank_list
        elif candidates == self._rank_list and size >= self.dp_size:
            return self._rank_list  # every rank active (the usual case)
        elif type(candidates) is list and candidates and min(candidates) >= 0 and max(candidates) < size:
            return candidates
        return [r for r in candidates if 0 <= r < size]

    def _hits(self, token_ids: Sequence[int], lora_name: str | None) -> dict[int, tuple[int, int, int]]:
        """``rank -> (npu, cpu, disk)`` blocks of the prompt, for the ranks holding block 0.
        Its blocks are hashed as the index walk reaches them (in C when the helpers are
        built, reading SGLang's ``array("q")`` as it is), so a cold prompt hashes one block
        and a hit little more than its depth."""
        seed = lora_seed(lora_name) if lora_name else BASE_SEED
        return self.index.longest_prefixes_tokens(self.instance, token_ids, seed=seed)

    # ------------------------------------------------------------------ metrics

    def decision_counts(self) -> dict[str, int]:
        """Decisions per reason since the start (the reasons seen so far)."""
        with self._stats_lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        """Decisions per reason (every reason present), matched tokens, index size."""
        with self._stats_lock:
            decisions = {reason: self._counts.get(reason, 0) for reason in REASONS}
            matched = self._matched_tokens
        index = self.index.stats()
        return {
            "decisions": decisions,
            "decisions_total": sum(decisions.values()),
            "matched_tokens_total": matched,
            "index_blocks": index.blocks,
            "index_orphans": index.orphans,
            "index_ignored_block_size": index.ignored_block_size,
        }
