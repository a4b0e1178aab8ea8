"""The positional (tagged array) event shape that SGLang <= 0.5.19, vLLM < 0.26 and our
``"array"`` encoding write: read by msgspec directly or field by field, written by
:func:`event_as_array`.

Layouts by version (docs/wire.md):

- SGLang 0.4.10-0.5.5:  ``[tag, hashes, parent, tokens, block_size, lora_id]``
- SGLang 0.5.9-0.5.19:  ``... + medium``; 0.5.18-0.5.19 ``+ {cache_salt}`` metadata map
- vLLM:                 ``... + medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...``

Trailing positions a version does not write take their defaults; extra trailing ones are
ignored.  The stored layout is a prefix of the contract's field order
(:class:`~sglang_kvpub.wire.contract.StoredFields`) and stops at ``lora_name``: what
follows differs by writer, so a batch that has something else there takes the decoder's
generic walk.
"""

from __future__ import annotations

import operator
from typing import Any, Union

import msgspec

from sglang_kvpub.wire.contract import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

# The store's positions after the tag, in the contract's field order.
STORED_POSITIONS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_STORED_ARRAY = (*STORED_POSITIONS, "lora_name")
_REMOVED_POSITIONS = ("block_hashes", "medium", "reason")
EVENT_TAGS = {
    "BlockStored": "stored",
    "BlockStoredWithMetadata": "stored",
    "BlockRemoved": "removed",
    "AllBlocksCleared": "cleared",
}


class ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None] = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None


class ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: Union[str, None] = None
    reason: Union[str, None] = None


class ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[ArrayStored, ArrayRemoved, ArrayCleared]]
    dp_rank: Union[int, None] = None


assert ArrayStored.__struct_fields__ == _STORED_ARRAY == BlockStored.__struct_fields__[: len(_STORED_ARRAY)]
assert ArrayRemoved.__struct_fields__ == _REMOVED_POSITIONS == BlockRemoved.__struct_fields__


_stored_values = operator.attrgetter(*_STORED_ARRAY)


def from_array_batch(raw: ArrayBatch) -> EventBatch:
    events: list[Event] = []
    for item in raw.events:
        if type(item) is ArrayStored:
            events.append(BlockStored(*_stored_values(item)))
        elif type(item) is ArrayRemoved:
            events.append(BlockRemoved(item.block_hashes, item.medium, item.reason))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(ts=raw.ts, events=events, dp_rank=raw.dp_rank)


def array_fields(tag: str, raw: Any) -> dict[str, Any]:
    """A positional event's fields by name, for the decoder's generic walk."""
    values = list(raw[1:])
    kind = EVENT_TAGS.get(tag)
    if kind == "removed":
        return dict(zip(_REMOVED_POSITIONS, values, strict=False))
    if kind != "stored":
        return {}
    fields: dict[str, Any] = dict(zip(STORED_POSITIONS, values, strict=False))
    if len(values) > 6:
        extra = values[6]
        if isinstance(extra, dict):
            fields["cache_salt"] = extra.get("cache_salt")
        else:
            fields["lora_name"] = extra
    return fields


def event_as_array(event: Event) -> list[Any]:
    """``[tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]`` and the like."""
    if type(event) is BlockStored:
        return ["BlockStored", *_stored_values(event)]
    if type(event) is BlockRemoved:  # no reason: positional readers take a trailing string for another field
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]
