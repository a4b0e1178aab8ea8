"""``wire.adopt_batch``: SGLang's own event structs read field by field, as the rank publisher does
every scheduler step, must give exactly what the validating msgpack round trip gives - and
hand back everything it is not certain of to that round trip."""

from __future__ import annotations

import random
from typing import Any

import pytest
import sglang_real

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.publish.rank_publisher import RankPublisher

pytestmark = sglang_real.requires_sglang_kv_events

PAGE = 16


@pytest.fixture(scope="module")
def kv() -> Any:
    return sglang_real.load_kv_events()


def _signed_hash(rng: random.Random) -> int:
    return rng.getrandbits(64) - (1 << 63)


def _batch(kv: Any, rng: random.Random, pages: int = 6) -> Any:
    events: list[Any] = []
    parent = None
    for n in range(pages):
        block = _signed_hash(rng)
        medium = rng.choice([None, "GPU", kv.StorageMedium.CPU])
        events.append(
            kv.BlockStored(
                block_hashes=[block],
                parent_block_hash=parent,
                token_ids=list(range(n * PAGE, (n + 1) * PAGE)),
                block_size=PAGE,
                lora_id=None,
                medium=medium,
                cache_salt=rng.choice([None, "salt"]),
            )
        )
        parent = block
    events.append(kv.BlockRemoved(block_hashes=[_signed_hash(rng), rng.getrandbits(63)], medium=None))
    events.append(kv.AllBlocksCleared())
    return kv.KVEventBatch(ts=1234.5, events=events)


def _round_trip(batch: Any, hash_form: wire.HashForm) -> wire.EventBatch:
    """The general path: encode SGLang's batch, decode and validate it, enrich it."""
    import msgspec

    decoded = wire.BatchDecoder().decode(msgspec.msgpack.encode(batch))
    return wire.enrich_batch(decoded, dp_rank=3, block_size=PAGE, hash_form=hash_form)


@pytest.mark.parametrize("hash_form", ["u64", "i64"])
def test_adopted_batch_encodes_exactly_as_the_validating_round_trip(kv: Any, hash_form: wire.HashForm) -> None:
    rng = random.Random(7)
    encoder = wire.BatchEncoder("map")
    for _ in range(50):
        batch = _batch(kv, rng)
        expected = encoder.encode(_round_trip(batch, hash_form))
        adopted = wire.adopt_batch(batch, dp_rank=3, block_size=PAGE, hash_form=hash_form)
        assert adopted is not None
        assert encoder.encode(adopted) == expected
    decoded = wire.BatchDecoder().decode(encoder.encode(adopted))
    assert decoded.dp_rank == 3
    stored = [e for e in decoded.events if isinstance(e, wire.BlockStored)]
    assert {e.medium for e in stored} <= {"GPU", "CPU_PINNED"}
    hashes = [h for e in decoded.events if not isinstance(e, wire.AllBlocksCleared) for h in e.block_hashes]
    if hash_form == "u64":
        assert min(hashes) >= 0
    else:
        assert max(hashes) < 1 << 63


def test_an_empty_batch_is_adopted(kv: Any) -> None:
    adopted = wire.adopt_batch(kv.KVEventBatch(ts=1.0, events=[]), dp_rank=0, block_size=PAGE)
    assert adopted is not None and adopted.events == [] and adopted.dp_rank == 0


def _stored(kv: Any, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "block_hashes": [5],
        "parent_block_hash": None,
        "token_ids": list(range(PAGE)),
        "block_size": PAGE,
        "lora_id": None,
    }
    values.update(fields)
    return kv.BlockStored(**values)


@pytest.mark.parametrize(
    "fields",
    [
        {"block_hashes": []},
        {"block_hashes": [1 << 64]},
        {"block_hashes": [-(1 << 63) - 1]},
        {"block_hashes": [True]},
        {"parent_block_hash": 1 << 64},
        {"token_ids": list(range(PAGE - 1))},
        {"token_ids": [(t, t + 1) for t in range(PAGE)]},  # EAGLE bigram keys
        {"block_size": 0},
    ],
    ids=["no-hashes", "hash-too-big", "hash-too-small", "bool-hash", "parent-too-big", "short", "bigram", "size-0"],
)
def test_what_adopt_is_not_sure_of_goes_to_the_validating_path(kv: Any, fields: dict[str, Any]) -> None:
    batch = kv.KVEventBatch(ts=1.0, events=[_stored(kv), _stored(kv, **fields)])
    assert wire.adopt_batch(batch, dp_rank=0, block_size=0) is None


def test_an_unknown_event_type_goes_to_the_validating_path(kv: Any) -> None:
    class BlockMoved(kv.KVCacheEvent):  # type: ignore[misc,name-defined]
        block_hashes: list[int]

    batch = kv.KVEventBatch(ts=1.0, events=[_stored(kv), BlockMoved(block_hashes=[1])])
    assert wire.adopt_batch(batch, dp_rank=0, block_size=PAGE) is None


def test_the_rank_publisher_still_sends_what_adopt_hands_back(kv: Any, tmp_path: Any) -> None:
    """A bigram store (not adoptable) is converted by the round trip; a bad one is counted."""
    from sglang_kvpub.transport.packet_channel import PacketListener

    endpoint = f"unixpkt://{tmp_path}/ch.sock"
    listener = PacketListener(endpoint, 64)
    publisher = RankPublisher(PluginConfig(), 1, PAGE, endpoint)
    try:
        good = kv.KVEventBatch(ts=1.0, events=[_stored(kv, token_ids=[(t, t + 1) for t in range(PAGE)])])
        bad = kv.KVEventBatch(ts=2.0, events=[_stored(kv, block_hashes=[1 << 64])])
        assert publisher._payload(bad) is None
        payload = publisher._payload(good)
        assert payload is not None
        decoded = wire.BatchDecoder().decode(payload)
        (event,) = decoded.events
        assert isinstance(event, wire.BlockStored)
        assert event.token_ids == list(range(PAGE)) and decoded.dp_rank == 1 and event.medium == "GPU"
        assert publisher.stats["encode_errors"] == 1
    finally:
        publisher.shutdown()
        listener.close()
