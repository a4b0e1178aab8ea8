"""The contract module: every shape in the wild decodes, our encodings round-trip."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvpub import wire
from sglang_kvpub.wire import AllBlocksCleared, BatchDecoder, BatchEncoder, BlockRemoved, BlockStored, EventBatch

pytestmark = pytest.mark.unit

TOKENS = list(range(100, 108))


def _decode(raw: object) -> EventBatch:
    return BatchDecoder().decode(msgpack.packb(raw))


# --------------------------------------------------------------- shapes from the wild


def test_sglang_0_4_10_tagged_arrays_without_medium() -> None:
    # SGLang 0.4.10-0.5.5: [tag, hashes, parent, tokens, block_size, lora_id]; 2-field batch.
    batch = _decode([1.0, [["BlockStored", [11, 12], None, TOKENS, 4, None], ["BlockRemoved", [11]]]])
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [11, 12]
    assert stored.medium is None and stored.block_size == 4 and stored.token_ids == TOKENS
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11] and removed.medium is None
    assert batch.dp_rank is None


def test_sglang_0_5_9_arrays_with_trailing_medium() -> None:
    batch = _decode([1.0, [["BlockStored", [-5], 7, TOKENS[:4], 4, None, "CPU_PINNED"], ["AllBlocksCleared"]], 2])
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.medium == "CPU_PINNED" and stored.parent_block_hash == 7 and stored.block_hashes == [-5]
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.dp_rank == 2


def test_sglang_0_5_18_metadata_map_is_read_as_cache_salt() -> None:
    event = ["BlockStoredWithMetadata", [1], None, TOKENS[:4], 4, None, "GPU", {"cache_salt": "tenant-a"}]
    (stored,) = _decode([1.0, [event], 0]).events
    assert isinstance(stored, BlockStored)
    assert stored.cache_salt == "tenant-a" and stored.lora_name is None


def test_sglang_0_5_23_tagged_maps_with_optional_fields() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "cache_salt": "s",
        "session_id": "sess",
        "lora_name": "adapter",
    }
    decoder = BatchDecoder()
    (stored,) = decoder.decode(msgpack.packb([1.0, [event], 3])).events
    assert isinstance(stored, BlockStored)
    assert (stored.cache_salt, stored.session_id, stored.lora_name) == ("s", "sess", "adapter")
    assert decoder.stats.slow_path == 0


def test_vllm_arrays_with_bytes_hashes_and_extra_positions() -> None:
    digest = bytes(range(32))
    event = ["BlockStored", [digest], None, TOKENS[:4], 4, None, "GPU", "lora-x", None, 0, "full_attention", None]
    (stored,) = _decode([1.0, [event], 0]).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [int.from_bytes(digest[-8:], "big")]
    assert stored.lora_name == "lora-x"


def test_vllm_maps_ignore_unknown_fields() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [9],
        "parent_block_hash": None,
        "token_ids": TOKENS[:4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["mm", 1]],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "local",
    }
    stored, removed = _decode([1.0, [event, {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}], 1]).events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [9]
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"


def test_batch_with_rank_before_events_is_accepted() -> None:
    batch = _decode([1.0, 5, [["AllBlocksCleared"]]])
    assert batch.dp_rank == 5 and isinstance(batch.events[0], AllBlocksCleared)


def test_unknown_event_types_are_counted_and_skipped() -> None:
    decoder = BatchDecoder()
    batch = decoder.decode(msgpack.packb([1.0, [{"type": "Mystery", "x": 1}, ["AllBlocksCleared"]], 0]))
    assert [type(e) for e in batch.events] == [AllBlocksCleared]
    assert decoder.stats.unknown_events == 1


def test_merged_multi_block_store_is_split_by_block_size() -> None:
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=4)
    assert wire.split_stored(stored) == [(1, TOKENS[:4]), (2, TOKENS[4:])]


# --------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ([1.0, [["BlockStored", [1], None, [1, 2, 3], 4, None]], 0], "token_ids/block_size mismatch"),
        ([1.0, [["BlockStored", [1.5], None, [1, 2, 3, 4], 4, None]], 0], "bad hash"),
        ([1.0, [["BlockStored", ["not-a-hash"], None, [1, 2, 3, 4], 4, None]], 0], "bad hash"),
        ([1.0, [["BlockRemoved", [b""]]], 0], "bad hash"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0, None]], 0], "bad BlockStored"),
        ([1.0, [["BlockStored", [], None, [], 4, None]], 0], "bad BlockStored"),
        ([1.0, [["BlockStored", [1], None, ["a", "b"], 1, None]], 0], "bad token_ids"),
        ([1.0, [42], 0], "bad event"),
        (["ts", [], 0], "bad batch"),
        ({"ts": 1.0}, "bad batch"),
        ([1.0], "bad batch"),
        ([1.0, 2, 3], "bad batch"),
    ],
)
def test_malformed_payloads_raise_one_typed_error(raw: object, reason: str) -> None:
    decoder = BatchDecoder()
    with pytest.raises(wire.WireError) as info:
        decoder.decode(msgpack.packb(raw))
    assert info.value.reason == reason
    assert decoder.stats.errors == 1


def test_non_msgpack_and_truncated_payloads() -> None:
    good = BatchEncoder().encode(EventBatch(ts=1.0, events=[AllBlocksCleared()], dp_rank=0))
    for payload in (b"\xc1", good[:-3], b""):
        with pytest.raises(wire.WireError):
            BatchDecoder().decode(payload)


def test_payload_and_event_limits() -> None:
    limits = wire.DecodeLimits(max_payload_bytes=128, max_events=2)
    big = msgpack.packb([1.0, [["AllBlocksCleared"]] * 3, 0])
    with pytest.raises(wire.WireError, match="too many events"):
        BatchDecoder(limits).decode(big)
    with pytest.raises(wire.WireError, match="payload too large"):
        BatchDecoder(limits).decode(b"\x90" * 129)


def test_non_finite_timestamp_is_rejected() -> None:
    with pytest.raises(wire.WireError):
        BatchDecoder().decode(msgpack.packb([math.nan, [], 0]))


# --------------------------------------------------------------- encoding


def test_enrich_sets_rank_medium_block_size_and_hash_form() -> None:
    batch = EventBatch(
        ts=1.0,
        events=[
            BlockStored(block_hashes=[-1], parent_block_hash=-2, token_ids=TOKENS[:4], block_size=4),
            BlockRemoved(block_hashes=[-1]),
        ],
    )
    wire.enrich_batch(batch, dp_rank=7, block_size=4, hash_form="u64")
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert batch.dp_rank == 7
    assert stored.block_hashes == [(1 << 64) - 1] and stored.parent_block_hash == (1 << 64) - 2
    assert stored.medium == removed.medium == "GPU"
    wire.enrich_batch(batch, dp_rank=7, block_size=4, hash_form="i64")
    assert stored.block_hashes == [-1]


def test_map_encoding_keeps_fields_sglang_requires() -> None:
    payload = BatchEncoder("map").encode(
        EventBatch(ts=2.0, events=[BlockStored(block_hashes=[1], token_ids=TOKENS[:4], block_size=4)], dp_rank=1)
    )
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (2.0, 1)
    assert events[0]["type"] == "BlockStored"
    assert "parent_block_hash" in events[0] and "lora_id" in events[0]


def test_array_encoding_is_positional() -> None:
    payload = BatchEncoder("array").encode(
        EventBatch(
            ts=2.0,
            events=[
                BlockStored(block_hashes=[1], token_ids=TOKENS[:4], block_size=4, medium="GPU"),
                AllBlocksCleared(),
            ],
            dp_rank=1,
        )
    )
    _, events, _ = msgpack.unpackb(payload)
    assert events == [["BlockStored", [1], None, TOKENS[:4], 4, None, "GPU", None], ["AllBlocksCleared"]]


def test_unknown_encoding_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'map' or 'array'"):
        BatchEncoder("json")  # type: ignore[arg-type]


_hash = st.integers(min_value=0, max_value=(1 << 64) - 1)
_medium = st.sampled_from([None, "GPU", "CPU_PINNED", "DISK"])


@st.composite
def _events(draw: st.DrawFn) -> wire.Event:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    hashes = draw(st.lists(_hash, min_size=1, max_size=4))
    if kind == "removed":
        return BlockRemoved(block_hashes=hashes, medium=draw(_medium))
    size = draw(st.integers(min_value=1, max_value=8))
    tokens = draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=size * len(hashes), max_size=size * len(hashes)))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | _hash),
        token_ids=tokens,
        block_size=size,
        medium=draw(_medium),
        lora_name=draw(st.none() | st.text(max_size=5)),
    )


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(_events(), max_size=8),
    rank=st.none() | st.integers(0, 1023),
    encoding=st.sampled_from(["map", "array"]),
    form=st.sampled_from(["u64", "i64"]),
)
def test_encode_then_decode_is_lossless(
    events: list[wire.Event], rank: int | None, encoding: wire.EventEncoding, form: wire.HashForm
) -> None:
    batch = EventBatch(ts=12.5, events=events, dp_rank=rank)
    convert = wire.to_u64 if form == "u64" else wire.to_i64
    for event in events:
        if isinstance(event, (BlockStored, BlockRemoved)):
            event.block_hashes = [convert(h) for h in event.block_hashes]
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            event.parent_block_hash = convert(event.parent_block_hash)
    decoded = BatchDecoder().decode(BatchEncoder(encoding).encode(batch))
    assert decoded == batch


# --------------------------------------------------------------- frames and seqs


def test_live_frames_round_trip() -> None:
    frames = wire.live_frames(b"kv", 5, b"payload")
    assert frames[1] == (5).to_bytes(8, "big")
    assert wire.parse_live_frames(frames) == (b"kv", 5, b"payload")
    with pytest.raises(wire.WireError):
        wire.parse_live_frames([b"kv", b"\x00", b"p"])
    with pytest.raises(wire.WireError):
        wire.parse_live_frames([b"kv", b"p"])


def test_epoch_lives_in_the_top_bits_of_seq() -> None:
    seq = wire.make_seq(123, 456)
    assert (wire.seq_epoch(seq), wire.seq_counter(seq)) == (123, 456)
    assert wire.make_seq(123, 457) == seq + 1
    assert seq < 1 << 64


def test_replay_request_and_reply_frames() -> None:
    request = wire.replay_request_frames(42)
    assert request == [b"", (42).to_bytes(8, "big")]
    assert wire.parse_replay_request([b"id", *request]) == (b"id", 42, False)
    assert wire.parse_replay_request([b"id", *wire.replay_request_frames(42, snapshot=True)]) == (b"id", 42, True)
    with pytest.raises(wire.WireError):
        wire.parse_replay_request([b"id", b"x", b"12345678"])
    reply = wire.replay_reply_frames(b"id", b"kv", 42, b"p")[1:]  # what a DEALER receives
    assert wire.parse_replay_reply(reply) == wire.ReplayReply(b"kv", 42, b"p")
    assert wire.parse_replay_reply(wire.replay_end_frames(b"id")[1:]).is_end


def test_older_two_frame_replay_replies() -> None:
    seq8 = (9).to_bytes(8, "big")
    assert wire.parse_replay_reply([b"", seq8, b"p"]) == wire.ReplayReply(b"", 9, b"p")
    assert wire.parse_replay_reply([b"", wire.END_SEQ_BYTES, b""]).is_end


def test_batch_to_json_shape() -> None:
    batch = EventBatch(
        ts=1.0,
        events=[
            BlockStored(block_hashes=[1], token_ids=TOKENS[:4], block_size=4, medium="GPU"),
            BlockRemoved(block_hashes=[1], medium="GPU"),
            AllBlocksCleared(),
        ],
        dp_rank=3,
    )
    assert wire.batch_to_json(7, batch) == {
        "seq": 7,
        "ts": 1.0,
        "dp_rank": 3,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": TOKENS[:4],
                "block_size": 4,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
    }


def test_hash_from_wire_range_and_forms() -> None:
    assert wire.hash_from_wire(-(1 << 63)) == -(1 << 63)
    assert wire.hash_from_wire("0x10") == 16
    assert wire.hash_from_wire(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5
    for bad in (1 << 64, -(1 << 63) - 1, True, None):
        with pytest.raises(wire.WireError):
            wire.hash_from_wire(bad)


def test_positional_arrays_take_a_typed_fast_path() -> None:
    batch = EventBatch(
        ts=3.0,
        events=[
            BlockStored(block_hashes=[1, 2], token_ids=TOKENS, block_size=4, medium="GPU", lora_name="a"),
            BlockRemoved(block_hashes=[2], medium="GPU"),
            AllBlocksCleared(),
        ],
        dp_rank=4,
    )
    decoder = BatchDecoder()
    assert decoder.decode(BatchEncoder("array").encode(batch)) == batch
    old_sglang = msgpack.packb([1.0, [["BlockStored", [7], None, TOKENS[:4], 4, None]], 0])
    stored = decoder.decode(old_sglang).events[0]
    assert isinstance(stored, BlockStored) and stored.medium is None
    assert decoder.stats.slow_path == 0
