"""What one rank has announced as resident, per medium, and a snapshot of it in prefix order.

``RankResidency.apply`` follows the announced stream (stores add, removals remove,
``AllBlocksCleared`` clears every medium); ``iter_snapshot_events`` replays the result as
``BlockStored`` events, parents before children, merging chains back into multi-block
stores.  The fan-in keeps one per rank (fed with what it forwards) to answer snapshot
requests; the rank side can reuse the class to reconcile against the radix tree.

Memory: one dict entry per block; the value is a single ``bytes`` holding a 9-byte
header (flags, parent hash) and the token ids as u32 (u64 if any id does not fit), so a
128-token block costs about 630 bytes (554-byte value, int key, dict slot): 1M blocks of
128 tokens take about 630 MB.  Rare per-block metadata (LoRA, salt, session) lives in a
side dict only for the blocks that carry it.

Fast path (the fan-in): :class:`RawBatch` decodes a rank payload with each store's
``token_ids`` left as msgpack bytes (:class:`RawStored`), so no per-token Python int is
made on the stream's hot path.  A single-block ``RawStored`` is kept as those bytes
(flag ``_RAW``) and decoded only when a snapshot or :meth:`RankResidency.tokens` needs
it; token bytes that do not decode to integers are then skipped and counted
(``invalid_tokens``).  The msgpack bytes of small ids are about as compact as u32.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union, cast

import msgspec

from sglang_kvpub.wire import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_EXTERNAL,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    WireError,
    to_i64,
    to_u64,
)
from sglang_kvpub.wire.codec import RawStored

__all__ = [
    "RankResidency",
    "BYTES_PER_BLOCK_OVERHEAD",
    "MEDIA_ORDER",
    "RawStored",
    "RawRemoved",
    "RawCleared",
    "RawBatch",
    "raw_batch_decoder",
]

MEDIA_ORDER = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL)
# Key int (32) + dict slot (~40) + bytes object header (33) + our header (9), measured on CPython 3.11.
BYTES_PER_BLOCK_OVERHEAD = 114

_HEAD = struct.Struct("<BQ")
_HAS_PARENT = 1
_WIDE = 2
_NEG_PARENT = 4
_RAW = 8  # the tokens are the msgpack array as received, decoded lazily
_RAW_ROOT_HEAD = _HEAD.pack(_RAW, 0)
_MSGPACK_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_TOKENS = msgspec.msgpack.Decoder(list[int])

# (lora_id, lora_name, cache_salt, session_id)
_Extras = tuple[Union[int, None], Union[str, None], Union[str, None], Union[str, None]]


def _token_bytes(tokens: Sequence[int]) -> tuple[bytes, bool]:
    try:
        return array("I", tokens).tobytes(), False
    except (OverflowError, TypeError):
        pass
    try:
        return array("q", tokens).tobytes(), True
    except (OverflowError, TypeError):
        raise WireError("bad token_ids", "outside the signed 64-bit range") from None


def _entry(parent: int | None, tokens: bytes, wide: bool) -> bytes:
    flags = 0
    value = 0
    if parent is not None:
        flags |= _HAS_PARENT
        if parent < 0:
            flags |= _NEG_PARENT
        value = to_u64(parent)
    if wide:
        flags |= _WIDE
    return _HEAD.pack(flags, value) + tokens


def _parent_of(entry: bytes) -> int | None:
    flags, value = _HEAD.unpack_from(entry)
    if not flags & _HAS_PARENT:
        return None
    return to_i64(value) if flags & _NEG_PARENT else value


def _tokens_of(entry: bytes) -> list[int]:
    """The block's token ids; raises :class:`WireError` for raw bytes that are not integers."""
    if entry[0] & _RAW:
        try:
            return _TOKENS.decode(memoryview(entry)[_HEAD.size :])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("bad token ids", str(exc)) from None
    wide = entry[0] & _WIDE
    tokens = array("q" if wide else "I")
    tokens.frombytes(entry[_HEAD.size :])
    return tokens.tolist()


# ----------------------------------------------------------------------- fast decode
# The wire's own event structs, except a store: ``RawStored`` (wire.codec's, shared with the
# router's stream decoder) mirrors wire.BlockStored with ``token_ids`` left undecoded msgpack.
# Removals and clears decode straight into wire.BlockRemoved / wire.AllBlocksCleared.


RawRemoved = BlockRemoved  # names kept for callers; one struct per event kind
RawCleared = AllBlocksCleared
RawEvent = Union[RawStored, RawRemoved, RawCleared]


class RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[RawEvent]
    dp_rank: Union[int, None] = None

    def tokens_look_valid(self) -> bool:
        """Every store's ``token_ids`` is a msgpack array (its items are checked lazily)."""
        for event in self.events:
            if type(event) is RawStored:
                raw = event.token_ids
                if not len(raw) or memoryview(raw)[0] not in _MSGPACK_ARRAY_HEADS:
                    return False
        return True


def raw_batch_decoder() -> msgspec.msgpack.Decoder[RawBatch]:
    return msgspec.msgpack.Decoder(RawBatch)


class RankResidency:
    """Blocks announced as resident on one rank, per medium (insertion-ordered dicts)."""

    def __init__(self, default_medium: str = MEDIUM_GPU) -> None:
        self.default_medium = default_medium
        self._media: dict[str, dict[int, bytes]] = {}
        self._extras: dict[tuple[str, int], _Extras] = {}
        self.unknown_removals = 0
        self.invalid_tokens = 0
        self.clears = 0

    # ------------------------------------------------------------------ updates

    def apply(self, event: Event | RawEvent) -> None:
        kind = type(event)
        if kind is RawStored:
            self._store_raw(event)  # type: ignore[arg-type]
        elif kind is BlockStored:
            self._store(event)  # type: ignore[arg-type]
        elif kind is BlockRemoved:
            self._remove(event)  # type: ignore[arg-type]
        elif kind is AllBlocksCleared:
            self.clear()

    def apply_all(self, events: Iterable[Event | RawEvent]) -> None:
        apply = self.apply
        for event in events:
            apply(event)

    def clear(self) -> None:
        self._media.clear()
        self._extras.clear()
        self.clears += 1

    def _store(self, event: BlockStored) -> None:
        self._store_tokens(event, event.token_ids)

    def _store_raw(self, event: RawStored) -> None:
        """One block: header + the msgpack token bytes; several: decoded and packed."""
        hashes = event.block_hashes
        if len(hashes) != 1:
            try:
                tokens = _TOKENS.decode(event.token_ids)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.invalid_tokens += len(hashes)
                return
            self._store_tokens(event, tokens)
            return
        medium = event.medium or self.default_medium
        blocks = self._media.get(medium)
        if blocks is None:
            blocks = self._media[medium] = {}
        parent = event.parent_block_hash
        if parent is None:
            head = _RAW_ROOT_HEAD
        elif parent >= 0:
            head = _HEAD.pack(_RAW | _HAS_PARENT, to_u64(parent))
        else:
            head = _HEAD.pack(_RAW | _HAS_PARENT | _NEG_PARENT, to_u64(parent))
        block_hash = hashes[0]
        blocks[block_hash] = head + event.token_ids
        if event.lora_id is None and event.lora_name is None and event.cache_salt is None and event.session_id is None:
            if self._extras:
                self._extras.pop((medium, block_hash), None)
        else:
            self._extras[(medium, block_hash)] = (event.lora_id, event.lora_name, event.cache_salt, event.session_id)

    def _store_tokens(self, event: Any, token_ids: Sequence[int]) -> None:
        medium = event.medium or self.default_medium
        blocks = self._media.setdefault(medium, {})
        hashes = event.block_hashes
        if not hashes:
            return
        if len(token_ids) % len(hashes):  # not whole blocks: never snapshot a misaligned slice
            self.invalid_tokens += len(hashes)
            return
        try:
            raw, wide = _token_bytes(token_ids)
        except WireError:
            self.invalid_tokens += len(hashes)
            return
        step = (len(raw) // len(hashes)) if raw else 0
        extras: _Extras = (event.lora_id, event.lora_name, event.cache_salt, event.session_id)
        has_extras = extras != (None, None, None, None)
        parent = event.parent_block_hash
        for index, block_hash in enumerate(hashes):
            blocks[block_hash] = _entry(parent, raw[index * step : (index + 1) * step], wide)
            if has_extras:
                self._extras[(medium, block_hash)] = extras
            elif self._extras:
                self._extras.pop((medium, block_hash), None)
            parent = block_hash

    def _remove(self, event: BlockRemoved) -> None:
        medium = event.medium or self.default_medium
        blocks = self._media.get(medium)
        for block_hash in event.block_hashes:
            if blocks is None or blocks.pop(block_hash, None) is None:
                self.unknown_removals += 1
            elif self._extras:
                self._extras.pop((medium, block_hash), None)

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._media.values())

    def counts(self) -> dict[str, int]:
        return {medium: len(blocks) for medium, blocks in self._media.items() if blocks}

    def contains(self, block_hash: int, medium: str | None = None) -> bool:
        return block_hash in self._media.get(medium or self.default_medium, {})

    def hashes(self, medium: str | None = None) -> list[int]:
        return list(self._media.get(medium or self.default_medium, {}))

    def parent(self, block_hash: int, medium: str | None = None) -> int | None:
        return _parent_of(self._media[medium or self.default_medium][block_hash])

    def tokens(self, block_hash: int, medium: str | None = None) -> list[int]:
        return _tokens_of(self._media[medium or self.default_medium][block_hash])

    def approx_bytes(self) -> int:
        total = 0
        for blocks in self._media.values():
            total += len(blocks) * BYTES_PER_BLOCK_OVERHEAD
            total += sum(len(entry) - _HEAD.size for entry in blocks.values())
        return total

    def copy(self) -> RankResidency:
        """A frozen view for lazy snapshots: shallow dict copies (values are immutable)."""
        other = RankResidency(self.default_medium)
        other.invalid_tokens = self.invalid_tokens
        other._media = {medium: dict(blocks) for medium, blocks in self._media.items() if blocks}
        other._extras = dict(self._extras)
        return other

    # ------------------------------------------------------------------ snapshot

    def media(self) -> list[str]:
        present = [m for m in MEDIA_ORDER if self._media.get(m)]
        return present + sorted(m for m, blocks in self._media.items() if blocks and m not in MEDIA_ORDER)

    def snapshot_events(self, max_blocks_per_event: int = 64, include_clear: bool = True) -> list[Event]:
        """``[AllBlocksCleared, BlockStored...]`` rebuilding exactly this state from nothing."""
        events: list[Event] = [AllBlocksCleared()] if include_clear else []
        events.extend(self.iter_snapshot_events(max_blocks_per_event))
        return events

    def iter_snapshot_events(self, max_blocks_per_event: int = 64) -> Iterator[BlockStored]:
        """``BlockStored`` for every block, parents first ACROSS media, media in :data:`MEDIA_ORDER`.

        A block's parent may live in another medium (a device block whose parent page
        was demoted to host memory): it is emitted first, so a consumer that resolves
        parents per rank never meets an unknown parent.  A block whose parent is not
        resident anywhere starts a new root; its ``parent_block_hash`` is still the
        announced one.  Lazy: do not mutate this object while iterating (iterate a
        :meth:`copy`).
        """
        limit = max(1, max_blocks_per_event)
        emitted: dict[str, set[int]] = {medium: set() for medium in self._media}
        pending: BlockStored | None = None
        for medium in self.media():
            for block_hash in self._media[medium]:
                if block_hash in emitted[medium]:
                    continue
                for node_medium, node in self._unemitted_chain(medium, block_hash, emitted):
                    emitted[node_medium].add(node)
                    block = self._snapshot_block(node_medium, node)
                    if block is None:
                        continue
                    if pending is not None and _extends(pending, block, limit):
                        pending.block_hashes.append(node)
                        cast(list[int], pending.token_ids).extend(block.token_ids)  # a list: _snapshot_block
                        continue
                    if pending is not None:
                        yield pending
                    pending = block
        if pending is not None:
            yield pending

    def _snapshot_block(self, medium: str, block_hash: int) -> BlockStored | None:
        entry = self._media[medium][block_hash]
        try:
            tokens = _tokens_of(entry)
        except (WireError, ValueError):  # undecodable raw tokens: left out (children start new roots)
            self.invalid_tokens += 1
            return None
        return _stored(block_hash, _parent_of(entry), tokens, medium, self._extras.get((medium, block_hash)))

    def _unemitted_chain(self, medium: str, block_hash: int, emitted: dict[str, set[int]]) -> list[tuple[str, int]]:
        """``(medium, hash)`` of the block and its not-yet-emitted ancestors, root first.

        The walk stays in the block's medium while it can and crosses to another medium
        only for a parent not resident (and not yet emitted) in this one.
        """
        chain = [(medium, block_hash)]
        seen = {(medium, block_hash)}
        parent = _parent_of(self._media[medium][block_hash])
        while parent is not None:
            if parent in self._media[medium]:
                if parent in emitted[medium]:
                    break
                owner: str | None = medium
            elif any(parent in done for done in emitted.values()):
                break
            else:
                owner = self._medium_holding(parent)
            if owner is None or (owner, parent) in seen:
                break
            chain.append((owner, parent))
            seen.add((owner, parent))
            medium = owner
            parent = _parent_of(self._media[owner][parent])
        chain.reverse()
        return chain

    def _medium_holding(self, block_hash: int) -> str | None:
        for medium in self.media():
            if block_hash in self._media[medium]:
                return medium
        return None


def _extends(pending: BlockStored, block: BlockStored, limit: int) -> bool:
    """Whether ``block`` continues ``pending``'s chain and can be merged into one event."""
    return (
        block.medium == pending.medium
        and block.parent_block_hash == pending.block_hashes[-1]
        and block.block_size == pending.block_size
        and len(pending.block_hashes) < limit
        and block.lora_id is None
        and block.lora_name is None
        and block.cache_salt is None
        and block.session_id is None
        and pending.lora_id is None
        and pending.lora_name is None
        and pending.cache_salt is None
        and pending.session_id is None
    )


def _stored(block_hash: int, parent: int | None, tokens: list[int], medium: str, extras: _Extras | None) -> BlockStored:
    lora_id, lora_name, cache_salt, session_id = extras or (None, None, None, None)
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=len(tokens),
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        cache_salt=cache_salt,
        session_id=session_id,
    )
