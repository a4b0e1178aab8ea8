"""Prefix index over KV events: which (instance, dp_rank) holds how much of a prompt, per tier.

Shared core (no SGLang, no torch): the router's ``motor_adapter`` and the in-instance
dispatcher both use it.

Keys.  A block's key is its chained content hash (:mod:`sglang_kvpub.core.hashing`): the local
XXH3-64 (seed 1337, shifted by ``lora_seed(event.lora_name)``) of its token ids, chained
from the parent's key; a block without parent hangs under the seed.  ``cache_salt`` and
``lora_id`` are not part of the key (a query cannot know them).  The engine's block hash
is an opaque id, kept per worker ``(instance, dp_rank)`` and per tier only to resolve
``parent_block_hash`` and removals.  Engine hashes are normalised to u64, so an engine
that sends i64 and one that sends u64 forms of the same value are the same block.

Layout.  Workers get small integer ids in pages of 8 per instance (one byte of a mask
belongs to one instance, so a query's hits are emitted a byte at a time), recycled by
:meth:`PrefixIndex.clear_instance`, lowest page first, to keep masks short.  Per tier,
one dict maps a key to the workers holding it: ``~wid`` (a negative int) for a single
holder - most blocks have one, and a small int costs far less than a wide bitmask - else
an int bitmask of two or more.  Per worker and tier, one map engine hash -> key: with the
C helpers a ``_native.HashKeys`` (both u64 in one 16-byte slot of an open-addressing table,
load <= 0.75, no int object per engine hash), else a dict.  A query walks the prompt's keys
once, ANDing masks, and only touches individual workers when they leave a tier phase.

Memory (bench/memory.py on bench/scale.py's workload, every user block held by one rank):
~133 bytes per (worker, block) entry - the key's int object (48, pymalloc), its slot in the
tier dict (~52), the engine-hash slot (~33) - which ``stats().bytes_per_entry`` counts.
Removals grow the tier dict: CPython resizes a dict whose entry array filled up to 3x its
live keys, so under an LRU's churn its table doubles once (~104 per entry, ~185 in all).
With dict maps (the Python fallback) add an int and a dict slot per engine hash (~187
after a fill).

Tier walk.  Per worker: the longest prefix from block 0 on NPU, then its continuation on
CPU, then on disk (exclusive split); a block that is not in the current phase's tier ends
that phase, and a block absent from every remaining phase ends the walk.  Blocks are
never borrowed across ranks: each rank's hit counts only what that rank holds itself.

Bounded memory.  With ``capacity_blocks``, the index keeps at most that many entries
(worker x tier x block).  When exceeded, it evicts a batch (1/16 of the capacity, so the
cost is amortised) of least-recently stored-or-queried keys from every tier, in
proportion to the tier sizes.  Recency is each tier dict's insertion order: a store moves
its keys to the end deepest-first and then touches the parent, a query touches the
matched keys deepest-first, so within a touched chain descendants are evicted before
their ancestors.  A child whose ancestor was evicted first can remain indexed, but it can
never be a hit: a query walks from block 0 and stops at the first missing key; the child
ages out in turn.

Threads.  One lock, held for a whole batch or one query walk (a query of token ids
hashes them under it, a chunk at a time as the walk reaches them, so hashing stops at the
first block no worker holds).  Any number of writer threads (one per stream) and reader
threads may call in; a query sees each batch either entirely or not at all.

Why one module over 450 lines: :class:`PrefixIndex` is the query hot path of both the router
and the in-instance dispatcher; its walk inlines the key chaining and the mask arithmetic
over the layout above, and splitting the class would put attribute lookups and calls back
into the per-block loop that bench/index.py measures.
"""

from __future__ import annotations

import heapq
import logging
import sys
import threading
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from types import MappingProxyType
from typing import TypeVar

from sglang_kvpub.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

from . import hashing
from .hashing import (  # the Python walk of longest_prefixes_tokens inlines the chaining
    BASE_SEED,
    _pack_u64,
    _xxh3,
    chained_block_keys,
    lora_seed,
    sequence_keys,
    tokens_u32,
)
from .tiers import TIER_CPU, TIER_DISK, TIER_NPU, TIERS, TierHit, tier_of_medium

__all__ = [
    "TIER_NPU",
    "TIER_CPU",
    "TIER_DISK",
    "TIERS",
    "tier_of_medium",
    "TierHit",
    "ApplyResult",
    "IndexStats",
    "PrefixIndex",
]

log = logging.getLogger(__name__)
_Out = TypeVar("_Out")  # what an NPU walk emits into (see PrefixIndex._npu_walk)

_U64 = (1 << 64) - 1
_NATIVE_HELD_LIMIT = 1 << 64  # the C walk takes worker masks of at most 64 bits
_WIDE_WORDS_MAX = 16  # the C wide walk's masks: at most 16 u64 words (1024 workers)
_DEEPEST_SEEN_MAX = 4096  # remembered walk ends -> per-instance deepest ranks
_WALKS_MAX = 1024  # deepest_npu's walks remembered while the index is unchanged
_UNSEEN = object()  # deepest_npu: keys not walked since the index last changed
_NO_HITS: Mapping[str, tuple[int, TierHit]] = MappingProxyType({})  # deepest_npu's one answer for no hit
_EVICT_FRACTION = 16  # evict capacity/16 entries at a time: amortises the per-worker scan
_FIRST_CHUNK_BLOCKS = 4  # lazy hashing, doubling: a cold query hashes little, a deep one ~once
_PAGE = 8  # worker ids per page: one byte of a mask, all of one instance

_TIER_INDEX = {TIER_NPU: 0, TIER_CPU: 1, TIER_DISK: 2}

# A worker's engine hash -> key map per tier: a dict, or the C helpers' HashKeys (the same
# calls: [] get pop in len iteration values items clear, plus add_new), which keeps both
# u64 in one 16-byte slot and makes no int object per engine hash.
_EngineMap = MutableMapping[int, int]


@dataclass
class ApplyResult:
    """What one event or batch did.  ``stored``/``removed`` count (worker, tier, block)
    entries added/dropped; ``orphans`` and ``ignored_block_size`` count skipped events."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    ignored_block_size: int = 0
    orphans: int = 0
    unknown_removals: int = 0

    def add(self, other: ApplyResult) -> None:
        self.stored += other.stored
        self.removed += other.removed
        self.cleared += other.cleared
        self.ignored_block_size += other.ignored_block_size
        self.orphans += other.orphans
        self.unknown_removals += other.unknown_removals


@dataclass
class IndexStats:
    """Counters and size.  ``blocks`` = entries (worker x tier x block); ``keys`` = distinct
    (tier, key) pairs.  ``bytes_per_entry`` is an estimate: the sizes of every dict table
    (``sys.getsizeof``) plus 64-bit ints and holders values (sampled) at their ALLOCATED
    size (pymalloc rounds to 16 bytes), divided by ``blocks``.  ``bench/index.py`` also
    measures the requested bytes with tracemalloc, which does not see that rounding."""

    blocks: int
    keys: int
    workers: int
    bytes_per_entry: float
    tier_blocks: dict[str, int] = field(default_factory=dict)
    ignored_block_size: int = 0
    orphans: int = 0
    evicted: int = 0
    unknown_removals: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    queries: int = 0


class _Worker:
    """One (instance, dp_rank): its bit and, per tier, engine hash -> key (``new_map()``: a
    ``_native.HashKeys`` with the C helpers, else a dict)."""

    __slots__ = ("bit", "dp_rank", "dups", "instance", "maps", "orphan_logged", "single", "wid")

    def __init__(self, wid: int, instance: str, dp_rank: int, new_map: Callable[[], _EngineMap]) -> None:
        self.wid = wid
        self.bit = 1 << wid
        self.single = ~wid  # one shared int object: single-holder keys cost no int of their own
        self.instance = instance
        self.dp_rank = dp_rank
        self.maps: list[_EngineMap] = [new_map(), new_map(), new_map()]
        # key -> number of EXTRA engine hashes of this worker/tier with that key (the bit is
        # set once; it is cleared only when the last one goes)
        self.dups: list[dict[int, int]] = [{}, {}, {}]
        self.orphan_logged = False


def _mask(holders: int) -> int:
    """The bitmask of a holders value (``~wid`` for one worker, else a bitmask)."""
    return holders if holders >= 0 else 1 << ~holders


def _holders(mask: int) -> int:
    """The compact holders value of a non-zero bitmask."""
    return ~(mask.bit_length() - 1) if mask & (mask - 1) == 0 else mask


def _recorded(keys: Iterable[int], into: list[int]) -> Iterator[int]:
    """``keys``, each appended to ``into`` as it is pulled."""
    for key in keys:
        into.append(key)
        yield key


def _token_key_chunks(tokens: Sequence[int], block_size: int, seed: int, blocks: int) -> Iterator[list[int]]:
    """:func:`_key_chunks` of token ids: a list is packed a chunk at a time, a buffer at once
    (a 4-byte one without copying)."""
    if type(tokens) is not list:
        yield from _key_chunks(memoryview(tokens_u32(tokens, blocks * block_size)).cast("B"), block_size, seed, blocks)
        return
    key, start, end = seed, 0, _FIRST_CHUNK_BLOCKS
    while start < blocks:
        end = min(end, blocks)
        raw = tokens_u32(tokens[start * block_size : end * block_size])
        keys = chained_block_keys(raw, block_size, seed, key, 0, end - start)
        key = keys[-1]
        yield keys
        start, end = end, 2 * end


def _u32_view(tokens: Sequence[int], limit: int) -> memoryview:
    """The first ``limit`` ids as u32 bytes (``hashing.tokens_u32``); u32 bytes as they are."""
    return tokens if type(tokens) is memoryview else memoryview(tokens_u32(tokens, limit)).cast("B")


def _key_chunks(raw: memoryview, block_size: int, seed: int, blocks: int) -> Iterator[list[int]]:
    """A prompt's chained keys in growing chunks (16 blocks, then doubling), hashed lazily."""
    key, start, end = seed, 0, _FIRST_CHUNK_BLOCKS
    while start < blocks:
        end = min(end, blocks)
        keys = chained_block_keys(raw, block_size, seed, key, start, end)
        key = keys[-1]
        yield keys
        start, end = end, 2 * end


_BYTE_BITS = tuple(tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256))


def _bits(mask: int) -> Iterator[int]:
    """Positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Exact prefix index per (instance, dp_rank, tier); see the module docstring."""

    def __init__(
        self,
        block_size: int,
        capacity_blocks: int | None = None,
        default_medium: str = MEDIUM_GPU,
        *,
        npu_walk_table: bool = False,
    ) -> None:
        """``npu_walk_table``: keep the NPU tier's holders also in the C helpers' flat table
        (``KeyMasks``, docs/native.md) that the fused token walk reads with one probe per
        block - for an index queried by token ids (the in-instance dispatcher's); it costs
        ~16-32 bytes per NPU key and a little ingest.  Ignored without the C helpers."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.default_medium = default_medium
        self._default_tier = _TIER_INDEX[tier_of_medium(default_medium)]
        self._lock = threading.Lock()
        self._masks: list[dict[int, int]] = [{}, {}, {}]  # per tier: key -> holders (see _mask)
        self.npu_walk_table = npu_walk_table and hashing.NATIVE is not None
        if self.npu_walk_table:
            self._masks[0] = hashing.NATIVE.KeyMasks()  # a dict, mirrored for npu_walk
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._new_map: Callable[[], _EngineMap] = hashing.NATIVE.HashKeys if hashing.NATIVE is not None else dict
        self._by_wid: list[_Worker | None] = []
        self._rank_of: list[int] = []  # wid -> dp_rank (hot emission path)
        self._pages: list[str] = []  # wid // 8 -> the instance owning those 8 worker ids ("": free)
        self._free_pages: list[int] = []  # heap: lowest first, to keep masks short
        self._inst_pages: dict[str, list[int]] = {}
        self._inst_masks: dict[str, int] = {}  # instance -> bits of its workers
        self._allowed: tuple[object, int] = ((), 0)  # (the last instances collection asked, its mask)
        self._deepest_seen: dict[tuple[tuple[int, int], ...], dict[str, tuple[int, TierHit]]] = {}
        # deepest_npu's walks since the index last changed (every writer clears it): last key ->
        # (allowed workers, the keys walked, the answer, the depth), None after one walk
        self._walks: dict[int, tuple[int, Sequence[int], Mapping[str, tuple[int, TierHit]], int] | None] = {}
        # deepest_npu's last C walk since the index last changed: (allowed workers, a copy of its
        # keys, its ends) - the next walk for the same workers starts where its keys part from them
        self._prior_walk: tuple[int, list[int], tuple[tuple[int, int], ...]] | None = None
        self._entries = [0, 0, 0]
        self._hits: dict[tuple[int, int, int], TierHit] = {}
        self._size_logged: set[str] = set()
        self._totals = ApplyResult()
        self._evicted = 0
        self._queries = 0

    # ------------------------------------------------------------------ writers

    def apply_batch(self, instance: str, batch: EventBatch, dp_rank: int | None = None) -> ApplyResult:
        """Applies every event of a batch for ``dp_rank`` (else ``batch.dp_rank``, else 0)."""
        rank = dp_rank if dp_rank is not None else (batch.dp_rank if batch.dp_rank is not None else 0)
        result = ApplyResult()
        with self._lock:
            self._forget_walks()  # the index changes: no remembered walk holds
            worker = self._worker(instance, rank)
            for event in batch.events:
                self._apply(worker, event, result)
            self._finish(result)
        return result

    def apply_event(self, instance: str, dp_rank: int, event: Event) -> ApplyResult:
        result = ApplyResult()
        with self._lock:
            self._forget_walks()
            self._apply(self._worker(instance, dp_rank), event, result)
            self._finish(result)
        return result

    def clear_rank(self, instance: str, dp_rank: int, medium: str | None = None) -> None:
        """Forgets what a rank holds: in every tier, or only in ``medium``'s tier."""
        with self._lock:
            self._forget_walks()
            worker = self._workers.get((instance, dp_rank))
            if worker is None:
                return
            if medium is None:
                for tier in range(3):
                    self._clear_tier(worker, tier)
            else:
                self._clear_tier(worker, _TIER_INDEX[tier_of_medium(medium)])

    def clear_instance(self, instance: str) -> None:
        """Forgets an instance and its ranks; their worker ids are recycled."""
        with self._lock:
            self._forget_walks()
            for key in [k for k in self._workers if k[0] == instance]:
                worker = self._workers.pop(key)
                for tier in range(3):
                    self._clear_tier(worker, tier)
                self._by_wid[worker.wid] = None
                self._rank_of[worker.wid] = -1
            self._inst_masks.pop(instance, None)
            self._allowed = ((), 0)
            self._deepest_seen.clear()  # ends name other workers now
            for page in self._inst_pages.pop(instance, []):
                self._pages[page] = ""
                heapq.heappush(self._free_pages, page)
            self._size_logged.discard(instance)

    # ------------------------------------------------------------------ readers

    def query(
        self, token_ids: Sequence[int], lora_name: str | None = None, instances: Collection[str] | None = None
    ) -> dict[str, dict[int, TierHit]]:
        """``instance -> dp_rank -> TierHit`` for every rank holding at least block 0.

        While only the NPU tier holds blocks, the prompt is hashed a chunk at a time as the
        walk reaches it: hashing stops at the first block no worker holds."""
        blocks = len(token_ids) // self.block_size
        if blocks:
            seed = lora_seed(lora_name) if lora_name else BASE_SEED
            with self._lock:
                if not (self._masks[1] or self._masks[2]):
                    self._queries += 1
                    allowed = None if instances is None else self._instance_mask(instances)
                    if allowed == 0:
                        return {}
                    return self._query_npu(_token_key_chunks(token_ids, self.block_size, seed, blocks), allowed)
        return self.query_keys(sequence_keys(token_ids, self.block_size, lora_name), instances)

    def query_keys(
        self, keys: Sequence[int], instances: Collection[str] | None = None
    ) -> dict[str, dict[int, TierHit]]:
        """Like :meth:`query` for precomputed chained keys (``hashing.chain_hashes``)."""
        if not keys:
            return {}
        with self._lock:
            self._queries += 1
            allowed = None if instances is None else self._instance_mask(instances)
            if allowed == 0:
                return {}
            if not (self._masks[1] or self._masks[2]):
                return self._query_npu((keys,), allowed)
            records, depth = self._walk(keys, allowed)
            if depth and self._refresh():
                self._touch(keys[:depth])
            return self._resolve(records)

    def deepest_npu(self, keys: Sequence[int], instances: Collection[str]) -> Mapping[str, tuple[int, TierHit]] | None:
        """``instance -> (dp_rank, hit)``: per instance of ``instances``, its rank holding the
        longest prefix of ``keys`` (the lowest rank among equals), for instances holding
        block 0.  That is the fold of :meth:`query_keys` under any non-negative tier weights
        when only the NPU tier holds blocks; ``None`` when a CPU or disk tier holds any (then
        ask :meth:`query_keys`).  The router's ``/query`` hot path: one pass, no per-rank hits.
        Queries whose walks end alike get the same mapping object: never mutate it.

        A list of keys walked twice is remembered until the index next changes (every writer
        forgets them all): the same keys asked again for the same workers give the same
        answer without a walk - a prompt sent again (a retry, a repeated prompt, several
        routers asking) between two changes.  Exact: a remembered walk answers only keys equal
        to the ones it walked, and the recency touch runs as after a walk.  The first walk of
        some keys only leaves a mark: under ingest the index changes between most queries, and
        keeping a copy of every walk's keys would cost more than it saves.

        A remembered walk is given without taking the lock (the lock would be most of its
        cost): writers clear the memo before they change anything, under the
        lock, and reset the instance-mask cache after, so an entry read here predates any
        write in progress, and the cached mask read after it is either that state's or
        reset (then the locked path runs).  The answer is the index's as of the entry's
        read.  A new walk starts where its keys part from the last walk's (``wide_walk``
        with the prior walk: the same workers, no change since)."""
        if type(keys) is list and keys:
            remembered = self._walks.get(keys[-1])
            asked, cached = self._allowed  # only the cache: a mask computed here could outlive a reset
            if (
                remembered is not None
                and asked is instances
                and remembered[0] == cached
                and remembered[1] == keys
                and not self._refresh()  # a recency touch changes the maps: under the lock
            ):
                self._queries += 1  # stats() only: outside the lock, as the reads around it
                return remembered[2]
        with self._lock:
            if self._masks[1] or self._masks[2]:
                return None
            self._queries += 1
            if not keys:
                return _NO_HITS
            allowed = self._instance_mask(instances)
            walks = self._walks
            remember = type(keys) is list
            last = keys[-1]
            walked = walks.get(last, _UNSEEN) if remember else _UNSEEN
            if type(walked) is tuple and walked[0] == allowed and walked[1] == keys:
                found, position = walked[2], walked[3]
            else:
                # Every new prompt's path: the C walk called here, and its ends (a tuple, the
                # memo's key as it comes) looked up here, a Python call each saved.
                words = (len(self._by_wid) + 63) >> 6
                ends: tuple[tuple[int, int], ...]
                copied: list[int] | None = None  # the keys, copied once: the caller's list may change
                if remember and 0 < words <= _WIDE_WORDS_MAX and (native := hashing.NATIVE) is not None:
                    # From where the keys part from the last walk's (the same workers, no change
                    # since): a prompt sharing its leading blocks with the one before walks its tail.
                    prior = self._prior_walk
                    if prior is not None and prior[0] == allowed:
                        ends, position = native.wide_walk(keys, self._masks[0], allowed, words, prior[1], prior[2])
                    else:
                        ends, position = native.wide_walk(keys, self._masks[0], allowed, words)
                    copied = list(keys)
                    self._prior_walk = (allowed, copied, ends)
                else:
                    ends, position = self._npu_leaves(keys, allowed)
                found = self._deepest_seen.get(ends) if ends else _NO_HITS
                if found is None:
                    found = self._deepest_of(ends)
                if remember:
                    if len(walks) >= _WALKS_MAX:
                        walks.clear()
                    if walked is _UNSEEN:
                        walks[last] = None
                    else:
                        walks[last] = (allowed, copied if copied is not None else keys[:], found, position)
            if position and self._refresh():
                self._touch(keys[:position])
            return found

    def _forget_walks(self) -> None:
        """Every writer, under the lock, before it changes anything: no remembered walk holds."""
        self._walks.clear()
        self._prior_walk = None

    def _npu_leaves(self, keys: Sequence[int], allowed: int) -> tuple[tuple[tuple[int, int], ...], int]:
        """The NPU walk of ``keys`` for the workers of ``allowed``: ``(position, workers whose
        prefix ends there)`` in ascending position (none when no worker holds block 0), and the
        deepest position.  :meth:`deepest_npu` walks in C (``wide_walk``, the same ends, a
        tuple too) when built, the keys are a list and the masks fit its words; this is the
        walk elsewhere."""
        get = self._masks[0].get
        holders = get(keys[0], 0)
        held = allowed & (holders if holders >= 0 else 1 << ~holders)
        if not held:
            return (), 0
        leaves: list[tuple[int, int]] = []
        position = 1
        for key in islice(keys, 1, None):
            holders = get(key, 0)
            kept = held & (holders if holders >= 0 else 1 << ~holders)
            if kept != held:
                leaves.append((position, held ^ kept))
                if not kept:
                    return tuple(leaves), position
                held = kept
            position += 1
        leaves.append((position, held))
        return tuple(leaves), position

    def _query_npu(self, chunks: Iterable[Sequence[int]], allowed: int | None) -> dict[str, dict[int, TierHit]]:
        """:meth:`query_keys` while only the NPU tier holds blocks (under the lock), over
        consecutive chunks of the keys (pulled lazily): see :meth:`_npu_walk`."""
        out: dict[str, dict[int, TierHit]] = {}
        held = allowed if allowed is not None else (1 << len(self._by_wid)) - 1
        seen, position = self._npu_walk(chunks, held, self._emit_hits, out)
        if position and self._refresh():
            self._touch(list(islice(chain.from_iterable(seen), position)))
        return out

    def _npu_walk(
        self, chunks: Iterable[Sequence[int]], held: int, emit: Callable[[_Out, int, int], None], out: _Out
    ) -> tuple[list[Sequence[int]], int]:
        """The walk while no tier but NPU holds anything: one worker mask per position,
        starting from ``held``; the workers leaving the mask at a position go to
        ``emit(out, mask, position)``.  Chunks are pulled only up to the first key no
        remaining worker holds.  Returns the chunks pulled and how many leading keys some
        worker matched (for the recency touch)."""
        get = self._masks[0].get
        seen: list[Sequence[int]] = []
        position = 0
        for chunk in chunks:
            seen.append(chunk)
            for key in chunk:
                holders = get(key, 0)
                kept = held & (holders if holders >= 0 else 1 << ~holders)
                if kept != held:
                    if position:
                        emit(out, held ^ kept, position)
                    if not kept:
                        return seen, position
                    held = kept
                position += 1
        if position:
            emit(out, held, position)
        return seen, position

    def _emit_hits(self, out: dict[str, dict[int, TierHit]], mask: int, position: int) -> None:
        """Workers of ``mask`` hold ``position`` blocks.  A mask byte is one page of one
        instance's worker ids, so the hits go in a byte (a dict comprehension) at a time."""
        hit = self._hit(position, 0, 0)
        rank_of = self._rank_of
        pages = self._pages
        mask_bytes = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        if hashing.NATIVE is not None:  # the same inserts, without a comprehension per byte
            hashing.NATIVE.emit_hits(out, mask_bytes, hit, rank_of, pages)
            return
        for page, byte in enumerate(mask_bytes):
            if byte:
                base = page * _PAGE
                fresh = {rank_of[base + bit]: hit for bit in _BYTE_BITS[byte]}
                instance = pages[page]
                ranks = out.get(instance)
                if ranks is None:
                    out[instance] = fresh
                else:
                    ranks.update(fresh)

    def _deepest_of(self, leaves: tuple[tuple[int, int], ...]) -> dict[str, tuple[int, TierHit]]:
        """:meth:`_deepest`, remembered by the walk's ends: similar prompts end their walks
        alike, and the same ends name the same ranks until a worker comes or goes (which
        forgets them all).  Bounded; the dict returned is shared, never mutated."""
        found = self._deepest_seen.get(leaves)
        if found is None:
            if len(self._deepest_seen) >= _DEEPEST_SEEN_MAX:
                self._deepest_seen.clear()
            found = self._deepest_seen[leaves] = self._deepest(leaves)
        return found

    def _deepest(self, leaves: Sequence[tuple[int, int]]) -> dict[str, tuple[int, TierHit]]:
        """Per instance its deepest leaver (lowest rank among equals): deepest first, and an
        instance once found masks all its workers out of the shallower records."""
        best: dict[str, tuple[int, TierHit]] = {}
        by_wid = self._by_wid
        inst_masks = self._inst_masks
        done = 0
        for position, left in reversed(leaves):
            mask = left & ~done
            if not mask:
                continue
            hit = self._hit(position, 0, 0)
            found: dict[str, int] = {}
            while mask:
                low = mask & -mask
                mask ^= low
                worker = by_wid[low.bit_length() - 1]
                if worker is None:
                    continue
                rank = found.get(worker.instance)
                if rank is None or worker.dp_rank < rank:
                    found[worker.instance] = worker.dp_rank
            for instance, rank in found.items():
                best[instance] = (rank, hit)
                done |= inst_masks.get(instance, 0)
        return best

    def longest_prefixes(self, instance: str, keys: Iterable[int]) -> dict[int, tuple[int, int, int]]:
        """``dp_rank -> (npu, cpu, disk)`` blocks for every rank of ``instance`` holding at
        least block 0: ``query_keys(keys, [instance])[instance]`` without the TierHit
        objects, for the in-instance dispatcher's hot path.

        ``keys`` may be a lazy iterator (e.g. chaining ``hashing.chain_next`` as it goes):
        it is consumed under the index lock, and only up to the first key no rank of the
        instance holds in any tier - the keys after it cannot change the answer."""
        return self.longest_prefixes_chunked(instance, ((key,) for key in keys))

    def longest_prefixes_tokens(
        self, instance: str, token_ids: Sequence[int], blocks: int | None = None, seed: int = BASE_SEED
    ) -> dict[int, tuple[int, int, int]]:
        """:meth:`longest_prefixes` of a prompt's token ids (its first ``blocks`` full
        blocks, all by default, hashed with ``seed``): each block is hashed and chained
        (:func:`hashing.sequence_keys`) as the walk reaches it, so the hashing stops at the
        first block no rank of ``instance`` holds.  The dispatcher's hot path: while only
        NPU holds blocks, hashing and walk are one loop, in C when the helpers are built
        (``hashing.NATIVE``; SGLang's ``array("q")`` is read as it is)."""
        count = len(token_ids) // self.block_size
        blocks = count if blocks is None else max(0, min(blocks, count))
        limit = blocks * self.block_size
        if not (hashing.NATIVE is not None and type(token_ids) is array and token_ids.itemsize >= 4):
            token_ids = _u32_view(token_ids, limit)
        with self._lock:
            if not (self._masks[1] or self._masks[2]):
                return self._walk_tokens(instance, token_ids, blocks, seed)
        return self.longest_prefixes_chunked(
            instance, _key_chunks(_u32_view(token_ids, limit), self.block_size, seed, blocks)
        )

    def _walk_tokens(
        self, instance: str, tokens: memoryview | array[int], blocks: int, seed: int
    ) -> dict[int, tuple[int, int, int]]:
        """:meth:`longest_prefixes_tokens` over the NPU tier alone (under the lock); ``tokens``
        u32 bytes, or an integer array for the C walk."""
        self._queries += 1
        held = self._inst_masks.get(instance, 0)
        out: dict[int, tuple[int, int, int]] = {}
        if not held:
            return out
        native = hashing.NATIVE
        if native is not None and held < _NATIVE_HELD_LIMIT:
            position = native.npu_walk_ranks(
                tokens, self.block_size, seed, blocks, self._masks[0], held, out, self._rank_of
            )
        else:
            position = self._walk_u32(out, held, _u32_view(tokens, blocks * self.block_size), blocks, seed)
        if position and self._refresh():
            self._touch(chained_block_keys(tokens, self.block_size, seed, seed, 0, position))
        return out

    def _walk_u32(
        self, out: dict[int, tuple[int, int, int]], held: int, raw: memoryview, blocks: int, seed: int
    ) -> int:
        """The Python walk of :meth:`_walk_tokens` over u32 bytes ``raw``; the deepest position."""
        get = self._masks[0].get
        step = self.block_size * 4
        key = seed
        position = 0
        for start in range(0, blocks * step, step):
            key = _xxh3(_pack_u64(_xxh3(raw[start : start + step], seed)), key)  # = hashing.sequence_keys
            holders = get(key, 0)
            kept = held & (holders if holders >= 0 else 1 << ~holders)
            if kept != held:
                if position:
                    self._emit_npu(out, held ^ kept, position)
                if not kept:
                    break
                held = kept
            position += 1
        else:
            if position:
                self._emit_npu(out, held, position)
        return position

    def longest_prefixes_chunked(
        self, instance: str, chunks: Iterable[Sequence[int]]
    ) -> dict[int, tuple[int, int, int]]:
        """:meth:`longest_prefixes` over consecutive chunks of the keys (a lazy iterator of
        lists: the dispatcher hashes a chunk at a time); no chunk is pulled after the one
        holding the first key no rank of ``instance`` holds."""
        with self._lock:
            self._queries += 1
            allowed = self._inst_masks.get(instance, 0)
            if not allowed:
                return {}
            out: dict[int, tuple[int, int, int]] = {}
            if self._masks[1] or self._masks[2]:
                pulled: list[int] = []
                records, depth = self._walk(_recorded(chain.from_iterable(chunks), pulled), allowed)
                out = self._resolve_ranks(records)
                walked = pulled[:depth]
            else:
                seen, depth = self._npu_walk(chunks, allowed, self._emit_npu, out)
                walked = list(islice(chain.from_iterable(seen), depth)) if depth and self._refresh() else []
            if walked and self._refresh():
                self._touch(walked)
            return out

    def ranks(self, instance: str) -> list[int]:
        with self._lock:
            return sorted(rank for inst, rank in self._workers if inst == instance)

    def instances(self) -> list[str]:
        with self._lock:
            return sorted({inst for inst, _ in self._workers})

    def resident(self, instance: str, dp_rank: int, medium: str) -> set[int]:
        """Engine block hashes (u64) indexed for a rank in ``medium``'s tier."""
        with self._lock:
            worker = self._workers.get((instance, dp_rank))
            if worker is None:
                return set()
            return set(worker.maps[_TIER_INDEX[tier_of_medium(medium)]])

    def stats(self) -> IndexStats:
        with self._lock:
            blocks = sum(self._entries)
            keys = sum(len(d) for d in self._masks)
            totals = self._totals
            return IndexStats(
                blocks=blocks,
                keys=keys,
                workers=len(self._workers),
                bytes_per_entry=self._estimate_bytes() / blocks if blocks else 0.0,
                tier_blocks={name: self._entries[i] for i, name in enumerate(TIERS)},
                ignored_block_size=totals.ignored_block_size,
                orphans=totals.orphans,
                evicted=self._evicted,
                unknown_removals=totals.unknown_removals,
                stored=totals.stored,
                removed=totals.removed,
                cleared=totals.cleared,
                queries=self._queries,
            )

    # ------------------------------------------------------------------ events

    def _worker(self, instance: str, dp_rank: int) -> _Worker:
        worker = self._workers.get((instance, dp_rank))
        if worker is None:
            wid = self._free_wid(instance)
            worker = _Worker(wid, instance, dp_rank, self._new_map)
            self._inst_masks[instance] = self._inst_masks.get(instance, 0) | worker.bit
            self._allowed = ((), 0)
            self._deepest_seen.clear()  # ends name other workers now
            self._by_wid[wid] = worker
            self._rank_of[wid] = dp_rank
            self._workers[(instance, dp_rank)] = worker
        return worker

    def _free_wid(self, instance: str) -> int:
        """A free worker id in a page (8 ids, one byte of a mask) of ``instance``, taking a new
        page when its pages are full: a mask byte then belongs to one instance (see
        :meth:`_emit_hits`)."""
        pages = self._inst_pages.setdefault(instance, [])
        for page in pages:
            for wid in range(page * _PAGE, page * _PAGE + _PAGE):
                if self._by_wid[wid] is None:
                    return wid
        if self._free_pages:
            page = heapq.heappop(self._free_pages)
        else:
            page = len(self._pages)
            self._pages.append("")
            self._by_wid.extend([None] * _PAGE)
            self._rank_of.extend([-1] * _PAGE)
        self._pages[page] = instance
        pages.append(page)
        return page * _PAGE

    def _apply(self, worker: _Worker, event: Event, result: ApplyResult) -> None:
        if type(event) is BlockStored:
            self._store(worker, event, result)
        elif type(event) is BlockRemoved:
            self._remove(worker, event, result)
        elif type(event) is AllBlocksCleared:
            for tier in range(3):
                self._clear_tier(worker, tier)
            result.cleared += 1

    def _tier(self, medium: str | None) -> int:
        if medium is None:
            return self._default_tier
        return _TIER_INDEX[tier_of_medium(medium)]

    def _parent_key(self, worker: _Worker, parent: int) -> tuple[int, int] | None:
        parent &= _U64
        for tier, mapping in enumerate(worker.maps):
            key = mapping.get(parent)
            if key is not None:
                return key, tier
        return None

    def _store(self, worker: _Worker, event: BlockStored, result: ApplyResult) -> None:
        if event.block_size != self.block_size or len(event.token_ids) != len(event.block_hashes) * self.block_size:
            result.ignored_block_size += 1
            if worker.instance not in self._size_logged:
                self._size_logged.add(worker.instance)
                log.warning(
                    "instance %s: ignoring stored events with block_size %d, %d tokens (index block_size %d)",
                    worker.instance,
                    event.block_size,
                    len(event.token_ids),
                    self.block_size,
                )
            return
        seed = lora_seed(event.lora_name)
        parent_tier = -1
        if event.parent_block_hash is None:
            parent_key = seed
        else:
            found = self._parent_key(worker, event.parent_block_hash)
            if found is None:
                self._orphan(worker, event, result)
                return
            parent_key, parent_tier = found
        count = len(event.block_hashes)
        keys = chained_block_keys(tokens_u32(event.token_ids), self.block_size, seed, parent_key, 0, count)
        tier = self._tier(event.medium)
        mapping = worker.maps[tier]
        masks = self._masks[tier]
        dups = worker.dups[tier]
        bit = worker.bit
        single = worker.single
        lru = self.capacity_blocks is not None
        if not lru and self._store_new(worker, tier, event.block_hashes, keys):
            self._entries[tier] += count
            result.stored += count
            return
        added = 0
        pairs = zip(event.block_hashes, keys, strict=True)
        for engine_hash, key in reversed(list(pairs)) if lru else pairs:
            if engine_hash < 0:
                engine_hash &= _U64
            old = mapping.get(engine_hash)
            if old is not None:
                if old == key:
                    if lru:
                        masks[key] = masks.pop(key)
                    continue
                self._drop(worker, tier, engine_hash, result)  # same id, new content: replace
            mapping[engine_hash] = key
            added += 1
            holders = masks.pop(key, 0) if lru else masks.get(key, 0)
            if not holders:
                masks[key] = single
            elif _mask(holders) & bit:
                dups[key] = dups.get(key, 0) + 1
                if lru:
                    masks[key] = holders
            else:
                masks[key] = _mask(holders) | bit
        self._entries[tier] += added
        result.stored += added
        if lru and parent_tier >= 0:
            parent_masks = self._masks[parent_tier]
            if parent_key in parent_masks:
                parent_masks[parent_key] = parent_masks.pop(parent_key)

    def _store_new(self, worker: _Worker, tier: int, block_hashes: Sequence[int], keys: list[int]) -> bool:
        """:meth:`_store` without LRU when every engine hash is new to the worker's tier (the
        usual case): the hash -> key map grows in one C call.  False, touching nothing, when
        some hash is already known (the general loop then replaces or skips it)."""
        hashes = block_hashes if min(block_hashes, default=0) >= 0 else [h & _U64 for h in block_hashes]
        mapping = worker.maps[tier]
        if type(mapping) is dict:
            if not mapping.keys().isdisjoint(hashes) or len(set(hashes)) != len(hashes):
                return False
            mapping.update(zip(hashes, keys, strict=True))
        elif not mapping.add_new(hashes, keys):  # type: ignore[attr-defined]  # HashKeys: the same, in C
            return False
        masks = self._masks[tier]
        get = masks.get
        bit = worker.bit
        single = worker.single
        dups = worker.dups[tier]
        for key in keys:
            holders = get(key, 0)
            if not holders:
                masks[key] = single
            elif (holders if holders >= 0 else 1 << ~holders) & bit:
                dups[key] = dups.get(key, 0) + 1
            else:
                masks[key] = (holders if holders >= 0 else 1 << ~holders) | bit
        return True

    def _orphan(self, worker: _Worker, event: BlockStored, result: ApplyResult) -> None:
        result.orphans += 1
        level = logging.DEBUG if worker.orphan_logged else logging.WARNING
        worker.orphan_logged = True
        log.log(
            level,
            "instance %s rank %d: parent block %d unknown, skipping %d stored block(s)",
            worker.instance,
            worker.dp_rank,
            event.parent_block_hash,
            len(event.block_hashes),
        )

    def _remove(self, worker: _Worker, event: BlockRemoved, result: ApplyResult) -> None:
        tier = self._tier(event.medium)
        for engine_hash in event.block_hashes:
            self._drop(worker, tier, engine_hash & _U64, result)

    def _drop(self, worker: _Worker, tier: int, engine_hash: int, result: ApplyResult) -> None:
        key = worker.maps[tier].pop(engine_hash, None)
        if key is None:
            result.unknown_removals += 1
            return
        self._entries[tier] -= 1
        result.removed += 1
        dups = worker.dups[tier]
        extra = dups.get(key)
        if extra:
            if extra == 1:
                del dups[key]
            else:
                dups[key] = extra - 1
            return
        self._unset(self._masks[tier], key, worker.bit)

    @staticmethod
    def _unset(masks: dict[int, int], key: int, bit: int) -> None:
        """Removes one worker from a key's holders, if it is one of them."""
        holders = masks.get(key, 0)
        mask = _mask(holders)
        if mask & bit:
            mask ^= bit
            if mask:
                masks[key] = _holders(mask)
            else:
                del masks[key]

    def _clear_tier(self, worker: _Worker, tier: int) -> None:
        mapping = worker.maps[tier]
        if not mapping:
            return
        masks = self._masks[tier]
        bit = worker.bit
        for key in mapping.values():
            self._unset(masks, key, bit)  # a duplicate key is already unset: no-op
        self._entries[tier] -= len(mapping)
        worker.maps[tier] = self._new_map()
        worker.dups[tier] = {}

    def _finish(self, result: ApplyResult) -> None:
        self._totals.add(result)
        capacity = self.capacity_blocks
        if capacity is not None and sum(self._entries) > capacity:
            self._evict(sum(self._entries) - capacity + max(1, capacity // _EVICT_FRACTION))

    # ------------------------------------------------------------------ eviction

    def _evict(self, count: int) -> None:
        total = sum(self._entries)
        for tier, masks in enumerate(self._masks):
            quota = -(-count * self._entries[tier] // total) if total else 0
            if quota <= 0:
                continue
            victims: dict[int, set[int]] = {}  # wid -> keys evicted in this tier
            freed = 0
            while masks and freed < quota:
                # chunks: a fresh iterator rescans the holes popping left at the front
                for key in list(islice(masks, 256)):
                    for wid in _bits(_mask(masks.pop(key))):
                        victims.setdefault(wid, set()).add(key)
                        freed += 1
                    if freed >= quota:
                        break
            for wid, keys in victims.items():
                worker = self._by_wid[wid]
                if worker is not None:
                    self._forget_keys(worker, tier, keys)

    def _forget_keys(self, worker: _Worker, tier: int, keys: set[int]) -> None:
        mapping = worker.maps[tier]
        kept = self._new_map()
        for engine_hash, key in mapping.items():
            if key not in keys:
                kept[engine_hash] = key
        dropped = len(mapping) - len(kept)
        worker.maps[tier] = kept
        dups = worker.dups[tier]
        for key in keys.intersection(dups):
            del dups[key]
        self._entries[tier] -= dropped
        self._evicted += dropped

    def _refresh(self) -> bool:
        """Whether a query refreshes its keys' recency: once the index holds over half its
        capacity.  Below that no eviction is near, and the touch costs more than the walk."""
        capacity = self.capacity_blocks
        return capacity is not None and 2 * sum(self._entries) > capacity

    def _touch(self, keys: Sequence[int]) -> None:
        for masks in self._masks:
            if masks:
                for key in reversed(keys):
                    mask = masks.pop(key, None)
                    if mask is not None:
                        masks[key] = mask

    # ------------------------------------------------------------------ query walk

    def _instance_mask(self, instances: Collection[str]) -> int:
        asked, cached = self._allowed
        if asked is instances:  # the router asks with the same (immutable) tuple until it changes
            return cached
        mask = 0
        for inst in set(instances):
            mask |= self._inst_masks.get(inst, 0)
        if type(instances) is tuple:
            self._allowed = (instances, mask)
        return mask

    def _walk(self, keys: Iterable[int], allowed: int | None) -> tuple[list[tuple[int, int, int, int]], int]:
        """Phase transitions ``(position, left npu, left cpu, finished)`` as worker masks,
        and the depth up to which some worker matched.  ``keys`` is consumed only up to the
        first key no remaining worker holds (a lazy iterator hashes no further)."""
        npu, cpu, disk = self._masks
        rest = iter(keys)
        first = next(rest, None)
        if first is None:
            return [], 0
        in_npu = _mask(npu.get(first, 0)) | _mask(cpu.get(first, 0)) | _mask(disk.get(first, 0))
        if allowed is not None:
            in_npu &= allowed
        in_cpu = in_disk = 0
        records: list[tuple[int, int, int, int]] = []
        position = 0
        for position, key in enumerate(chain((first,), rest)):  # position is used after the loop
            holders = npu.get(key, 0)
            kept = in_npu & (holders if holders >= 0 else 1 << ~holders)
            left_npu = in_npu ^ kept
            in_npu = kept
            left_cpu = finished = 0
            if left_npu or in_cpu:
                in_cpu |= left_npu
                kept = in_cpu & _mask(cpu.get(key, 0))
                left_cpu = in_cpu ^ kept
                in_cpu = kept
            if left_cpu or in_disk:
                in_disk |= left_cpu
                kept = in_disk & _mask(disk.get(key, 0))
                finished = in_disk ^ kept
                in_disk = kept
            if left_npu or left_cpu or finished:
                records.append((position, left_npu, left_cpu, finished))
            if not (in_npu or in_cpu or in_disk):
                return records, position
        end = position + 1
        records.append((end, in_npu, in_npu | in_cpu, in_npu | in_cpu | in_disk))
        return records, end

    def _emit_npu(self, out: dict[int, tuple[int, int, int]], mask: int, position: int) -> None:
        hit = (position, 0, 0)
        if hashing.NATIVE is not None:
            hashing.NATIVE.emit_ranks(out, mask.to_bytes((mask.bit_length() + 7) // 8, "little"), hit, self._rank_of)
            return
        by_wid = self._by_wid
        while mask:
            low = mask & -mask
            mask ^= low
            worker = by_wid[low.bit_length() - 1]
            if worker is not None:
                out[worker.dp_rank] = hit

    def _resolve(self, records: list[tuple[int, int, int, int]]) -> dict[str, dict[int, TierHit]]:
        out: dict[str, dict[int, TierHit]] = {}
        npu_end: dict[int, int] = {}
        cpu_end: dict[int, int] = {}
        by_wid = self._by_wid

        def emit(mask: int, hit: TierHit | None) -> None:
            while mask:
                low = mask & -mask
                mask ^= low
                worker = by_wid[low.bit_length() - 1]
                if worker is None:
                    continue
                if hit is None:  # per worker: end of its NPU and CPU phases
                    n = npu_end.get(worker.wid, position)
                    c = cpu_end.get(worker.wid, position)
                    found = self._hit(n, c - n, position - c)
                else:
                    found = hit
                ranks = out.get(worker.instance)
                if ranks is None:
                    ranks = out[worker.instance] = {}
                ranks[worker.dp_rank] = found

        for position, left_npu, left_cpu, finished in records:
            pure = left_npu & finished  # NPU-only workers: no per-phase bookkeeping
            if pure and position:
                emit(pure, self._hit(position, 0, 0))
            for wid in _bits(left_npu ^ pure):
                npu_end[wid] = position
            for wid in _bits(left_cpu & ~pure):
                cpu_end[wid] = position
            if position and finished ^ pure:
                emit(finished ^ pure, None)
        return out

    def _resolve_ranks(self, records: list[tuple[int, int, int, int]]) -> dict[int, tuple[int, int, int]]:
        """:meth:`_resolve` for workers of one instance: ``dp_rank -> (npu, cpu, disk)``."""
        out: dict[int, tuple[int, int, int]] = {}
        npu_end: dict[int, int] = {}
        cpu_end: dict[int, int] = {}
        by_wid = self._by_wid
        for position, left_npu, left_cpu, finished in records:
            pure = left_npu & finished  # NPU-only workers: no per-phase bookkeeping
            for wid in _bits(left_npu ^ pure):
                npu_end[wid] = position
            for wid in _bits(left_cpu & ~pure):
                cpu_end[wid] = position
            if not position:
                continue
            mixed = finished ^ pure
            hit = (position, 0, 0)
            while pure:
                low = pure & -pure
                pure ^= low
                worker = by_wid[low.bit_length() - 1]
                if worker is not None:
                    out[worker.dp_rank] = hit
            for wid in _bits(mixed):
                worker = by_wid[wid]
                if worker is not None:
                    n = npu_end.get(wid, position)
                    c = cpu_end.get(wid, position)
                    out[worker.dp_rank] = (n, c - n, position - c)
        return out

    def _hit(self, npu: int, cpu: int, disk: int) -> TierHit:
        key = (npu, cpu, disk)
        hit = self._hits.get(key)
        if hit is None:
            if len(self._hits) > 65_536:  # a few distinct splits recur; keep the cache bounded
                self._hits.clear()
            hit = self._hits[key] = TierHit(npu, cpu, disk)
        return hit

    # ------------------------------------------------------------------ size

    def _estimate_bytes(self) -> int:
        # tables exactly (a HashKeys counts its slots); then the int objects: with dict maps
        # one engine id and one key int per entry (a key int is shared by the global dict and
        # its first holder), with HashKeys maps only each distinct key's int in the global
        # dict; single holders share one small int per worker, multi-holder bitmasks are
        # sampled
        size = 0
        for masks in self._masks:
            size += sys.getsizeof(masks)
            sample = [v for v in islice(masks.values(), 2048) if v > 0]
            if sample:
                share = len(sample) / min(len(masks), 2048)
                mean = sum(_allocated(sys.getsizeof(v)) for v in sample) / len(sample)
                size += int(len(masks) * share * mean)
        for worker in self._workers.values():
            size += sum(sys.getsizeof(mapping) for mapping in worker.maps)
        if self._new_map is dict:
            return size + sum(self._entries) * 2 * _INT_BYTES
        return size + sum(len(masks) for masks in self._masks) * _INT_BYTES


_INT_BYTES = 48  # a 64-bit int: 36 bytes requested, 48 allocated (pymalloc rounds to 16)


def _allocated(size: int) -> int:
    return (size + 15) // 16 * 16
