"""The fast paths behave exactly like the paths they replace.

- fan-in: rank payloads decoded with token ids left as msgpack (``RawBatch``) build the
  same residency as fully decoded batches; queued residency updates are applied in order,
  also across a rank restart; malformed / untagged payloads still take the full path;
- service: u32-packed tokens (hashed from their buffer) give the list's ``sequence_keys``; bad ids are a
  400 ``bad_field``;
- scoring: ``fold_engine_dps`` picks the same rank as the rule it documents.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_adapter.scoring import KvAffinityConfig, fold_engine_dps, weighted_blocks
from motor_adapter.service import RequestError, u32_tokens
from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.index import TierHit
from sglang_kvpub.core.residency import RankResidency, RawBatch, RawStored, raw_batch_decoder
from sglang_kvpub.publish.fanin import FanIn

pytestmark = pytest.mark.unit

BS = 4


def residency_state(res: RankResidency) -> dict[str, dict[int, tuple[int | None, list[int]]]]:
    return {m: {h: (res.parent(h, m), res.tokens(h, m)) for h in res.hashes(m)} for m in res.counts()}


def random_batch(rng: random.Random, known: list[int]) -> wire.EventBatch:
    events: list[wire.Event] = []
    for _ in range(rng.randint(1, 5)):
        roll = rng.random()
        if roll < 0.6:
            blocks = rng.choice([1, 1, 1, 2, 3])
            hashes = [rng.choice([rng.getrandbits(64), -rng.getrandbits(63)]) for _ in range(blocks)]
            parent = rng.choice([None, *known[-3:]]) if known else None
            tokens = [rng.choice([rng.randrange(128), rng.randrange(200_000), 2**40]) for _ in range(blocks * BS)]
            lora = rng.choice([None, None, "adapter"])
            medium = rng.choice([None, wire.MEDIUM_GPU, wire.MEDIUM_CPU])
            events.append(
                wire.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BS,
                    medium=medium,
                    lora_name=lora,
                )
            )
            known.extend(hashes)
        elif roll < 0.95 and known:
            events.append(wire.BlockRemoved(block_hashes=rng.sample(known, min(2, len(known)))))
        else:
            events.append(wire.AllBlocksCleared())
    return wire.EventBatch(ts=1.0, events=events, dp_rank=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_raw_decoded_batches_build_the_same_residency(seed: int) -> None:
    rng = random.Random(seed)
    encoder = msgspec.msgpack.Encoder()
    full, fast = RankResidency(), RankResidency()
    decoder = raw_batch_decoder()
    known: list[int] = []
    for _ in range(8):
        payload = encoder.encode(random_batch(rng, known))
        full.apply_all(msgspec.msgpack.decode(payload, type=wire.EventBatch).events)
        raw = decoder.decode(payload)
        assert raw.tokens_look_valid()
        fast.apply_all(raw.events)
    assert residency_state(fast) == residency_state(full)
    assert [msgspec.to_builtins(e) for e in fast.snapshot_events()] == [
        msgspec.to_builtins(e) for e in full.snapshot_events()
    ]


def test_raw_tokens_that_are_not_ints_are_skipped_in_snapshots() -> None:
    res = RankResidency()
    bad = RawStored(block_hashes=[1], token_ids=msgspec.Raw(msgspec.msgpack.encode(["x", "y"])), block_size=2)
    good = RawStored(block_hashes=[2], parent_block_hash=1, token_ids=msgspec.Raw(msgspec.msgpack.encode([5, 6])))
    res.apply_all([bad, good])
    events = res.snapshot_events()
    stored = [e for e in events if isinstance(e, wire.BlockStored)]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [([2], 1, [5, 6])]
    with pytest.raises(wire.WireError):
        res.tokens(1)


def test_tokens_look_valid_rejects_a_non_array() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "abc"}], 0])
    assert not raw_batch_decoder().decode(payload).tokens_look_valid()
    assert isinstance(raw_batch_decoder().decode(payload), RawBatch)


class _Published:
    """The fan-in's PUB replaced by an inproc PAIR (no subscription to wait for): the hot
    path sends real frames; ``frames`` reads everything sent so far."""

    def __init__(self, ctx: zmq.Context[Any], name: str) -> None:
        self.socket = ctx.socket(zmq.PAIR)
        self.socket.bind(f"inproc://{name}")
        self.reader = ctx.socket(zmq.PAIR)
        self.reader.connect(f"inproc://{name}")
        self._frames: list[bytes] = []

    @property
    def frames(self) -> list[bytes]:
        while self.reader.poll(0):
            self._frames.extend(self.reader.recv_multipart())
        return self._frames


@pytest.fixture
def fanin_and_pub() -> Iterator[tuple[FanIn, _Published]]:
    ctx: zmq.Context[Any] = zmq.Context()
    fanin = FanIn(PluginConfig(endpoint="tcp://127.0.0.1:1", bind=True), 2, listen_channel=False, context=ctx)
    published = _Published(ctx, f"fanin-hot-path-{id(fanin)}")
    fanin._pub = published.socket  # no bound endpoints: the hot path only
    yield fanin, published
    ctx.destroy(linger=0)


def _payload(events: list[wire.Event], dp_rank: int | None) -> bytes:
    batch = wire.enrich_batch(wire.EventBatch(ts=1.0, events=events), dp_rank=0, block_size=BS)
    batch.dp_rank = dp_rank
    return wire.BatchEncoder().encode(batch)


def _stored(block_hash: int, parent: int | None = None) -> wire.BlockStored:
    return wire.BlockStored(block_hashes=[block_hash], parent_block_hash=parent, token_ids=[1, 2, 3, 4], block_size=BS)


def test_fanin_forwards_tagged_payloads_as_is_and_queues_residency(
    fanin_and_pub: tuple[FanIn, _Published],
) -> None:
    fanin, pub = fanin_and_pub
    first, second = _payload([_stored(10)], 0), _payload([_stored(11, 10)], 0)
    fanin._forward(0, 7, 0, first, 1.0, 1.0)
    fanin._forward(0, 7, 1, second, 1.0, 1.0)
    assert pub.frames == [] and fanin._outbox == [first, second]  # a burst is checked first ...
    fanin._publish_outbox()
    assert pub.frames[2::3] == [first, second]  # ... then published as is, back to back, in order
    assert 0 not in fanin._residency  # queued, not yet applied
    stats: dict[str, Any] = fanin.stats()  # readers apply the queue first
    assert stats["ranks"][0]["resident"] == {wire.MEDIUM_GPU: 2}
    assert fanin._residency[0].tokens(11) == [1, 2, 3, 4]


def test_fanin_restart_applies_the_old_epoch_before_clearing(fanin_and_pub: tuple[FanIn, _Published]) -> None:
    fanin, pub = fanin_and_pub
    fanin._forward(1, 7, 0, _payload([_stored(10)], 1), 1.0, 1.0)
    fanin._forward(1, 8, 0, _payload([_stored(20)], 1), 1.0, 1.0)  # new rank epoch
    fanin._publish_outbox()
    fanin._apply_pending()
    assert fanin._residency[1].hashes() == [20]
    published = [msgspec.msgpack.decode(p, type=wire.EventBatch).events for p in pub.frames[2::3]]
    assert [type(events[0]) for events in published] == [wire.BlockStored, wire.AllBlocksCleared, wire.BlockStored]


def test_fanin_untagged_and_malformed_payloads_take_the_full_path(fanin_and_pub: tuple[FanIn, _Published]) -> None:
    fanin, pub = fanin_and_pub
    fanin._forward(1, 7, 0, _payload([_stored(10)], None), 1.0, 1.0)
    fanin._publish_outbox()
    retagged = msgspec.msgpack.decode(pub.frames[-1], type=wire.EventBatch)
    assert retagged.dp_rank == 1
    sent = len(pub.frames)
    fanin._forward(1, 7, 1, b"\xc1 nope", 1.0, 1.0)
    fanin._publish_outbox()
    assert len(pub.frames) == sent and fanin.stats()["malformed"] == 1
    assert fanin._residency[1].hashes() == [10]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=700), st.sampled_from([1, 16, 128]))
def test_u32_buffer_keys_equal_sequence_keys(tokens: list[int], block_size: int) -> None:
    assert sequence_keys(u32_tokens(tokens), block_size) == sequence_keys(tokens, block_size)


@pytest.mark.parametrize("bad", [[1, -5], [2**32], [1, "x"]])
def test_u32_tokens_rejects_out_of_range_ids(bad: list[Any]) -> None:
    with pytest.raises(RequestError) as info:
        u32_tokens(bad)
    assert info.value.status == 400 and info.value.reason == "bad_field"


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 15), st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9))))
def test_fold_picks_the_documented_best_rank(ranks: dict[int, tuple[int, int, int]]) -> None:
    cfg = KvAffinityConfig(block_size=BS)
    hits = {rank: TierHit(n, c, d) for rank, (n, c, d) in ranks.items()}
    folded = fold_engine_dps(hits, cfg)
    candidates = [
        ((weighted_blocks(h, cfg), h.npu_blocks, n + c + d, -rank), rank)
        for rank, h in hits.items()
        for n, c, d in [ranks[rank]]
        if n + c + d > 0
    ]
    if not candidates:
        assert folded is None
        return
    _, best = max(candidates)
    assert folded is not None and folded.dp_rank == best
    assert (folded.npu_blocks, folded.cpu_blocks, folded.disk_blocks) == ranks[best]
    assert folded.weighted == weighted_blocks(hits[best], cfg)
