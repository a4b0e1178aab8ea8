"""RankResidency: announced state per medium and snapshots that rebuild it exactly."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvpub.core.residency import BYTES_PER_BLOCK_OVERHEAD, RankResidency
from sglang_kvpub.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

pytestmark = pytest.mark.unit

BS = 4


def stored(hashes: list[int], parent: int | None, medium: str | None = MEDIUM_GPU, base: int = 0) -> BlockStored:
    tokens = [base + i for i in range(len(hashes) * BS)]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, medium=medium)


def state(res: RankResidency) -> dict[str, dict[int, tuple[int | None, list[int]]]]:
    return {m: {h: (res.parent(h, m), res.tokens(h, m)) for h in res.hashes(m)} for m in res.counts()}


def rebuild(events: list[Event]) -> RankResidency:
    other = RankResidency()
    other.apply_all(events)
    return other


def test_store_remove_clear_per_medium() -> None:
    res = RankResidency()
    res.apply(stored([1, 2, 3], None))
    res.apply(stored([2], 1, MEDIUM_CPU))
    assert res.counts() == {MEDIUM_GPU: 3, MEDIUM_CPU: 1}
    assert res.parent(3) == 2 and res.parent(1) is None
    assert res.tokens(2) == [4, 5, 6, 7]
    res.apply(BlockRemoved(block_hashes=[3, 99], medium=MEDIUM_GPU))
    assert res.counts() == {MEDIUM_GPU: 2, MEDIUM_CPU: 1}
    assert res.unknown_removals == 1
    res.apply(BlockRemoved(block_hashes=[2], medium=MEDIUM_CPU))
    assert res.contains(2, MEDIUM_GPU) and not res.contains(2, MEDIUM_CPU)
    res.apply(AllBlocksCleared())
    assert len(res) == 0 and res.counts() == {}


def test_medium_none_means_default_medium() -> None:
    res = RankResidency()
    res.apply(stored([5], None, medium=None))
    assert res.contains(5, MEDIUM_GPU)
    res.apply(BlockRemoved(block_hashes=[5]))
    assert len(res) == 0


def test_snapshot_merges_chains_and_keeps_parents_first() -> None:
    res = RankResidency()
    res.apply(stored([10, 11, 12], None))
    res.apply(stored([20], 11, base=100))  # branch under 11
    res.apply(stored([13], 12, base=200))
    events = res.snapshot_events(max_blocks_per_event=64)
    assert isinstance(events[0], AllBlocksCleared)
    chains = [e.block_hashes for e in events[1:] if isinstance(e, BlockStored)]
    assert chains == [[10, 11, 12], [20], [13]]  # 13 continues 12 but 20 came in between
    assert state(rebuild(events)) == state(res)


def test_snapshot_orders_parent_stored_after_child() -> None:
    res = RankResidency()
    res.apply(stored([1, 2], None))
    res.apply(BlockRemoved(block_hashes=[1], medium=MEDIUM_GPU))
    res.apply(stored([1], None, base=50))  # parent re-stored after its child: dict order is child first
    seen: list[int] = []
    for event in res.iter_snapshot_events():
        seen.extend(event.block_hashes)
    assert seen.index(1) < seen.index(2)
    assert state(rebuild(res.snapshot_events())) == state(res)


def test_snapshot_respects_max_blocks_per_event() -> None:
    res = RankResidency()
    res.apply(stored(list(range(1, 11)), None))
    events = list(res.iter_snapshot_events(max_blocks_per_event=3))
    assert [len(e.block_hashes) for e in events] == [3, 3, 3, 1]
    assert events[1].parent_block_hash == 3


def test_negative_hashes_wide_tokens_and_extras_survive() -> None:
    res = RankResidency()
    res.apply(stored([-5], None))
    event = stored([-6], -5)
    event.token_ids = [2**40, 1, 2, 3]
    res.apply(event)
    lora = stored([7], -6)
    lora.lora_name = "adapter"
    lora.cache_salt = "salt"
    res.apply(lora)
    assert res.parent(-6) == -5
    assert res.tokens(-6)[0] == 2**40
    events = res.snapshot_events()
    rebuilt = rebuild(events)
    assert state(rebuilt) == state(res)
    lora_events = [e for e in events if isinstance(e, BlockStored) and 7 in e.block_hashes]
    assert lora_events[0].lora_name == "adapter" and lora_events[0].cache_salt == "salt"
    assert lora_events[0].block_hashes == [7]  # never merged across metadata


def test_copy_is_frozen() -> None:
    res = RankResidency()
    res.apply(stored([1], None))
    frozen = res.copy()
    res.apply(stored([2], 1))
    res.apply(BlockRemoved(block_hashes=[1], medium=MEDIUM_GPU))
    assert frozen.hashes() == [1]


def test_cycles_do_not_hang() -> None:
    res = RankResidency()
    res.apply(stored([1], 2))
    res.apply(stored([2], 1))
    hashes = sorted(h for e in res.iter_snapshot_events() for h in e.block_hashes)
    assert hashes == [1, 2]


def test_memory_per_block_128_tokens() -> None:
    res = RankResidency()
    for i in range(1, 2001):
        res.apply(
            BlockStored(block_hashes=[i], parent_block_hash=i - 1 or None, token_ids=list(range(128)), block_size=128)
        )
    blocks = res._media[MEDIUM_GPU]
    measured = sum(sys.getsizeof(v) + sys.getsizeof(k) for k, v in blocks.items()) + sys.getsizeof(blocks)
    per_block = measured / len(blocks)
    assert per_block < 700  # 1M blocks x 128 tokens fit in well under 1 GB
    assert abs(res.approx_bytes() / len(blocks) - (BYTES_PER_BLOCK_OVERHEAD + 512)) < 1


ops = st.lists(
    st.tuples(st.sampled_from(["store", "store", "store", "remove", "clear"]), st.integers(0, 2**32), st.booleans()),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_snapshot_rebuilds_any_history(history: list[tuple[str, int, bool]]) -> None:
    rng = random.Random(0)
    res = RankResidency()
    known: list[int] = []
    for op, value, cpu in history:
        medium = MEDIUM_CPU if cpu else MEDIUM_GPU
        if op == "store":
            parent = rng.choice(known) if known and value % 3 else None
            count = 1 + value % 4
            hashes = [(value + i * 7919) % 1000 for i in range(count)]
            res.apply(stored(hashes, parent, medium, base=value % 1000))
            known.extend(hashes)
        elif op == "remove" and known:
            res.apply(BlockRemoved(block_hashes=[rng.choice(known)], medium=medium))
        elif op == "clear":
            res.apply(AllBlocksCleared())
    events = res.snapshot_events(max_blocks_per_event=3)
    assert state(rebuild(events)) == state(res)
    # prefix order: a parent present in the same medium is stored before its child
    for medium in res.counts():
        position: dict[int, int] = {}
        for event in events:
            if isinstance(event, BlockStored) and event.medium == medium:
                for h in event.block_hashes:
                    position.setdefault(h, len(position))
        for h in res.hashes(medium):
            parent = res.parent(h, medium)
            if parent is not None and res.contains(parent, medium) and not _in_cycle(res, h, medium):
                assert position[parent] < position[h]


def _in_cycle(res: RankResidency, start: int, medium: str) -> bool:
    """Whether following parents (same medium first, else any medium holding it) loops:
    random hashes can collide into cycles, for which no parents-first order exists."""
    seen = {(medium, start)}
    node = res.parent(start, medium)
    while node is not None:
        holders = [m for m in res.counts() if res.contains(node, m)]
        if not holders:
            return False
        medium = medium if medium in holders else holders[0]
        if (medium, node) in seen:
            return True
        seen.add((medium, node))
        node = res.parent(node, medium)
    return False


def test_snapshot_emits_a_parent_held_only_in_another_medium_first() -> None:
    """A device block whose parent page was demoted to host memory: parent first, so a
    consumer resolving parents per rank never meets an unknown one."""
    from sglang_kvpub.core.index import PrefixIndex
    from sglang_kvpub.wire import EventBatch

    tokens = [[10 * b + j for j in range(4)] for b in range(3)]
    live = [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens[0] + tokens[1], block_size=4),
        BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[2], block_size=4),
        BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=tokens[0] + tokens[1],
            block_size=4,
            medium="CPU_PINNED",
        ),
        BlockRemoved(block_hashes=[2], medium="GPU"),  # demoted: host copy stays, device child 3 stays
    ]
    residency = RankResidency()
    live_index = PrefixIndex(block_size=4)
    for event in live:
        residency.apply(event)
        live_index.apply_event("i", 0, event)
    snapshot = residency.snapshot_events()
    order = [(e.medium, h) for e in snapshot if isinstance(e, BlockStored) for h in e.block_hashes]
    assert order.index(("CPU_PINNED", 2)) < order.index(("GPU", 3))
    rebuilt = PrefixIndex(block_size=4)
    result = rebuilt.apply_batch("i", EventBatch(ts=0.0, events=snapshot), dp_rank=0)
    assert result.orphans == 0
    prompt = [t for block in tokens for t in block]
    assert rebuilt.query(prompt) == live_index.query(prompt)
    for medium in ("GPU", "CPU_PINNED"):
        assert rebuilt.resident("i", 0, medium) == live_index.resident("i", 0, medium)
