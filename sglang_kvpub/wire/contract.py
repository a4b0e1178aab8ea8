"""The instance-stream contract: media, events, batches, seq/epoch, live and replay frames.

Everything a consumer in any language must agree on, and nothing else (the codec that
reads every engine's shape is :mod:`sglang_kvpub.wire.codec`; docs/wire.md names each
identifier).  Imports neither SGLang nor torch nor ZMQ.

Live frames are ``[topic, seq (u64 big-endian), payload]``; the payload is a msgpack
``[ts, events, dp_rank]`` batch whose events are ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``.  The rank-load message (:class:`LoadReport`) is a heartbeat with a
fourth element: ``[ts, [], nil, RankLoads]`` - a consumer that does not know it reads a
heartbeat (msgspec and our decoder ignore trailing array elements).

The instance sequence number carries the publisher's epoch in its top bits
(``seq = epoch << EPOCH_SHIFT | counter``): plain 3-frame decoders still see one
monotonically increasing u64 per start, and a restarted fan-in is recognisable because
its epoch differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Generic, Literal, TypeVar, Union

import msgspec

__all__ = [
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "KNOWN_MEDIA",
    "U64_MASK",
    "StoredFields",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "Event",
    "EventBatch",
    "RankOrder",
    "RANK_ORDER_INDEX",
    "RankLoad",
    "RankLoads",
    "LoadReport",
    "LOAD_REPORT_PREFIX",
    "MAX_LOAD_RANKS",
    "MAX_PENDING_KEYS",
    "WireError",
    "HashForm",
    "EventEncoding",
    "encode_seq",
    "decode_seq",
    "END_SEQ",
    "END_SEQ_BYTES",
    "EPOCH_SHIFT",
    "make_seq",
    "seq_epoch",
    "seq_counter",
    "live_frames",
    "parse_live_frames",
    "replay_request_frames",
    "parse_replay_request",
    "replay_reply_frames",
    "replay_end_frames",
    "ReplayReply",
    "parse_replay_reply",
    "SNAPSHOT_MARKER",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"
KNOWN_MEDIA = frozenset({MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL})

U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1

_Tokens = TypeVar("_Tokens")

HashForm = Literal["u64", "i64"]
EventEncoding = Literal["map", "array"]


class WireError(ValueError):
    """A frame or payload that does not follow the contract; ``reason`` is short and stable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# --------------------------------------------------------------------------- events
# Every field but the first has a default so one typed decoder reads SGLang >= 0.5.20
# and vLLM map events directly.  No ``omit_defaults`` on stores: ``parent_block_hash`` and
# ``lora_id`` must always be on the wire because SGLang 0.5.23's own decoder requires them.


class StoredFields(msgspec.Struct, Generic[_Tokens], gc=False):
    """A store's fields, declared once, in wire order.  :class:`BlockStored` reads
    ``token_ids`` as ints; the codec's ``RawStored`` leaves them as the msgpack bytes they
    arrived as.  Each variant gives ``token_ids`` its own type and default, in this place."""

    block_hashes: list[int]
    parent_block_hash: Union[int, None] = None
    token_ids: _Tokens = None  # type: ignore[assignment]  # each variant sets its own default
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    cache_salt: Union[str, None] = None
    session_id: Union[str, None] = None


class BlockStored(StoredFields[Sequence[int]], tag=True, gc=False):
    """Consecutive blocks (pages) stored in one medium; ``token_ids`` covers all of them."""

    token_ids: Sequence[int] = []


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks that left one medium.  ``reason`` (one of ``wire.REMOVAL_REASONS``, or None:
    not known) is written only when set, so a removal without one has the shape older
    readers know; readers that do not know the field skip it (unknown map key, trailing
    array element)."""

    block_hashes: list[int]
    medium: Union[str, None] = None
    reason: Union[str, None] = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """``[ts, events, dp_rank]``; an empty ``events`` list is a heartbeat."""

    ts: float
    events: list[Event]
    dp_rank: Union[int, None] = None


class RankOrder(msgspec.Struct, tag=True, gc=False):
    """A rank batch's place in its rank's order on the instance stream: the fifth batch
    element, ``[ts, events, dp_rank, nil, RankOrder]`` (the fourth stays free: a
    four-element payload is a rank-load message).  ``seq`` counts 0, 1, 2, ... the batches
    of rank ``dp_rank`` within one rank ``epoch`` (a new epoch: the rank restarted, its
    first batch is ``AllBlocksCleared`` with ``seq`` 0).  ``snapshot``: a snapshot batch,
    stating the rank's state as of ``seq`` (the next live batch of the rank is ``seq + 1``)."""

    epoch: int
    seq: int
    snapshot: bool = False


# --------------------------------------------------------------------------- rank loads


class RankLoad(msgspec.Struct, array_like=True, gc=False):
    """One rank's figures: ``[dp_rank, load_tokens, requests, cached_tokens_total, prefill_tokens_total, pending]``.

    ``load_tokens``: what the instance's dispatcher costs the rank with (SGLang's
    ``num_total_tokens`` - KV tokens in use plus queued tokens - plus the dispatcher's own
    commits since the rank's last snapshot).  ``requests``: running plus waiting.  The two
    totals count from the rank's start: prompt tokens it served from its cache, and prompt
    tokens it computed (SGLang's ``total_prefill_uncached_tokens``).  ``pending``: the block
    keys (the router's chained keys) of the prefixes the rank is prefilling or has queued, at
    most :data:`MAX_PENDING_KEYS` - a later prompt sharing them will find them cached there
    once those prefills end (docs/dispatch.md, "Pending prefixes"); readers that predate it
    ignore the trailing element."""

    dp_rank: int
    load_tokens: float
    requests: int = 0
    cached_tokens_total: int = 0
    prefill_tokens_total: int = 0
    pending: list[int] = []


class RankLoads(msgspec.Struct, tag=True, gc=False):
    """The fourth element of a :class:`LoadReport`: a map ``{"type": "RankLoads", ...}``.

    ``ranks``: one entry per rank that has a figure; ``dispatch``: the instance dispatcher's
    decisions per reason since its start (``cache_hit``, ``no_hit``, ...); ``period_s``:
    how often the fan-in sends the message (a consumer may treat older figures as stale)."""

    ranks: list[RankLoad]
    dispatch: dict[str, int] = {}
    period_s: float = 0.0


class LoadReport(msgspec.Struct, array_like=True, gc=False):
    """``[ts, [], nil, RankLoads]``: a heartbeat to every consumer that does not know it."""

    ts: float
    events: list[Event]
    dp_rank: Union[int, None]
    loads: RankLoads


RANK_ORDER_INDEX = 4  # the batch array's element that holds a RankOrder
LOAD_REPORT_PREFIX = b"\x94"  # msgpack fixarray of 4: the only payload shape a load report has
MAX_LOAD_RANKS = 4096  # bounds what a consumer keeps per instance
MAX_PENDING_KEYS = 1024  # pending block keys per rank in one report (16 ranks: ~150 KB at most)


# --------------------------------------------------------------------------- frames

END_SEQ = U64_MASK  # -1 as a signed 64-bit value: the replay end marker
END_SEQ_BYTES = END_SEQ.to_bytes(8, "big")
EPOCH_SHIFT = 40
SNAPSHOT_MARKER = b"snapshot"


def encode_seq(seq: int) -> bytes:
    return (seq & U64_MASK).to_bytes(8, "big")


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise WireError("bad seq frame", f"{len(raw)} bytes")
    return int.from_bytes(raw, "big")


def make_seq(epoch: int, counter: int) -> int:
    return (epoch << EPOCH_SHIFT) | counter


def seq_epoch(seq: int) -> int:
    return seq >> EPOCH_SHIFT


def seq_counter(seq: int) -> int:
    return seq & ((1 << EPOCH_SHIFT) - 1)


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, encode_seq(seq), payload]


def parse_live_frames(frames: list[bytes], max_payload_bytes: int | None = None) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a 3-frame live message."""
    if len(frames) != 3:
        raise WireError("bad frame count", str(len(frames)))
    topic, seq, payload = frames
    if max_payload_bytes is not None and len(payload) > max_payload_bytes:
        raise WireError("payload too large", f"{len(payload)} > {max_payload_bytes}")
    return bytes(topic), decode_seq(bytes(seq)), payload


def replay_request_frames(start_seq: int, snapshot: bool = False) -> list[bytes]:
    """What a DEALER sends; ``snapshot=True`` asks for a snapshot whatever the buffer holds."""
    frames = [b"", encode_seq(start_seq)]
    if snapshot:
        frames.append(SNAPSHOT_MARKER)
    return frames


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int, bool]:
    """``(identity, start_seq, snapshot)`` from what a ROUTER receives."""
    if len(frames) not in (3, 4) or frames[1] != b"":
        raise WireError("bad replay request", f"{len(frames)} frames")
    snapshot = len(frames) == 4
    if snapshot and frames[3] != SNAPSHOT_MARKER:
        raise WireError("bad replay request", "unknown fourth frame")
    return bytes(frames[0]), decode_seq(bytes(frames[2])), snapshot


def replay_reply_frames(identity: bytes, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [identity, b"", topic, encode_seq(seq), payload]


def replay_end_frames(identity: bytes) -> list[bytes]:
    return [identity, b"", b"", END_SEQ_BYTES, b""]


@dataclasses.dataclass(frozen=True)
class ReplayReply:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ


def parse_replay_reply(frames: list[bytes]) -> ReplayReply:
    """One reply as a DEALER receives it: SGLang >= 0.5.22 ``[b"", topic, seq, payload]``
    or older SGLang / vLLM ``[b"", seq, payload]`` (the empty delimiter is optional)."""
    parts = [bytes(f) for f in frames]
    if parts and parts[0] == b"" and len(parts) in (3, 4):
        parts = parts[1:]
    if len(parts) == 3:
        topic, seq, payload = parts
    elif len(parts) == 2:
        topic, (seq, payload) = b"", parts
    else:
        raise WireError("bad replay reply", f"{len(frames)} frames")
    return ReplayReply(topic=topic, seq=decode_seq(seq), payload=payload)
