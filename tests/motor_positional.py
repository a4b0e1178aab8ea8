"""A strict positional reader of KV-event batches, written from Motor 3.1's kv-conductor rules.

Facts read from ``Ascend/MindIE-Motor`` ``motor/kv_conductor/src/events/vllm.rs`` and
``zmq_subscriber.rs`` (Rust; read, never copied), restated as rules:

- Live: a multipart message of at least 3 frames; only frame 2 (the payload) is read; the
  seq is not checked.
- Batch: a msgpack array of EXACTLY three elements, ``[ts, events, dp_rank|nil]`` (else
  ``[ts, dp_rank|nil, events]``); anything longer or shorter is refused whole (a tuple
  decode with a length check).  The batch's dp_rank is dropped: every event is credited to
  the rank the subscriber was registered with.
- Events: each one a positional array whose first element is the tag string; a map event
  makes the whole batch unreadable.  Nil elements are removed first, then fields are
  taken in order by their type: ``BlockStored``: array hashes, non-array parent, array
  token ids, integer block size, integer lora id, string medium, string lora name (the
  rest ignored); ``BlockRemoved``: array hashes, string medium; other tags clear nothing
  but ``AllBlocksCleared``, which clears the whole registered worker.
- Hashes: integers read as u64 (a negative one is dropped); strings and binaries accepted.
- A store whose block size differs from the registration is dropped.  A store is
  attached under its parent (a device store whose parent the worker does not hold fails:
  "parent not found"); a removal drops the block by hash.
- Replay: a DEALER sends ``[b"", start_seq]`` and reads three single frames per reply
  (delimiter, seq, payload) until seq ``2**64-1``.

:class:`OneWorker` applies what the reader decodes to one worker's block tree, keyed by
content (XXH3 chain of the blocks' token ids, as the conductor recomputes it), so a query
gives the longest prefix the worker holds in blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec
import zmq

from sglang_kvpub.core.hashing import BASE_SEED, chain_next, local_block_hash, sequence_keys

END_SEQ = (1 << 64) - 1
_GENERIC = msgspec.msgpack.Decoder()


class Refused(ValueError):
    pass


def _hash(value: Any) -> Union[int, None]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < 1 << 64 else None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text[2:], 16) if text.lower().startswith("0x") else int(text)
        except ValueError:
            return None
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(bytes(value)[-8:], "big") if value else None
    return None


def _hashes(value: Any) -> list[int]:
    return [h for h in (_hash(v) for v in value) if h is not None]


def _event(raw: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise Refused(f"event is not a tagged array: {type(raw).__name__}")
    tag, values = raw[0], [v for v in raw[1:] if v is not None]
    fields: dict[str, Any] = {}
    p = 0

    def take(name: str, accepts: Any) -> None:
        nonlocal p
        if p < len(values) and accepts(values[p]):
            fields[name] = values[p]
            p += 1

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if tag == "BlockStored":
        take("block_hashes", lambda v: isinstance(v, list))
        take("parent", lambda v: not isinstance(v, list))
        take("token_ids", lambda v: isinstance(v, list))
        take("block_size", is_int)
        take("lora_id", is_int)
        take("medium", lambda v: isinstance(v, str))
        take("lora_name", lambda v: isinstance(v, str))
    elif tag == "BlockRemoved":
        take("block_hashes", lambda v: isinstance(v, list))
        take("medium", lambda v: isinstance(v, str))
    return tag, fields


def decode_batch(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The events of one payload, or :class:`Refused` for a batch the conductor cannot parse."""
    try:
        raw = _GENERIC.decode(payload)
    except msgspec.DecodeError as exc:
        raise Refused("not msgpack") from exc
    if not isinstance(raw, list) or len(raw) != 3:
        raise Refused(f"batch is not a 3-element array ({len(raw) if isinstance(raw, list) else type(raw).__name__})")
    events = raw[1] if isinstance(raw[1], list) else raw[2] if isinstance(raw[2], list) else None
    if events is None:
        raise Refused("no event list")
    return [_event(event) for event in events]


class OneWorker:
    """One registered (instance, dp_rank) of the conductor: every event credited to it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, int] = {}  # engine hash -> content chain key
        self.batches = 0
        self.refused = 0
        self.parent_not_found = 0
        self.dropped_block_size = 0

    def take(self, payload: bytes) -> bool:
        try:
            events = decode_batch(payload)
        except Refused:
            self.refused += 1
            return False
        self.batches += 1
        for tag, fields in events:
            self.apply(tag, fields)
        return True

    def apply(self, tag: str, fields: dict[str, Any]) -> None:
        if tag == "AllBlocksCleared":
            self.blocks.clear()
        elif tag == "BlockRemoved":
            for block_hash in _hashes(fields.get("block_hashes", [])):
                self.blocks.pop(block_hash, None)
        elif tag == "BlockStored":
            self._store(fields)

    def _store(self, fields: dict[str, Any]) -> None:
        size = fields.get("block_size", 0)
        if size and size != self.block_size:
            self.dropped_block_size += 1
            return
        hashes = _hashes(fields.get("block_hashes", []))
        tokens: Sequence[int] = fields.get("token_ids", [])
        parent = _hash(fields["parent"]) if "parent" in fields else None
        key = BASE_SEED
        if parent is not None:
            found = self.blocks.get(parent)
            if found is None:
                self.parent_not_found += 1
                return
            key = found
        for index, block_hash in enumerate(hashes):
            key = chain_next(key, local_block_hash(tokens[index * self.block_size : (index + 1) * self.block_size]))
            self.blocks[block_hash] = key

    def hit_blocks(self, token_ids: Sequence[int]) -> int:
        held = set(self.blocks.values())
        count = 0
        for key in sequence_keys(list(token_ids), self.block_size):
            if key not in held:
                break
            count += 1
        return count


def replay_three_frames(context: zmq.Context[Any], endpoint: str, start_seq: int = 0) -> list[tuple[int, bytes]]:
    """The conductor's replay: ``[b"", start_seq]``, then (delimiter, seq, payload) frame by
    frame until the end seq; a reply of another shape desynchronises it (raises)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(endpoint)
    try:
        dealer.send(b"", zmq.SNDMORE)
        dealer.send(start_seq.to_bytes(8, "big"))
        replies: list[tuple[int, bytes]] = []
        while True:
            dealer.recv()  # delimiter
            seq_frame = dealer.recv()
            payload = dealer.recv()
            if len(seq_frame) != 8:
                raise Refused(f"bad seq length {len(seq_frame)}")
            seq = int.from_bytes(seq_frame, "big")
            if seq == END_SEQ:
                return replies
            replies.append((seq, payload))
    finally:
        dealer.close(linger=0)
