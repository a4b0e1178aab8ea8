"""A built-in simulator of one SGLang DP rank's prefix cache and the KV events it publishes.

The demo (``sglang-kvpub demo``) runs an instance of N such ranks without an accelerator.
Each rank is a page-granular radix cache model (:class:`sglang_kvpub.tools.sim_cache.RankCache`:
finite HBM in pages, LRU eviction of unreferenced leaves) and reports what a real SGLang
0.5.23 rank reports for the same prefill:

- Block hashes as SGLang computes them (sglang-internals.md section 2, "Block hash"):
  ``digest_i = SHA-256(digest_{i-1} || page tokens as little-endian u32)`` (no previous
  digest for the first page), and the event hash is the first 8 digest bytes read as a
  big-endian signed int64. Deterministic across processes and runs.
- Only full pages are cached; a prefill first matches the cached prefix (its hit), then
  inserts the prompt's full pages, evicting LRU leaves when HBM is full.
- Events as SGLang's recorder coalesces them: the pages a prefill adds become ONE
  ``BlockStored`` (N hashes, N * page_size token ids, ``parent_block_hash`` of the first
  page), and the evicted pages one ``BlockRemoved(medium=GPU)``; ``flush`` is
  ``AllBlocksCleared``. Each prefill yields one batch ``[ts, events, None]`` - the rank's
  publisher stamps the dp_rank, as SGLang's scheduler leaves it to the publisher.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import zmq

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher
from sglang_kvpub.tools.sim_cache import RankCache
from sglang_kvpub.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = [
    "BUILTIN_EVENTS",
    "Dispatch",
    "EventTypes",
    "PrefillResult",
    "SimulatedInstance",
    "SimulatedRank",
    "engine_block_hashes",
    "page_digests",
    "sglang_event_types",
]

_U32_MAX = 0xFFFFFFFF


def page_digests(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """SGLang's chained SHA-256 digest of every FULL page of ``token_ids``."""
    digests: list[bytes] = []
    previous = b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        if any(not 0 <= t <= _U32_MAX for t in page):
            raise ValueError("token ids must be in [0, 2^32) (the wide encoding is not simulated)")
        previous = hashlib.sha256(previous + struct.pack(f"<{page_size}I", *page)).digest()
        digests.append(previous)
    return digests


def _to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def _as_int(key: Hashable) -> int:
    assert isinstance(key, int)  # the cache is keyed by engine block hashes
    return key


def engine_block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The int64 block hashes SGLang 0.5.23 puts in ``BlockStored`` for the full pages."""
    return [_to_int64(d) for d in page_digests(token_ids, page_size)]


@dataclasses.dataclass(frozen=True)
class EventTypes:
    """The classes a rank builds its events with: ours (``wire``) or SGLang's own."""

    name: str
    stored: Callable[..., Any]
    removed: Callable[..., Any]
    cleared: Callable[[], Any]
    batch: Callable[[float, list[Any]], Any]  # (ts, events) -> a batch without dp_rank


BUILTIN_EVENTS = EventTypes(
    "sglang_kvpub.wire", BlockStored, BlockRemoved, AllBlocksCleared, lambda ts, ev: EventBatch(ts=ts, events=ev)
)


def sglang_event_types() -> EventTypes | None:
    """SGLang's real ``KVEventBatch``/``BlockStored``/... when SGLang imports (slow: seconds), else None.

    The rank publisher then converts SGLang's own structs, exactly as in a scheduler process.
    """
    from sglang_kvpub.engine.sglang_compat import kv_events_module

    kv_events = kv_events_module()
    if kv_events is None:
        return None
    return EventTypes(
        f"SGLang's own structs ({kv_events.__name__})",
        kv_events.BlockStored,
        kv_events.BlockRemoved,
        kv_events.AllBlocksCleared,
        lambda ts, ev: kv_events.KVEventBatch(ts=ts, events=ev),
    )


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """What one prefill did on the rank."""

    dp_rank: int
    prompt_tokens: int
    cached_tokens: int  # the prefix hit, full pages only
    stored_pages: int
    evicted_pages: int
    batch: Any  # an EventBatch (or SGLang's KVEventBatch); None when the cache did not change


class SimulatedRank:
    """One DP rank: a finite radix cache in HBM that emits SGLang-shaped KV events.

    ``publish`` (e.g. :meth:`sglang_kvpub.publish.rank_publisher.RankPublisher.publish`) receives
    every non-empty batch, as SGLang's scheduler hands batches to its publisher after a
    prefill. Not thread-safe: one scheduler drives one rank.
    """

    def __init__(
        self,
        dp_rank: int,
        capacity_pages: int,
        page_size: int = 128,
        publish: Callable[[Any], None] | None = None,
        clock: Callable[[], float] = time.time,
        events: EventTypes = BUILTIN_EVENTS,
    ) -> None:
        self.events = events
        self.dp_rank = dp_rank
        self.page_size = page_size
        self.cache = RankCache(capacity_pages, page_size)
        self._publish = publish
        self._clock = clock
        self.prefills = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.batches = 0
        self.stored_pages = 0
        self.evicted_pages = 0  # LRU evictions (BlockRemoved)
        self.cleared_pages = 0  # dropped by flush (AllBlocksCleared)

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """The prefix of ``token_ids`` this rank holds (tokens), without touching LRU order."""
        return self.cache.match(engine_block_hashes(token_ids, self.page_size)) * self.page_size

    def prefill(self, token_ids: Sequence[int]) -> PrefillResult:
        """Serves one prompt: prefix match (the hit), then insert its full pages; publishes the events."""
        page = self.page_size
        keys = engine_block_hashes(token_ids, page)
        hit_pages = self.cache.match(keys, touch=True)
        pages = [tuple(token_ids[i * page : (i + 1) * page]) for i in range(len(keys))]
        stored, evicted = self.cache.insert(keys, tokens=pages)
        types = self.events
        events: list[Any] = []
        if evicted:  # SGLang evicts to make room before the new pages are inserted
            events.append(types.removed(block_hashes=[_as_int(k) for k in evicted], medium=MEDIUM_GPU))
        if stored:
            first = hit_pages  # insert stores the pages right after the matched prefix
            events.append(
                types.stored(
                    block_hashes=keys[first : first + len(stored)],
                    parent_block_hash=int(keys[first - 1]) if first else None,
                    token_ids=[t for p in pages[first : first + len(stored)] for t in p],
                    block_size=page,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                )
            )
        batch = self._emit(events)
        self.prefills += 1
        self.prompt_tokens += len(token_ids)
        self.hit_tokens += hit_pages * page
        self.stored_pages += len(stored)
        self.evicted_pages += len(evicted)
        return PrefillResult(self.dp_rank, len(token_ids), hit_pages * page, len(stored), len(evicted), batch)

    def flush(self) -> Any:
        """``flush_cache``: everything leaves HBM; one ``AllBlocksCleared`` (as SGLang's reset)."""
        self.cleared_pages += len(self.cache.clear())
        batch = self._emit([self.events.cleared()])
        assert batch is not None
        return batch

    def resident_pages(self) -> int:
        return len(self.cache)

    def resident_hashes(self) -> list[int]:
        """The engine block hashes of every page in HBM, parents first."""
        return [_as_int(key) for key in self.cache.resident()]

    def _emit(self, events: list[Any]) -> Any:
        if not events:
            return None
        batch = self.events.batch(self._clock(), events)
        self.batches += 1
        if self._publish is not None:
            self._publish(batch)
        return batch


# --------------------------------------------------------------------------- an instance


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Where the instance's DP controller sent a request and what the rank did."""

    dp_rank: int
    pinned: bool  # True: the request carried routed_dp_rank; False: round-robin
    result: PrefillResult


class SimulatedInstance:
    """One SGLang instance with the plugin: N simulated ranks, each with its own
    :class:`~sglang_kvpub.publish.rank_publisher.RankPublisher` (own PUSH socket and thread) on the
    internal channel, and one :class:`~sglang_kvpub.publish.fanin.FanIn` serving the instance stream
    (PUB + replay ROUTER) - the plugin's real code; only the scheduler is simulated.

    Ranks run in the caller's process (a thread per publisher), not in processes as under
    SGLang: the sockets, frames and sequence numbers are the same, startup is instant.
    Dispatch is SGLang's DataParallelController's: ``routed_dp_rank`` when the request
    carries one, else round-robin.
    """

    def __init__(
        self,
        config: PluginConfig,
        dp_size: int,
        capacity_pages: int,
        page_size: int = 128,
        *,
        context: zmq.Context[Any] | None = None,
        events: EventTypes = BUILTIN_EVENTS,
    ) -> None:
        self.config = config
        self.page_size = page_size
        self.fanin = FanIn(config, dp_size, context=context)
        self.fanin.start()
        self.publishers: list[RankPublisher] = []
        self.ranks: list[SimulatedRank] = []
        try:
            for rank in range(dp_size):
                publisher = RankPublisher(config, rank, page_size, self.fanin.channel_endpoint, context=context)
                self.publishers.append(publisher)
                self.ranks.append(
                    SimulatedRank(rank, capacity_pages, page_size, publish=publisher.publish, events=events)
                )
        except BaseException:
            self.close()
            raise
        self._next_rr = 0

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def dispatch(self, token_ids: Sequence[int], routed_dp_rank: int | None = None) -> Dispatch:
        if routed_dp_rank is not None and 0 <= routed_dp_rank < self.dp_size:
            return Dispatch(routed_dp_rank, True, self.ranks[routed_dp_rank].prefill(token_ids))
        rank = self._next_rr
        self._next_rr = (rank + 1) % self.dp_size
        return Dispatch(rank, False, self.ranks[rank].prefill(token_ids))

    def holder(self, token_ids: Sequence[int]) -> tuple[int | None, int]:
        """The rank holding the longest prefix of ``token_ids`` (engine truth) and its tokens."""
        best: tuple[int | None, int] = (None, 0)
        for rank in self.ranks:
            cached = rank.cached_tokens(token_ids)
            if cached > best[1]:
                best = (rank.dp_rank, cached)
        return best

    def delivered(self) -> bool:
        """Every batch the ranks published so far has reached the fan-in (and so its PUB)."""
        ranks = self.fanin.stats()["ranks"]
        for publisher in self.publishers:
            sent = publisher.stats["rank_seq"]
            if sent >= 0 and ranks.get(publisher.dp_rank, {}).get("last_rank_seq", -1) < sent:
                return False
        return True

    def flush_cache(self) -> None:
        """SGLang's ``/flush_cache``: every rank drops its tree and emits ``AllBlocksCleared``."""
        for rank in self.ranks:
            rank.flush()

    def stream_seq(self) -> int:
        """The newest seq on the instance stream."""
        return int(self.fanin.stats()["seq"])

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.shutdown(timeout_s=1.0)
        self.fanin.stop()
