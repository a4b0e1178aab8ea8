"""StreamSubscriber's state machine driven directly, without sockets."""

from __future__ import annotations

from typing import Any

import pytest

from motor_adapter import stream
from motor_adapter.stream import StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.core.index import PrefixIndex

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

BLOCK_SIZE = 4
GPU = wire.MEDIUM_GPU
FAST = StreamOptions(replay_timeout_s=0.5, poll_s=0.02)


# ---------------------------------------------------------------------------- state machine (no sockets)


def _encoded(events: list[Any], rank: int | None = 0) -> tuple[wire.EventBatch, int]:
    payload = wire.BatchEncoder().encode(wire.EventBatch(ts=1.0, events=events, dp_rank=rank))
    return wire.BatchDecoder().decode(payload), hash(payload)


def _stored(*blocks: int) -> wire.BlockStored:
    tokens = [b for b in blocks for _ in range(BLOCK_SIZE)]
    return wire.BlockStored(block_hashes=list(blocks), token_ids=tokens, block_size=BLOCK_SIZE, medium=GPU)


def test_a_stale_old_epoch_batch_after_a_rebuild_does_not_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex(BLOCK_SIZE)
    sub = StreamSubscriber("inst", "tcp://127.0.0.1:1", index, replay_endpoint="tcp://127.0.0.1:2", options=FAST)
    new_epoch = wire.make_seq(9, 5)
    snap, digest = _encoded([wire.AllBlocksCleared(), _stored(7)])
    calls: list[bool] = []

    def fetch(start_seq: int, *, snapshot: bool) -> Any:
        calls.append(snapshot)
        return stream._Fetch(True, [stream._Item(new_epoch, snap, digest)])

    monkeypatch.setattr(sub, "_fetch", fetch)
    sub._last = wire.make_seq(3, 10)
    old, old_digest = _encoded([_stored(1)])
    sub._enqueue(stream._Item(wire.make_seq(2, 11), old, old_digest))  # an older epoch, arriving late
    sub._drain()
    assert len(calls) == 1  # one rebuild, then the stale batch is dropped
    assert index.resident("inst", 0, GPU) == {7}
    assert sub.health().last_seq == new_epoch
    sub.stop()


def test_live_buffer_is_bounded() -> None:
    sub = StreamSubscriber("inst", "tcp://127.0.0.1:1", PrefixIndex(BLOCK_SIZE), options=StreamOptions(live_buffer=2))
    for seq in range(5):
        sub._enqueue(stream._Item(seq, None, 0))
    assert [item.seq for item in sub._pending] == [3, 4]
    assert sub.health().dropped_live == 3
    sub.stop()


def _sub(index: PrefixIndex, replay: str | None = "tcp://127.0.0.1:2") -> StreamSubscriber:
    return StreamSubscriber("inst", "tcp://127.0.0.1:1", index, replay_endpoint=replay, options=FAST)


def test_late_live_copy_of_a_replayed_batch_is_skipped() -> None:
    index = PrefixIndex(BLOCK_SIZE)
    sub = _sub(index)
    one, one_digest = _encoded([_stored(1)])
    two, two_digest = _encoded([wire.BlockRemoved(block_hashes=[1], medium=GPU)])
    sub._last = 4
    sub._apply_replayed(stream._Item(5, one, one_digest))  # a replay gave 5 before the live copy came
    sub._enqueue(stream._Item(5, one, one_digest))
    sub._enqueue(stream._Item(6, two, two_digest))
    sub._drain()
    health = sub.health()
    assert (health.gaps, health.restarts, health.last_seq) == (0, 0, 6)
    assert index.resident("inst", 0, GPU) == set()
    sub.stop()


def test_reused_seq_with_other_content_is_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex(BLOCK_SIZE)
    sub = _sub(index)
    old, old_digest = _encoded([_stored(1)])
    new, new_digest = _encoded([_stored(2)])
    history = [stream._Item(0, new, new_digest)]
    monkeypatch.setattr(sub, "_fetch", lambda start, *, snapshot: stream._Fetch(not snapshot, history))
    sub._last = 0
    sub._apply_replayed(stream._Item(0, old, old_digest))
    sub._enqueue(stream._Item(0, new, new_digest))  # seq 0 again, other content: a restarted plain publisher
    sub._drain()
    assert sub.health().restarts == 1
    assert index.resident("inst", 0, GPU) == {2}
    sub.stop()


def test_unfillable_gap_clears_scope_and_continues(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PrefixIndex(BLOCK_SIZE)
    sub = StreamSubscriber(
        "inst", "tcp://127.0.0.1:1", index, replay_endpoint="tcp://127.0.0.1:2", dp_rank_override=3, options=FAST
    )
    index.apply_batch("inst", _encoded([_stored(1, 2)])[0], dp_rank=3)
    index.apply_batch("inst", _encoded([_stored(8)])[0], dp_rank=4)
    monkeypatch.setattr(sub, "_fetch", lambda start, *, snapshot: stream._Fetch(False, []))  # endpoint silent
    sub._last = 10
    batch, digest = _encoded([_stored(5)])
    sub._enqueue(stream._Item(20, batch, digest))
    sub._drain()
    assert index.resident("inst", 3, GPU) == {5}  # stale blocks gone: the rank was rebuilt from seq 20
    assert index.resident("inst", 4, GPU) == {8}  # compat mode: other ranks untouched
    assert sub.health().gaps == 1
    assert sub.health().last_seq == 20
    sub.stop()


def test_a_new_epoch_found_by_a_resync_counts_as_one_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reconnect's snapshot can come from a restarted fan-in before any of its live batches.
    index = PrefixIndex(BLOCK_SIZE)
    sub = _sub(index)
    first, first_digest = _encoded([_stored(1)])
    sub._last = wire.make_seq(3, 0) - 1
    sub._enqueue(stream._Item(wire.make_seq(3, 0), first, first_digest))
    sub._drain()
    snap, digest = _encoded([wire.AllBlocksCleared(), _stored(7)])
    monkeypatch.setattr(
        sub, "_fetch", lambda start, *, snapshot: stream._Fetch(True, [stream._Item(wire.make_seq(4, 2), snap, digest)])
    )
    assert sub._full_sync(None)
    health = sub.health()
    assert (health.restarts, health.epoch) == (1, 4)
    assert index.resident("inst", 0, GPU) == {7}
    later, later_digest = _encoded([_stored(8)])
    sub._enqueue(stream._Item(wire.make_seq(4, 3), later, later_digest))
    sub._drain()
    assert sub.health().restarts == 1  # the epoch's live batches are no second restart
    sub.stop()
