"""Encoding: batches for the instance stream in one declared shape, and the scheduler's
in-process batches adopted as the contract's structs (:func:`adopt_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec

from sglang_kvpub.wire.contract import (
    _I64_MIN,
    MEDIUM_GPU,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventEncoding,
    HashForm,
)
from sglang_kvpub.wire.hashes import hash_in_form, hashes_in_form
from sglang_kvpub.wire.positional import event_as_array
from sglang_kvpub.wire.raw_tokens import MsgpackIds

__all__ = ["BatchEncoder", "enrich_batch", "split_stored", "adopt_batch"]


class BatchEncoder:
    """Encodes batches for the instance stream in one declared shape.

    ``encoding="map"`` writes SGLang >= 0.5.20 / vLLM tagged maps (the default);
    ``"array"`` writes positional arrays for older consumers:
    ``[tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]``.
    Hashes must already be in the declared form (see :func:`enrich_batch`).
    """

    def __init__(self, encoding: EventEncoding = "map") -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"unknown event encoding {encoding!r}: use 'map' or 'array'")
        self.encoding = encoding
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)

    def encode(self, batch: EventBatch) -> bytes:
        if self.encoding == "map":
            return self._encoder.encode(batch)
        events = [event_as_array(event) for event in batch.events]
        return self._encoder.encode([batch.ts, events, batch.dp_rank])


def _encode_extra(value: Any) -> Any:
    """What msgspec does not encode itself: :class:`MsgpackIds` as the array it holds."""
    if type(value) is MsgpackIds:
        return value.raw
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def enrich_batch(
    batch: EventBatch,
    *,
    dp_rank: int,
    block_size: int,
    hash_form: HashForm = "u64",
    default_medium: str = MEDIUM_GPU,
) -> EventBatch:
    """Makes a batch self-describing, in place: rank, medium, block size and hash form set."""
    batch.dp_rank = dp_rank
    for event in batch.events:
        if type(event) is BlockStored:
            event.block_hashes = hashes_in_form(event.block_hashes, hash_form)
            if event.parent_block_hash is not None:
                event.parent_block_hash = hash_in_form(event.parent_block_hash, hash_form)
            if event.medium is None:
                event.medium = default_medium
            if event.block_size <= 0:
                event.block_size = block_size
        elif type(event) is BlockRemoved:
            event.block_hashes = hashes_in_form(event.block_hashes, hash_form)
            if event.medium is None:
                event.medium = default_medium
    return batch


def split_stored(event: BlockStored) -> list[tuple[int, Sequence[int]]]:
    """``[(block_hash, that block's token ids), ...]`` for a possibly merged store."""
    size = event.block_size
    tokens = event.token_ids
    return [(h, tokens[i * size : (i + 1) * size]) for i, h in enumerate(event.block_hashes)]


def adopt_batch(
    batch: Any,
    *,
    dp_rank: int,
    block_size: int,
    hash_form: HashForm = "u64",
    default_medium: str = MEDIUM_GPU,
) -> Union[EventBatch, None]:
    """An in-process engine batch (SGLang's ``KVEventBatch`` structs) as an enriched
    :class:`EventBatch`, read field by field: no msgpack round trip, lists shared, not copied.

    The scheduler's per-step path: it skips the encode, decode and check that the general
    path pays.  Returns None for anything it does not know for certain - an unknown event
    type, an empty or out-of-range hash list, token ids that are not plain ints or do not
    cover the blocks: the caller then takes the general path, which validates everything."""
    events: list[Event] = []
    append = events.append
    for event in batch.events:
        name = type(event).__name__
        if name == "BlockStored":
            hashes = _adopt_hashes(event.block_hashes, hash_form)
            tokens = event.token_ids
            size = event.block_size or block_size
            if hashes is None or size <= 0 or len(tokens) != len(hashes) * size or type(tokens[0]) is not int:
                return None
            parent = event.parent_block_hash
            if parent is not None:
                if type(parent) is not int or not _I64_MIN <= parent <= U64_MASK:
                    return None
                parent = hash_in_form(parent, hash_form)
            append(
                BlockStored(
                    hashes,
                    parent,
                    tokens,
                    size,
                    event.lora_id,
                    _adopt_medium(event.medium, default_medium),
                    getattr(event, "lora_name", None),
                    getattr(event, "cache_salt", None),
                    getattr(event, "session_id", None),
                )
            )
        elif name == "BlockRemoved":
            hashes = _adopt_hashes(event.block_hashes, hash_form)
            if hashes is None:
                return None
            append(BlockRemoved(hashes, _adopt_medium(event.medium, default_medium), getattr(event, "reason", None)))
        elif name == "AllBlocksCleared":
            append(AllBlocksCleared())
        else:
            return None
    return EventBatch(ts=float(batch.ts), events=events, dp_rank=dp_rank)


def _adopt_hashes(hashes: Any, hash_form: HashForm) -> Union[list[int], None]:
    """``hashes`` in ``hash_form``; None if not plain 64-bit ints (only the extremes are
    type-checked: the fan-in's decoder checks them all)."""
    if type(hashes) is not list or not hashes:
        return None
    low, high = min(hashes), max(hashes)
    if type(low) is not int or type(high) is not int or low < _I64_MIN or high > U64_MASK:
        return None
    return hashes_in_form(hashes, hash_form)


def _adopt_medium(medium: Any, default: str) -> str:
    if medium is None:
        return default
    return medium if type(medium) is str else str(getattr(medium, "value", medium))
