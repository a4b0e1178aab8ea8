"""A page-granular prefix (radix) cache model of one engine rank.

Used by bench/routing.py as each simulated DP rank's KV cache, and meant to be reused as the demo's
built-in rank simulator: every mutation returns the keys it stored or evicted, which a caller turns
into BlockStored / BlockRemoved events.

Model (what SGLang's radix cache does, at page granularity):
- A sequence is a list of *prefix-chained page keys*: key i identifies pages 0..i of the prompt, so two
  sequences share key i only if they share the whole prefix up to page i. The cache therefore never
  needs token comparison: a key's presence means its whole prefix is present.
- The cache is prefix-closed: a key is only stored together with all its ancestors, and eviction
  only removes leaves, so `match` is "how many leading keys are present".
- Finite capacity in pages; eviction is LRU over unreferenced (unlocked) leaf pages.

Why an OrderedDict is enough for "LRU leaf": every access walks a root-to-leaf path, and this class
touches a path deepest-first, so a parent is always more recent than each of its children. The least
recent unlocked entry thus has no cached children: it is a leaf. Locks are taken on whole prefix paths,
so a locked child implies a locked parent and skipping locked entries keeps that property.

Only the standard library is used so the module can move into a package unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

PageKey = Hashable


class InsertResult(NamedTuple):
    """What one `RankCache.insert` changed.

    `stored` are the newly cached keys in prefix order (root side first); their parent is the key
    just before `stored[0]` in the inserted sequence (None if `stored[0]` is the sequence's first
    page), see `RankCache.parent_of`. `evicted` are the keys removed to make room, leaves first.
    """

    stored: list[PageKey]
    evicted: list[PageKey]


class RankCache:
    """Prefix cache of one rank: `capacity_pages` pages of `page_size` tokens, LRU leaf eviction."""

    def __init__(self, capacity_pages: int, page_size: int = 128) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.capacity_pages = capacity_pages
        self.page_size = page_size
        # key -> parent key (None for a first page); iteration order = LRU order, oldest first.
        self._lru: OrderedDict[PageKey, PageKey | None] = OrderedDict()
        self._tokens: dict[PageKey, tuple[int, ...]] = {}
        self._locks: dict[PageKey, int] = {}
        self.evicted_total = 0
        self.stored_total = 0

    # ----------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def match(self, keys: Sequence[PageKey], touch: bool = False) -> int:
        """Number of leading `keys` cached (pages). `touch=True` marks them used, as a prefill does;
        a router's look-up uses the default `touch=False` so observing never changes the state."""
        lru = self._lru
        n = 0
        for key in keys:
            if key not in lru:
                break
            n += 1
        if touch and n:
            self._touch(keys, n)
        return n

    def match_tokens(self, keys: Sequence[PageKey], touch: bool = False) -> int:
        """`match` in tokens (full pages only)."""
        return self.match(keys, touch) * self.page_size

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The cached key's parent (None for a first page). KeyError if `key` is not cached."""
        return self._lru[key]

    def tokens_of(self, key: PageKey) -> tuple[int, ...] | None:
        """Token ids stored with the page by `insert(..., tokens=...)`, else None."""
        return self._tokens.get(key)

    def resident(self) -> Iterator[PageKey]:
        """Every cached key, each after its parent (a snapshot can replay stores in this order)."""
        # LRU order has children before parents; reversed, parents come first.
        return reversed(list(self._lru))

    # --------------------------------------------------------------------------------- mutations
    def insert(self, keys: Sequence[PageKey], tokens: Sequence[Sequence[int]] | None = None) -> InsertResult:
        """Cache the sequence `keys` (a whole prefix path) and mark it most recently used.

        Pages already cached are only touched. When the new pages do not fit, unlocked LRU leaves
        outside this path are evicted; if still short of room, only the leading new pages that fit
        are stored (the cache stays prefix-closed). `tokens[i]`, if given, is kept for page i.
        """
        if tokens is not None and len(tokens) != len(keys):
            raise ValueError(f"tokens has {len(tokens)} pages, keys has {len(keys)}")
        m = self.match(keys)
        if m:
            self._touch(keys, m)  # existing path becomes MRU, so eviction reaches it last
        new = len(keys) - m
        evicted: list[PageKey] = []
        short = len(self._lru) + new - self.capacity_pages
        if short > 0:
            evicted = self._evict(short, protected=m)
        n_store = min(new, self.capacity_pages - len(self._lru))
        lru = self._lru
        for i in range(m + n_store - 1, m - 1, -1):  # deepest first: parents end up more recent
            key = keys[i]
            lru[key] = keys[i - 1] if i else None
            if tokens is not None:
                self._tokens[key] = tuple(tokens[i])
        if m:
            self._touch(keys, m)
        self.stored_total += n_store
        return InsertResult(list(keys[m : m + n_store]), evicted)

    def lock(self, keys: Sequence[PageKey]) -> int:
        """Pin the cached prefix of `keys` against eviction (a running request's pages). Returns pages locked."""
        n = self.match(keys)
        for key in keys[:n]:
            self._locks[key] = self._locks.get(key, 0) + 1
        return n

    def unlock(self, keys: Sequence[PageKey], n: int) -> None:
        """Release a `lock(keys)` that returned `n`."""
        for key in keys[:n]:
            left = self._locks.get(key, 0) - 1
            if left > 0:
                self._locks[key] = left
            else:
                self._locks.pop(key, None)

    def evict(self, n_pages: int) -> list[PageKey]:
        """Evict up to `n_pages` unlocked LRU leaves (memory pressure from outside the cache)."""
        return self._evict(n_pages, protected=0)

    def clear(self) -> list[PageKey]:
        """Drop everything (flush_cache / AllBlocksCleared); returns the dropped keys, leaves first."""
        dropped = list(self._lru)
        self._lru.clear()
        self._tokens.clear()
        self._locks.clear()
        self.evicted_total += len(dropped)
        return dropped

    # ---------------------------------------------------------------------------------- internal
    def _touch(self, keys: Sequence[PageKey], n: int) -> None:
        move = self._lru.move_to_end
        for i in range(n - 1, -1, -1):
            move(keys[i])

    def _evict(self, n_pages: int, protected: int) -> list[PageKey]:
        """Remove up to n_pages unlocked entries from the LRU end. The last `protected` entries (a path
        just touched by insert) are never taken: scanning stops when it reaches them."""
        lru = self._lru
        limit = len(lru) - protected
        victims: list[PageKey] = []
        locks = self._locks
        for i, key in enumerate(lru):
            if i >= limit or len(victims) >= n_pages:
                break
            if locks and key in locks:
                continue
            victims.append(key)
        tokens = self._tokens
        for key in victims:
            del lru[key]
            if tokens:
                tokens.pop(key, None)
        self.evicted_total += len(victims)
        return victims
