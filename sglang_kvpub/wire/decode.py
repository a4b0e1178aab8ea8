"""Decoding: every engine's batch shape in, one :class:`~sglang_kvpub.wire.contract.EventBatch` out.

The decoder accepts every shape SGLang 0.4.10..0.5.23 and vLLM emit (map or positional
events, u64 or i64 hashes) with bounds on everything (:class:`DecodeLimits`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

import msgspec

from sglang_kvpub.wire.contract import (
    _I64_MIN,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)
from sglang_kvpub.wire.hashes import hash_list, optional_hash
from sglang_kvpub.wire.positional import EVENT_TAGS, ArrayBatch, array_fields, from_array_batch
from sglang_kvpub.wire.raw_tokens import RawStored, TokenReader

__all__ = ["DecodeLimits", "DecodeStats", "BatchDecoder"]


class _RawTokensBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[RawStored, BlockRemoved, AllBlocksCleared]]
    dp_rank: Union[int, None] = None


def _from_raw_tokens(raw: _RawTokensBatch, read: TokenReader) -> Union[EventBatch, None]:
    """The batch with each store's ids read by ``read``; None when it declines one."""
    events: list[Event] = []
    for item in raw.events:
        if type(item) is RawStored:
            tokens = read(item.token_ids)
            if tokens is None:
                return None
            events.append(
                BlockStored(
                    item.block_hashes,
                    item.parent_block_hash,
                    tokens,
                    item.block_size,
                    item.lora_id,
                    item.medium,
                    item.lora_name,
                    item.cache_salt,
                    item.session_id,
                )
            )
        else:
            events.append(item)  # type: ignore[arg-type]  # BlockRemoved / AllBlocksCleared as they are
    return EventBatch(ts=raw.ts, events=events, dp_rank=raw.dp_rank)


@dataclasses.dataclass(frozen=True)
class DecodeLimits:
    """Bounds that keep a hostile or broken publisher from exhausting memory."""

    max_payload_bytes: int = 64 << 20
    max_events: int = 100_000
    max_blocks_per_event: int = 65_536
    max_block_size: int = 1 << 20


@dataclasses.dataclass
class DecodeStats:
    batches: int = 0
    events: int = 0
    slow_path: int = 0
    unknown_events: int = 0
    errors: int = 0


class BatchDecoder:
    """Decodes one payload into an :class:`EventBatch`, whatever engine version wrote it.

    The fast paths are msgspec's typed decoders for the tagged-map shape and for the
    positional-array shape; anything else (bytes hashes, unknown event types, SGLang
    0.5.18's metadata maps, rank-before-events batches) goes through a generic walk.
    Unknown fields are ignored, unknown event types are counted in
    ``stats.unknown_events`` and skipped.

    ``token_ids``: a reader of a store's msgpack ``token_ids`` array (``msgspec.Raw``) into
    a compact ``Sequence[int]`` (``hashing.token_ids_from_msgpack``: a ``MsgpackIds``,
    no Python int per id), or None to decline (ids outside u32, no C helpers).  With one,
    the tagged-map fast path reads every store's ids through it; a declined batch is
    decoded as without.  The encoder writes either form as the same bytes.
    """

    def __init__(self, limits: DecodeLimits | None = None, token_ids: TokenReader | None = None) -> None:
        self.limits = limits or DecodeLimits()
        self.stats = DecodeStats()
        self._token_ids = token_ids
        self._raw_tokens = msgspec.msgpack.Decoder(_RawTokensBatch)
        self._typed = msgspec.msgpack.Decoder(EventBatch)
        self._typed_arrays = msgspec.msgpack.Decoder(ArrayBatch)
        self._generic = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes | memoryview) -> EventBatch:
        try:
            batch = self._decode(payload)
        except WireError:
            self.stats.errors += 1
            raise
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        return batch

    def _decode(self, payload: bytes | memoryview) -> EventBatch:
        if len(payload) > self.limits.max_payload_bytes:
            raise WireError("payload too large", f"{len(payload)} > {self.limits.max_payload_bytes}")
        if self._token_ids is not None:
            compact = self._decode_compact(payload, self._token_ids)
            if compact is not None:
                self._check_typed(compact)
                return compact
        try:
            batch = self._typed.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            try:
                batch = from_array_batch(self._typed_arrays.decode(payload))
            except (msgspec.DecodeError, msgspec.ValidationError):
                return self._decode_generic(payload)
        self._check_typed(batch)
        return batch

    def _decode_compact(self, payload: bytes | memoryview, read: TokenReader) -> EventBatch | None:
        try:
            raw = self._raw_tokens.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return _from_raw_tokens(raw, read)

    def _check_typed(self, batch: EventBatch) -> None:
        limits = self.limits
        if len(batch.events) > limits.max_events:
            raise WireError("too many events", str(len(batch.events)))
        if not math.isfinite(batch.ts):
            raise WireError("bad batch", "ts is not finite")
        for event in batch.events:
            if type(event) is BlockStored:
                _check_stored(event, limits)
            elif type(event) is BlockRemoved:
                for value in event.block_hashes:
                    if value < _I64_MIN or value > U64_MASK:
                        raise WireError("bad hash", "outside the 64-bit range")

    def _decode_generic(self, payload: bytes | memoryview) -> EventBatch:
        self.stats.slow_path += 1
        try:
            raw = self._generic.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError("not msgpack", str(exc)[:80]) from exc
        ts, raw_events, dp_rank = _split_batch(raw)
        if len(raw_events) > self.limits.max_events:
            raise WireError("too many events", str(len(raw_events)))
        events: list[Event] = []
        for raw_event in raw_events:
            event = self._event(raw_event)
            if event is not None:
                events.append(event)
        return EventBatch(ts=ts, events=events, dp_rank=dp_rank)

    def _event(self, raw: Any) -> Event | None:
        if isinstance(raw, dict):
            tag = raw.get("type")
            fields = raw
        elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
            tag = raw[0]
            fields = array_fields(tag, raw)
        else:
            raise WireError("bad event", type(raw).__name__)
        kind = EVENT_TAGS.get(tag) if isinstance(tag, str) else None
        if kind is None:
            self.stats.unknown_events += 1
            return None
        if kind == "cleared":
            return AllBlocksCleared()
        medium = _optional_str(fields.get("medium"), "medium")
        if kind == "removed":
            reason = _optional_str(fields.get("reason"), "reason")
            return BlockRemoved(hash_list(fields.get("block_hashes")), medium, reason)
        event = BlockStored(
            block_hashes=hash_list(fields.get("block_hashes")),
            parent_block_hash=optional_hash(fields.get("parent_block_hash")),
            token_ids=_token_list(fields.get("token_ids")),
            block_size=_int(fields.get("block_size"), "block_size"),
            lora_id=_optional_int(fields.get("lora_id"), "lora_id"),
            medium=medium,
            lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
            cache_salt=_optional_str(fields.get("cache_salt"), "cache_salt"),
            session_id=_optional_str(fields.get("session_id"), "session_id"),
        )
        _check_stored(event, self.limits)
        return event


def _check_stored(event: BlockStored, limits: DecodeLimits) -> None:
    blocks = len(event.block_hashes)
    if blocks == 0:
        raise WireError("bad BlockStored", "no block hashes")
    if blocks > limits.max_blocks_per_event:
        raise WireError("bad BlockStored", f"{blocks} blocks in one event")
    if not 0 < event.block_size <= limits.max_block_size:
        raise WireError("bad BlockStored", f"block_size {event.block_size}")
    if len(event.token_ids) != blocks * event.block_size:
        raise WireError(
            "token_ids/block_size mismatch",
            f"{len(event.token_ids)} tokens for {blocks} blocks of {event.block_size}",
        )
    for value in event.block_hashes:
        if value < _I64_MIN or value > U64_MASK:
            raise WireError("bad hash", "outside the 64-bit range")
    parent = event.parent_block_hash
    if parent is not None and (parent < _I64_MIN or parent > U64_MASK):
        raise WireError("bad hash", "parent outside the 64-bit range")


def _split_batch(raw: Any) -> tuple[float, list[Any], Union[int, None]]:
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise WireError("bad batch", "expected [ts, events(, dp_rank)]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise WireError("bad batch", "ts is not a number")
    second = raw[1]
    third = raw[2] if len(raw) > 2 else None
    if isinstance(second, (list, tuple)):
        events, dp_rank = second, third
    elif isinstance(third, (list, tuple)):  # [ts, dp_rank, events], accepted by Motor's conductor
        events, dp_rank = third, second
    else:
        raise WireError("bad batch", "no event list")
    return float(ts), list(events), _optional_int(dp_rank, "dp_rank")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"bad {name}", type(value).__name__)
    return value


def _optional_int(value: Any, name: str) -> Union[int, None]:
    return None if value is None else _int(value, name)


def _optional_str(value: Any, name: str) -> Union[str, None]:
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"bad {name}", type(value).__name__)


def _token_list(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise WireError("bad token_ids", type(value).__name__)
    tokens: list[int] = []
    for item in value:
        if isinstance(item, (list, tuple)) and item:  # EAGLE bigram keys: (t_i, t_i+1)
            item = item[0]
        if isinstance(item, bool) or not isinstance(item, int):
            raise WireError("bad token_ids", type(item).__name__)
        tokens.append(item)
    return tokens
