"""The codec beside the contract: every engine's batch shape in, one declared shape out.

The decoder accepts every shape SGLang 0.4.10..0.5.23 and vLLM emit (map or positional
events, u64 or i64 hashes) with bounds on everything (:class:`DecodeLimits`); the encoder
writes one declared shape (see :class:`BatchEncoder`).  The shapes themselves are
:mod:`sglang_kvpub.wire.contract`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union, overload

import msgspec

from sglang_kvpub.wire.contract import (
    _I64_MAX,
    _I64_MIN,
    LOAD_REPORT_PREFIX,
    MAX_LOAD_RANKS,
    MAX_PENDING_KEYS,
    MEDIUM_GPU,
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventEncoding,
    HashForm,
    LoadReport,
    RankLoads,
    WireError,
)

__all__ = [
    "DecodeLimits",
    "DecodeStats",
    "MsgpackIds",
    "RawStored",
    "BatchDecoder",
    "BatchEncoder",
    "to_u64",
    "to_i64",
    "hash_from_wire",
    "split_stored",
    "enrich_batch",
    "adopt_batch",
    "LoadReportCodec",
]


# Positional (tagged array) events as SGLang <= 0.5.19, vLLM < 0.26 and our "array" encoding
# write them: decoded by msgspec directly, then turned into the public structs.  Trailing
# positions a version does not write take their defaults; extra trailing ones are ignored.
class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None] = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: Union[str, None] = None
    reason: Union[str, None] = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_ArrayStored, _ArrayRemoved, _ArrayCleared]]
    dp_rank: Union[int, None] = None


# The tagged-map shape with each store's ``token_ids`` left as msgpack bytes, for decoders
# given a ``token_ids`` reader (see BatchDecoder) and the plugin's residency tracker
# (core.residency): mirrors contract.BlockStored field for field.
class RawStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None] = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    cache_salt: Union[str, None] = None
    session_id: Union[str, None] = None


class _RawTokensBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[RawStored, BlockRemoved, AllBlocksCleared]]
    dp_rank: Union[int, None] = None


TokenReader = Callable[[msgspec.Raw], Union[Sequence[int], None]]
_IDS = msgspec.msgpack.Decoder(list[int])


class MsgpackIds(Sequence[int]):
    """A stored event's ``token_ids`` kept as the msgpack array they arrived as (``raw``),
    ``length`` ids long: no Python int per id, no copy of the ids (the bytes are a view of the
    payload).  A ``Sequence[int]`` like the list it stands for (items and slices decode the
    array on each call: for tools and tests); the index reads ``raw`` in C
    (``hashing.tokens_u32``), and :class:`BatchEncoder` writes ``raw`` as it is, so a
    re-encoded batch has the bytes it came with.  Built by a decoder's ``token_ids`` reader
    that checked every id (``hashing.token_ids_from_msgpack``)."""

    __slots__ = ("length", "raw")

    def __init__(self, raw: msgspec.Raw, length: int) -> None:
        self.raw = raw
        self.length = length

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return _IDS.decode(self.raw)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(_IDS.decode(self.raw))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MsgpackIds):
            return bytes(self.raw) == bytes(other.raw)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]  # equal to a list: unhashable like one

    def __repr__(self) -> str:
        return f"MsgpackIds({list(self)!r})"


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


def _from_array_batch(raw: _ArrayBatch) -> EventBatch:
    events: list[Event] = []
    for item in raw.events:
        if type(item) is _ArrayStored:
            events.append(
                BlockStored(
                    block_hashes=item.block_hashes,
                    parent_block_hash=item.parent_block_hash,
                    token_ids=item.token_ids,
                    block_size=item.block_size,
                    lora_id=item.lora_id,
                    medium=item.medium,
                    lora_name=item.lora_name,
                )
            )
        elif type(item) is _ArrayRemoved:
            events.append(BlockRemoved(item.block_hashes, item.medium, item.reason))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(ts=raw.ts, events=events, dp_rank=raw.dp_rank)


# --------------------------------------------------------------------------- hashes


def to_u64(value: int) -> int:
    return value & U64_MASK


def to_i64(value: int) -> int:
    value &= U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def hash_from_wire(value: Any) -> int:
    """One engine block hash as an int; bytes hashes (vLLM sha256) keep their last 8 bytes."""
    if isinstance(value, bool):
        raise WireError("bad hash", "bool")
    if isinstance(value, int):
        if value < _I64_MIN or value > U64_MASK:
            raise WireError("bad hash", "outside the 64-bit range")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise WireError("bad hash", "empty bytes")
        return int.from_bytes(raw[-8:], "big")
    if isinstance(value, str):
        try:
            parsed = int(value, 16) if value.lower().startswith("0x") else int(value)
        except ValueError as exc:
            raise WireError("bad hash", "unparsable string") from exc
        return hash_from_wire(parsed)
    raise WireError("bad hash", type(value).__name__)


def _hash_list(values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise WireError("bad block_hashes", type(values).__name__)
    return [hash_from_wire(v) for v in values]


def _optional_hash(value: Any) -> Union[int, None]:
    return None if value is None else hash_from_wire(value)


# --------------------------------------------------------------------------- decoding


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


_EVENT_TAGS = {
    "BlockStored": "stored",
    "BlockStoredWithMetadata": "stored",
    "BlockRemoved": "removed",
    "AllBlocksCleared": "cleared",
}


class BatchDecoder:
    """Decodes one payload into an :class:`EventBatch`, whatever engine version wrote it.

    The fast paths are msgspec's typed decoders for the tagged-map shape and for the
    positional-array shape; anything else (bytes hashes, unknown event types, SGLang
    0.5.18's metadata maps, rank-before-events batches) goes through a generic walk.
    Unknown fields are ignored, unknown event types are counted in
    ``stats.unknown_events`` and skipped.

    ``token_ids``: a reader of a store's msgpack ``token_ids`` array (``msgspec.Raw``) into
    a compact ``Sequence[int]`` (``hashing.token_ids_from_msgpack``: a :class:`MsgpackIds`,
    no Python int per id), or None to decline (ids outside u32, no C helpers).  With one,
    the tagged-map fast path reads every store's ids through it; a declined batch is
    decoded as without.  :class:`BatchEncoder` writes either form as the same bytes.
    """

    def __init__(self, limits: DecodeLimits | None = None, token_ids: TokenReader | None = None) -> None:
        self.limits = limits or DecodeLimits()
        self.stats = DecodeStats()
        self._token_ids = token_ids
        self._raw_tokens = msgspec.msgpack.Decoder(_RawTokensBatch)
        self._typed = msgspec.msgpack.Decoder(EventBatch)
        self._typed_arrays = msgspec.msgpack.Decoder(_ArrayBatch)
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
                batch = _from_array_batch(self._typed_arrays.decode(payload))
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
            fields = _array_fields(tag, raw)
        else:
            raise WireError("bad event", type(raw).__name__)
        kind = _EVENT_TAGS.get(tag) if isinstance(tag, str) else None
        if kind is None:
            self.stats.unknown_events += 1
            return None
        if kind == "cleared":
            return AllBlocksCleared()
        medium = _optional_str(fields.get("medium"), "medium")
        if kind == "removed":
            reason = _optional_str(fields.get("reason"), "reason")
            return BlockRemoved(_hash_list(fields.get("block_hashes")), medium, reason)
        event = BlockStored(
            block_hashes=_hash_list(fields.get("block_hashes")),
            parent_block_hash=_optional_hash(fields.get("parent_block_hash")),
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


# Positional layouts by version; see docs/wire.md.
#   SGLang 0.4.10-0.5.5:  [tag, hashes, parent, tokens, block_size, lora_id]
#   SGLang 0.5.9-0.5.19:  ... + medium; 0.5.18-0.5.19 + {cache_salt} metadata map
#   vLLM:                 ... + medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
_STORED_POSITIONS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def _array_fields(tag: str, raw: Any) -> dict[str, Any]:
    values = list(raw[1:])
    kind = _EVENT_TAGS.get(tag)
    if kind == "removed":
        return dict(zip(("block_hashes", "medium", "reason"), values, strict=False))
    if kind != "stored":
        return {}
    fields: dict[str, Any] = dict(zip(_STORED_POSITIONS, values, strict=False))
    if len(values) > 6:
        extra = values[6]
        if isinstance(extra, dict):
            fields["cache_salt"] = extra.get("cache_salt")
        else:
            fields["lora_name"] = extra
    return fields


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


# --------------------------------------------------------------------------- encoding


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
        events = [_event_as_array(event) for event in batch.events]
        return self._encoder.encode([batch.ts, events, batch.dp_rank])


def _encode_extra(value: Any) -> Any:
    """What msgspec does not encode itself: :class:`MsgpackIds` as the array it holds."""
    if type(value) is MsgpackIds:
        return value.raw
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _event_as_array(event: Event) -> list[Any]:
    if type(event) is BlockStored:
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
    if type(event) is BlockRemoved:  # no reason: positional readers take a trailing string for another field
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


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
            event.block_hashes = _hashes_in_form(event.block_hashes, hash_form)
            if event.parent_block_hash is not None:
                event.parent_block_hash = _hash_in_form(event.parent_block_hash, hash_form)
            if event.medium is None:
                event.medium = default_medium
            if event.block_size <= 0:
                event.block_size = block_size
        elif type(event) is BlockRemoved:
            event.block_hashes = _hashes_in_form(event.block_hashes, hash_form)
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

    The scheduler's per-step path (a third of the cost of encode + decode + check + enrich).
    Returns None for anything it does not know for certain - an unknown event type, an
    empty or out-of-range hash list, token ids that are not plain ints or do not cover the
    blocks: the caller then takes the general path, which validates everything."""
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
                parent = _hash_in_form(parent, hash_form)
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
    return _hashes_in_form(hashes, hash_form)


def _hashes_in_form(hashes: list[int], hash_form: HashForm) -> list[int]:
    """64-bit int hashes in ``hash_form``: the same list when every one already is."""
    if not hashes:
        return hashes
    if hash_form == "u64":
        return hashes if min(hashes) >= 0 else [to_u64(h) for h in hashes]
    return hashes if max(hashes) <= _I64_MAX else [to_i64(h) for h in hashes]


def _hash_in_form(value: int, hash_form: HashForm) -> int:
    return to_u64(value) if hash_form == "u64" else to_i64(value)


def _adopt_medium(medium: Any, default: str) -> str:
    if medium is None:
        return default
    return medium if type(medium) is str else str(getattr(medium, "value", medium))


# --------------------------------------------------------------------------- rank loads


class LoadReportCodec:
    """Encodes and recognises the rank-load message (``wire.LoadReport``, docs/wire.md).

    :meth:`decode` returns None for every payload that is not one (a plain batch or
    heartbeat: the first byte tells, no decoding) and raises :class:`WireError` for a
    malformed one, which a consumer counts and skips like any bad payload."""

    def __init__(self, max_payload_bytes: int = 1 << 20) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LoadReport)

    def encode(self, ts: float, loads: RankLoads) -> bytes:
        return self._encoder.encode(LoadReport(ts, [], None, loads))

    def decode(self, payload: bytes | memoryview) -> LoadReport | None:
        if payload[:1] != LOAD_REPORT_PREFIX:
            return None
        if len(payload) > self.max_payload_bytes:
            raise WireError("payload too large", f"load report of {len(payload)} bytes")
        try:
            report = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("bad load report", str(exc)[:80]) from exc
        ranks = report.loads.ranks
        if report.events or len(ranks) > MAX_LOAD_RANKS or len(report.loads.dispatch) > 64:
            raise WireError("bad load report", f"{len(report.events)} events, {len(ranks)} ranks")
        for rank in ranks:
            bad = len(rank.pending) > MAX_PENDING_KEYS
            if bad or not 0 <= rank.dp_rank < MAX_LOAD_RANKS or not math.isfinite(rank.load_tokens):
                raise WireError("bad load report", f"rank {rank.dp_rank} load {rank.load_tokens}")
        return report
