"""The folded instance view: every rank's announced blocks as ONE cache, per medium.

A router that subscribes once per HTTP endpoint and knows no ``dp_rank`` (Motor 3.1's
kv-conductor, a gateway reading rank 0, older llm-d) must see the instance as one cache:
a block is stored when the FIRST rank stores it and removed when the LAST rank holding it
drops it.  :class:`InstanceFold` turns each rank's events into such instance events:

- a store of hashes no rank holds yet passes (split into runs when some are held already:
  each run's parent is the hash before it, which some rank holds);
- a removal passes only for the hashes no other rank still holds;
- a rank's ``AllBlocksCleared`` (and a rank restart, :meth:`drop_rank`) becomes removals of
  the hashes only that rank held, newest first, reason ``cleared``;
- media are folded separately (a block on rank 0's device and rank 1's host is on both tiers).

Memory: one dict entry per (medium, hash) held anywhere in the instance; the value is the
bitmask of the ranks holding it (a refcount that also knows who).  Removal of a hash the
rank does not hold (a duplicate, a reordering upstream) changes nothing and is counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union

import msgspec

from sglang_kvpub.wire import (
    MEDIUM_GPU,
    REASON_CLEARED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    MsgpackIds,
)
from sglang_kvpub.wire.codec import RawStored

__all__ = ["InstanceFold"]

_TOKENS = msgspec.msgpack.Decoder(list[int])
_CLEAR_CHUNK = 256  # hashes per removal event when a rank's blocks go at once


class InstanceFold:
    def __init__(self, default_medium: str = MEDIUM_GPU) -> None:
        self.default_medium = default_medium
        self._held: dict[str, dict[int, int]] = {}  # medium -> block hash -> bitmask of ranks
        self.unknown_removals = 0  # a rank removed a hash it did not hold
        self.bad_tokens = 0  # a partly new store whose token ids could not be sliced

    # ------------------------------------------------------------------ folding

    def fold(self, dp_rank: int, events: Iterable[Any]) -> list[Event]:
        """The instance events one rank batch makes (possibly none), in order."""
        out: list[Event] = []
        bit = 1 << dp_rank
        for event in events:
            kind = type(event)
            if kind is RawStored or kind is BlockStored:
                self._store(bit, event, out)
            elif kind is BlockRemoved:
                self._remove(bit, event, out)
            elif kind is AllBlocksCleared:
                out.extend(self.drop_rank(dp_rank))
        return out

    def drop_rank(self, dp_rank: int) -> list[Event]:
        """The rank holds nothing any more: removals of what only it held (newest first)."""
        bit = 1 << dp_rank
        out: list[Event] = []
        for medium, held in self._held.items():
            gone: list[int] = []
            for block_hash, mask in list(reversed(held.items())):
                if mask & bit:
                    mask &= ~bit
                    if mask:
                        held[block_hash] = mask
                    else:
                        del held[block_hash]
                        gone.append(block_hash)
            for start in range(0, len(gone), _CLEAR_CHUNK):
                out.append(BlockRemoved(gone[start : start + _CLEAR_CHUNK], medium, REASON_CLEARED))
        return out

    def _store(self, bit: int, event: Any, out: list[Event]) -> None:
        medium = event.medium or self.default_medium
        held = self._held.get(medium)
        if held is None:
            held = self._held[medium] = {}
        hashes: list[int] = event.block_hashes
        new: list[int] = []
        for index, block_hash in enumerate(hashes):
            mask = held.get(block_hash, 0)
            if not mask:
                new.append(index)
            held[block_hash] = mask | bit
        if not new:
            return
        if len(new) == len(hashes):
            out.append(_stored(event, medium, hashes, event.parent_block_hash, _ids_of(event)))
            return
        tokens = _token_list(event)
        if tokens is None:
            self.bad_tokens += 1
            return
        size = event.block_size
        for first, last in _runs(new):
            parent = hashes[first - 1] if first else event.parent_block_hash
            out.append(
                _stored(event, medium, hashes[first : last + 1], parent, tokens[first * size : (last + 1) * size])
            )

    def _remove(self, bit: int, event: BlockRemoved, out: list[Event]) -> None:
        medium = event.medium or self.default_medium
        held = self._held.get(medium)
        if held is None:
            self.unknown_removals += len(event.block_hashes)
            return
        gone: list[int] = []
        for block_hash in event.block_hashes:
            mask = held.get(block_hash, 0)
            if not mask & bit:
                self.unknown_removals += 1
                continue
            mask &= ~bit
            if mask:
                held[block_hash] = mask
            else:
                del held[block_hash]
                gone.append(block_hash)
        if gone:
            out.append(BlockRemoved(gone, medium, event.reason))

    # ------------------------------------------------------------------ queries

    def holders(self, block_hash: int, medium: Union[str, None] = None) -> list[int]:
        mask = self._held.get(medium or self.default_medium, {}).get(block_hash, 0)
        return [rank for rank in range(mask.bit_length()) if mask >> rank & 1]

    def counts(self) -> dict[str, int]:
        return {medium: len(held) for medium, held in self._held.items() if held}

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of increasing indices as (first, last) pairs."""
    runs: list[tuple[int, int]] = []
    first = previous = indices[0]
    for index in indices[1:]:
        if index != previous + 1:
            runs.append((first, previous))
            first = index
        previous = index
    runs.append((first, previous))
    return runs


def _ids_of(event: Any) -> Sequence[int]:
    """A store's token ids as they are: a raw store's msgpack array kept undecoded."""
    if type(event) is RawStored:
        return MsgpackIds(event.token_ids, len(event.block_hashes) * event.block_size)
    tokens: Sequence[int] = event.token_ids
    return tokens


def _token_list(event: Any) -> Union[list[int], None]:
    if type(event) is RawStored:
        try:
            return _TOKENS.decode(event.token_ids)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
    return list(event.token_ids)


def _stored(event: Any, medium: str, hashes: list[int], parent: Union[int, None], tokens: Sequence[int]) -> BlockStored:
    return BlockStored(
        hashes,
        parent,
        tokens,
        event.block_size,
        event.lora_id,
        medium,
        event.lora_name,
        event.cache_salt,
        event.session_id,
    )
