"""The ``/query`` hot path: the index's one-pass fold, msgpack bodies and answers.

``PrefixIndex.deepest_npu`` must pick, per instance, exactly the rank and hit that folding
``query_keys`` with ``scoring.best_rank`` picks (while only NPU holds blocks). The service
caches a body's hashed keys, never its answer: the same body asked again sees the index
as it is now. A client whose ``Accept`` names msgpack gets the same answer in msgpack.
"""

from __future__ import annotations

import functools
import json
import random
import urllib.request
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_adapter import native as router_native
from motor_adapter.scoring import KvAffinityConfig, best_rank
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.index import PrefixIndex, TierHit
from tests.adapter.test_service import (  # noqa: F401  (pytest fixtures shared with test_service)
    BS,
    MODEL,
    MotorClient,
    Publisher,
    Server,
    connect,
    http,
    make_server,
    prompt,
    server,
    wait_for,
)
from tests.conftest import free_tcp_endpoint

IBS = 4  # the index tests' block size


def _store(index: PrefixIndex, instance: str, rank: int, tokens: list[int], medium: str = wire.MEDIUM_GPU) -> None:
    blocks = len(tokens) // IBS
    hashes = [random.getrandbits(62) + 1 for _ in range(blocks)]
    event = wire.BlockStored(block_hashes=hashes, token_ids=tokens[: blocks * IBS], block_size=IBS, medium=medium)
    index.apply_batch(instance, wire.EventBatch(ts=0.0, events=[event], dp_rank=rank))


def _fold(index: PrefixIndex, keys: list[int], instances: tuple[str, ...]) -> dict[str, tuple[int, TierHit]]:
    cfg = KvAffinityConfig(block_size=IBS)
    out: dict[str, tuple[int, TierHit]] = {}
    for instance, ranks in index.query_keys(keys, instances=instances).items():
        found = best_rank(ranks, cfg)
        if found is not None:
            out[instance] = (found[0], found[1])  # type: ignore[assignment]
    return out


def _indexed(
    stores: list[tuple[int, int, int, int]], query: tuple[int, int], asked: set[int], prompts: int
) -> tuple[PrefixIndex, list[int], tuple[str, ...]]:
    """An index holding ``(instance, rank, prompt, blocks)`` stores of ``prompts`` prompts,
    the keys of ``query`` = ``(prompt, blocks)`` with a block no one holds after them, and
    the instances asked."""
    bases = [[base * 1000 + i for i in range(12 * IBS)] for base in range(prompts)]
    index = PrefixIndex(IBS)
    for instance, rank, base, blocks in stores:
        _store(index, f"i{instance}", rank, bases[base][: blocks * IBS])
    base, blocks = query
    keys = sequence_keys([*bases[base][: blocks * IBS], 7, 7, 7, 7], IBS)
    return index, keys, tuple(f"i{i}" for i in sorted(asked))


@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(
    stores=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 3), st.integers(0, 8)), min_size=0, max_size=25
    ),
    query=st.tuples(st.integers(0, 3), st.integers(0, 10)),
    asked=st.sets(st.integers(0, 3), min_size=1),
)
def test_deepest_npu_equals_the_fold_of_query_keys(
    stores: list[tuple[int, int, int, int]], query: tuple[int, int], asked: set[int]
) -> None:
    index, keys, instances = _indexed(stores, query, asked, prompts=4)
    got = index.deepest_npu(keys, instances)
    assert got is not None
    assert {k: (r, h.npu_blocks) for k, (r, h) in got.items()} == {
        k: (r, h.npu_blocks) for k, (r, h) in _fold(index, keys, instances).items()
    }
    assert all(h.cpu_blocks == h.disk_blocks == 0 for _, h in got.values())


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(
    stores=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 47), st.integers(0, 2), st.integers(0, 8)), min_size=1, max_size=120
    ),
    query=st.tuples(st.integers(0, 2), st.integers(0, 10)),
    asked=st.sets(st.integers(0, 3), min_size=1),
)
def test_deepest_npu_over_wide_worker_masks_is_the_same_in_c_and_python(
    stores: list[tuple[int, int, int, int]], query: tuple[int, int], asked: set[int]
) -> None:
    """Up to 4 x 48 workers: masks of one to three 64-bit words, with single-worker keys
    (stored as ~wid) among them. The C walk (``wide_walk``) and the Python loop agree,
    and both are the fold of ``query_keys``."""
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here: only the Python walk exists")
    index, keys, instances = _indexed(stores, query, asked, prompts=3)
    in_c = index.deepest_npu(keys, instances)
    twin, _, _ = _indexed(stores, query, asked, prompts=3)  # the same masks, no walk remembered
    native, hashing.NATIVE = hashing.NATIVE, None
    try:
        in_python = twin.deepest_npu(keys, instances)
    finally:
        hashing.NATIVE = native
    assert in_c == in_python
    assert in_c is not None
    assert {k: (r, h.npu_blocks) for k, (r, h) in in_c.items()} == {
        k: (r, h.npu_blocks) for k, (r, h) in _fold(index, keys, instances).items()
    }


def _walk_reference(keys: list[int], masks: dict[int, int], held: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """``wide_walk``'s contract in Python: (position, workers whose prefix ends there) as a
    tuple (the index's memo key as it comes), depth."""
    ends: list[tuple[int, int]] = []
    position = 0
    for key in keys:
        holders = masks.get(key, 0)
        kept = held & (holders if holders >= 0 else 1 << ~holders)
        if kept != held and position:
            ends.append((position, held ^ kept))
        held = kept
        if not held:
            return tuple(ends), position
        position += 1
    if position:
        ends.append((position, held))
    return tuple(ends), position


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(
    words=st.integers(1, 16),
    data=st.data(),
)
def test_wide_walk_reads_masks_of_every_width_exactly(words: int, data: st.DataObject) -> None:
    """Worker masks of one to 16 words, bits at every digit and word boundary, ``~wid``
    single holders among them: the C walk's ends are the Python contract's."""
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    width = 64 * words
    bit = st.integers(0, width - 1)
    mask = st.one_of(
        st.integers(0, (1 << width) - 1),
        st.sets(bit, max_size=6).map(lambda bits: sum(1 << b for b in bits)),
        bit.map(lambda b: ~b),  # one holder
    )
    keys = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=24))
    masks = data.draw(st.dictionaries(st.integers(1, 40), mask, max_size=40))
    held = data.draw(st.integers(0, (1 << width) - 1))
    assert hashing.NATIVE.wide_walk(keys, masks, held, words) == _walk_reference(keys, masks, held)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(words=st.integers(1, 3), data=st.data())
def test_wide_walk_from_a_prior_walk_is_the_whole_walk(words: int, data: st.DataObject) -> None:
    """Given an earlier walk's keys and ends (the same workers, the same masks), the walk
    starts where the two key lists part and gives the whole walk's ends and depth: lists
    that share nothing, a few leading keys, all of them, one a prefix of the other; keys
    shared as the same objects or as equal ones; prior walks that ended early."""
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    width = 64 * words
    bit = st.integers(0, width - 1)
    mask = st.one_of(st.sets(bit, max_size=8).map(lambda bits: sum(1 << b for b in bits)), bit.map(lambda b: ~b))
    key = st.integers(1, 30).map(lambda k: (1 << 40) + k)  # past the small-int cache: equal is not identical
    masks = data.draw(st.dictionaries(key, mask, max_size=30))
    held = data.draw(st.integers(0, (1 << width) - 1))
    shared = data.draw(st.lists(key, max_size=16))
    prior = [*shared, *data.draw(st.lists(key, max_size=8))]
    tail = data.draw(st.lists(key, max_size=8))
    keys = [*shared, *tail] if data.draw(st.booleans()) else [*[int(str(k)) for k in shared], *tail]
    if not keys or not prior:
        return
    prior_ends, _ = hashing.NATIVE.wide_walk(prior, masks, held, words)
    whole = _walk_reference(keys, masks, held)
    assert hashing.NATIVE.wide_walk(keys, masks, held, words, prior, prior_ends) == whole
    assert hashing.NATIVE.wide_walk(keys, masks, held, words) == whole


@pytest.mark.unit
def test_wide_walk_refuses_a_prior_walk_it_cannot_read() -> None:
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    with pytest.raises(TypeError, match="together"):
        hashing.NATIVE.wide_walk([5], {5: 1}, 1, 1, [5])
    for bad in (((0, 1),), ((2, 1), (1, 1)), ((1, "x"),), (1,)):
        with pytest.raises((ValueError, TypeError)):
            hashing.NATIVE.wide_walk([5, 6], {5: 1, 6: 1}, 1, 1, [5, 7], bad)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(
    stores=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 2), st.integers(0, 8)), min_size=1, max_size=60
    ),
    asks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10), st.integers(0, 3)), min_size=2, max_size=12),
    writes=st.sets(st.integers(0, 11), max_size=4),
)
def test_prompts_sharing_leading_blocks_are_answered_as_walked_whole(
    stores: list[tuple[int, int, int, int]], asks: list[tuple[int, int, int]], writes: set[int]
) -> None:
    """``deepest_npu`` walks a new prompt from where its keys part from the last walk's (no
    change of the index since, the same workers): prompts of one family sharing 0-10 leading
    blocks then a tail of their own, asked in turn with writes between some, are answered
    as the Python walk of a twin index answers them."""
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    bases = [[base * 1000 + i for i in range(12 * IBS)] for base in range(3)]
    index, twin = PrefixIndex(IBS), PrefixIndex(IBS)
    for target in (index, twin):
        random.seed(5)
        for instance, rank, base, blocks in stores:
            _store(target, f"i{instance}", rank, bases[base][: blocks * IBS])
    asked = ("i0", "i1", "i2", "i3")
    for turn, (base, blocks, tail) in enumerate(asks):
        keys = sequence_keys([*bases[base][: blocks * IBS], *[7 + turn] * (tail * IBS)], IBS)
        if not keys:
            continue
        if turn in writes:  # the index changes: the last walk no longer holds
            for target in (index, twin):
                random.seed(turn)
                _store(target, "i1", 9, bases[base][: (blocks + 1) * IBS])
        native, hashing.NATIVE = hashing.NATIVE, None
        try:
            expected = twin.deepest_npu(keys, asked)
        finally:
            hashing.NATIVE = native
        assert index.deepest_npu(keys, asked) == expected


@pytest.mark.unit
def test_wide_walk_refuses_a_mask_wider_than_its_words() -> None:
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    for words in (1, 2, 3):
        top = (1 << (64 * words)) - 1
        assert hashing.NATIVE.wide_walk([5], {5: top}, top, words) == (((1, top),), 1)
        with pytest.raises(OverflowError):
            hashing.NATIVE.wide_walk([5], {5: 1 << (64 * words)}, 1, words)
        with pytest.raises(OverflowError):
            hashing.NATIVE.wide_walk([5], {5: (1 << (64 * words + 40)) | 1}, 1, words)


@pytest.mark.unit
def test_wide_walk_refuses_a_word_count_out_of_range() -> None:
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    with pytest.raises(ValueError, match="words must be in"):
        hashing.NATIVE.wide_walk([1], {}, 1, 17)
    assert hashing.NATIVE.wide_walk([5, 6], {5: (1 << 130) | 1, 6: ~130}, (1 << 130) | 1, 3) == (
        ((1, 1), (2, 1 << 130)),
        2,
    )


@pytest.mark.unit
def test_deepest_npu_defers_to_query_keys_once_another_tier_holds_blocks() -> None:
    index = PrefixIndex(IBS)
    tokens = list(range(3 * IBS))
    _store(index, "a", 0, tokens)
    keys = sequence_keys(tokens, IBS)
    assert index.deepest_npu(keys, ("a",)) == {"a": (0, TierHit(3, 0, 0))}
    _store(index, "a", 1, tokens, medium=wire.MEDIUM_CPU)
    assert index.deepest_npu(keys, ("a",)) is None


@pytest.mark.unit
def test_the_same_instances_tuple_sees_ranks_and_instances_that_appear_later() -> None:
    index = PrefixIndex(IBS)
    tokens = list(range(4 * IBS))
    keys = sequence_keys(tokens, IBS)
    asked = ("a", "b")
    _store(index, "a", 0, tokens[: 2 * IBS])
    assert index.deepest_npu(keys, asked) == {"a": (0, TierHit(2, 0, 0))}
    _store(index, "a", 5, tokens)  # a new rank of a known instance
    _store(index, "b", 1, tokens[: 3 * IBS])  # an instance the index did not know yet
    assert index.deepest_npu(keys, asked) == {"a": (5, TierHit(4, 0, 0)), "b": (1, TierHit(3, 0, 0))}
    index.clear_instance("a")
    assert index.deepest_npu(keys, asked) == {"b": (1, TierHit(3, 0, 0))}


@pytest.mark.unit
def test_deepest_npu_remembers_a_walk_until_its_worker_ids_name_other_ranks() -> None:
    """The same walk ends give the same (shared) answer; once an instance is cleared and
    its worker ids are recycled for another, the same ends name the new ranks."""
    index = PrefixIndex(IBS)
    tokens = list(range(3 * IBS))
    keys = sequence_keys(tokens, IBS)
    _store(index, "a", 0, tokens)
    first = index.deepest_npu(keys, ("a", "b"))
    assert first == {"a": (0, TierHit(3, 0, 0))}
    assert index.deepest_npu(keys, ("a", "b")) is first
    index.clear_instance("a")
    assert index.deepest_npu(keys, ("a", "b")) == {}
    _store(index, "b", 5, tokens)  # takes worker id 0 again: the same ends as before
    assert index.deepest_npu(keys, ("a", "b")) == {"b": (5, TierHit(3, 0, 0))}
    _store(index, "b", 2, tokens[: 2 * IBS])  # a new rank: other ends
    assert index.deepest_npu(keys, ("a", "b")) == {"b": (5, TierHit(3, 0, 0))}


_MEMO_STEPS = (
    "store",  # apply_batch
    "store_event",  # apply_event
    "remove",
    "all_cleared",
    "clear_rank",
    "clear_rank_gpu",
    "clear_instance",
    "cpu",  # another tier holds blocks: deepest_npu defers
    "clear_rank_cpu",
    "change_keys",  # the caller's keys list changed in place: cut short, its first key replaced, restored
)


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    steps=st.lists(st.sampled_from(_MEMO_STEPS), min_size=1, max_size=30),
    capacity=st.sampled_from([None, 12, 30]),
)
def test_a_remembered_walk_follows_every_change_of_the_index(seed: int, steps: list[str], capacity: int | None) -> None:
    """``deepest_npu`` remembers a walk until the index changes: after every writer (a store
    by batch or by event, a removal, an all-cleared, a rank cleared in every tier or in one,
    an instance cleared, evictions past ``capacity``), the same keys list - changed in place
    or not - asked for any instances answers what the fold of ``query_keys`` answers now;
    asked twice with no change between, the second answer is the first."""
    rng = random.Random(seed)
    index = PrefixIndex(IBS, capacity_blocks=capacity)
    tokens = [rng.randrange(1000) for _ in range(8 * IBS)]
    keys = sequence_keys(tokens, IBS)
    full = list(keys)
    held: dict[tuple[str, int], list[int]] = {}  # (instance, rank) -> its GPU chain's engine hashes
    for step in steps:
        instance, rank = rng.choice("abc"), rng.randrange(3)
        chain = held.setdefault((instance, rank), [])
        if step in ("store", "store_event", "cpu") and len(chain) < len(full):
            more = rng.randint(1, len(full) - len(chain))
            hashes = [rng.getrandbits(62) + 1 for _ in range(more)]
            medium = wire.MEDIUM_CPU if step == "cpu" else wire.MEDIUM_GPU
            event = wire.BlockStored(
                block_hashes=hashes,
                parent_block_hash=chain[-1] if chain else None,
                token_ids=tokens[len(chain) * IBS : (len(chain) + more) * IBS],
                block_size=IBS,
                medium=medium,
            )
            if step == "store_event":
                index.apply_event(instance, rank, event)
            else:
                index.apply_batch(instance, wire.EventBatch(ts=0.0, events=[event], dp_rank=rank))
            if step != "cpu":
                chain.extend(hashes)
        elif step == "remove" and chain:
            cut = rng.randrange(len(chain))
            removed = wire.BlockRemoved(block_hashes=chain[cut:], medium=wire.MEDIUM_GPU)
            index.apply_batch(instance, wire.EventBatch(ts=0.0, events=[removed], dp_rank=rank))
            del chain[cut:]
        elif step == "all_cleared":
            index.apply_batch(instance, wire.EventBatch(ts=0.0, events=[wire.AllBlocksCleared()], dp_rank=rank))
            chain.clear()
        elif step in ("clear_rank", "clear_rank_gpu"):
            index.clear_rank(instance, rank, wire.MEDIUM_GPU if step == "clear_rank_gpu" else None)
            chain.clear()
        elif step == "clear_rank_cpu":
            index.clear_rank(instance, rank, wire.MEDIUM_CPU)
        elif step == "clear_instance":
            index.clear_instance(instance)
            for (held_instance, _), hashes in held.items():
                if held_instance == instance:
                    hashes.clear()
        elif step == "change_keys":
            keys[:] = rng.choice([full[: rng.randint(1, len(full))], [12345, *full[1:]], full])
        for asked in (("a", "b"), ("b", "c"), ("a",)):
            first = index.deepest_npu(keys, asked)
            assert index.deepest_npu(keys, asked) is first
            if first is None:
                continue  # a CPU tier holds blocks: query_keys is the answer (covered elsewhere)
            assert {k: (r, h.npu_blocks) for k, (r, h) in first.items()} == {
                k: (r, h.npu_blocks) for k, (r, h) in _fold(index, keys, asked).items()
            }


def _deeper_on_rank_1(index: PrefixIndex, tokens: list[int]) -> None:
    _store(index, "a", 1, tokens)


def _deeper_by_batch(index: PrefixIndex, tokens: list[int]) -> None:
    event = wire.BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=tokens[3 * IBS :], block_size=IBS)
    index.apply_batch("a", wire.EventBatch(ts=0.0, events=[event], dp_rank=0))


def _deeper_by_event(index: PrefixIndex, tokens: list[int]) -> None:
    """Rank 0's chain one block deeper: a known worker, the same workers asked."""
    event = wire.BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=tokens[3 * IBS :], block_size=IBS)
    index.apply_event("a", 0, event)


def _removed(index: PrefixIndex, tokens: list[int]) -> None:
    removed = wire.BlockRemoved(block_hashes=[3], medium=wire.MEDIUM_GPU)
    index.apply_batch("a", wire.EventBatch(ts=0.0, events=[removed], dp_rank=0))


def _all_cleared(index: PrefixIndex, tokens: list[int]) -> None:
    index.apply_batch("a", wire.EventBatch(ts=0.0, events=[wire.AllBlocksCleared()], dp_rank=0))


def _evicted(index: PrefixIndex, tokens: list[int]) -> None:
    _store(index, "b", 0, list(range(500, 500 + 6 * IBS)))  # 10 > 8 entries: the least recent 3 go


_WRITERS = {
    "apply_batch": _deeper_by_batch,
    "apply_batch_new_rank": _deeper_on_rank_1,
    "apply_event": _deeper_by_event,
    "removal": _removed,
    "all_blocks_cleared": _all_cleared,
    "clear_rank": lambda index, tokens: index.clear_rank("a", 0),
    "clear_rank_gpu": lambda index, tokens: index.clear_rank("a", 0, wire.MEDIUM_GPU),
    "clear_instance": lambda index, tokens: index.clear_instance("a"),
    "eviction": _evicted,
}


@pytest.mark.unit
@pytest.mark.parametrize("writer", list(_WRITERS))
def test_every_writer_changes_the_next_answer_to_the_same_keys(writer: str) -> None:
    """A walk is remembered until the index changes: each way the index changes between two
    queries of the same keys list shows in the second answer."""
    index = PrefixIndex(IBS, capacity_blocks=8)
    tokens = list(range(4 * IBS))
    index.apply_batch(
        "a",
        wire.EventBatch(
            ts=0.0,
            events=[wire.BlockStored(block_hashes=[1, 2, 3], token_ids=tokens[: 3 * IBS], block_size=IBS)],
            dp_rank=0,
        ),
    )
    keys = sequence_keys(tokens, IBS)
    before = index.deepest_npu(keys, ("a", "b"))
    assert before == {"a": (0, TierHit(3, 0, 0))}
    assert index.deepest_npu(keys, ("a", "b")) is before  # remembered
    _WRITERS[writer](index, tokens)
    after = index.deepest_npu(keys, ("a", "b"))
    assert after != before
    assert after is not None
    assert {k: (r, h.npu_blocks) for k, (r, h) in after.items()} == {
        k: (r, h.npu_blocks) for k, (r, h) in _fold(index, keys, ("a", "b")).items()
    }


@pytest.mark.unit
def test_a_remembered_walk_answers_only_the_keys_it_walked() -> None:
    """The caller's list changed in place (its last key kept) or other instances asked: a
    walk of their own, not the remembered one."""
    index = PrefixIndex(IBS)
    tokens = list(range(3 * IBS))
    _store(index, "a", 0, tokens)
    keys = sequence_keys(tokens, IBS)
    assert index.deepest_npu(keys, ("a",)) == {"a": (0, TierHit(3, 0, 0))}
    assert index.deepest_npu(keys, ("b",)) == {}
    assert index.deepest_npu(keys, ("a",)) == {"a": (0, TierHit(3, 0, 0))}
    keys[0] = 12345  # no one holds this block 0
    assert index.deepest_npu(keys, ("a",)) == {}


class _WriteDuringRead(dict):  # type: ignore[type-arg]
    """A walk memo whose read runs ``writer`` right after it: a subscriber thread's write
    landing between the lock-free path's memo read and its instance-mask read."""

    writer: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, default)
        writer, self.writer = self.writer, None
        if writer is not None:
            writer()
        return found


@pytest.mark.unit
@pytest.mark.parametrize("writer", ["clear_instance", "new_rank"])
def test_a_write_between_the_memo_read_and_the_mask_read_is_answered_after_it(writer: str) -> None:
    """``deepest_npu`` gives a remembered walk without the lock.  A write that lands after
    it read the remembered entry and changes which workers the asked instances have (an
    instance cleared, a rank appearing) resets the instance-mask cache, so the query takes
    the locked path and answers the index after the write - not the remembered walk."""
    index = PrefixIndex(IBS)
    tokens = list(range(3 * IBS))
    _store(index, "a", 0, tokens)
    keys = sequence_keys(tokens, IBS)
    asked = ("a",)
    first = index.deepest_npu(keys, asked)
    assert index.deepest_npu(keys, asked) is first  # walked twice: remembered
    assert first == {"a": (0, TierHit(3, 0, 0))}
    memo = _WriteDuringRead(index._walks)
    index._walks = memo
    if writer == "clear_instance":
        memo.writer = lambda: index.clear_instance("a")
        expected: dict[str, tuple[int, TierHit]] = {}
    else:  # a rank of "a" stores the prompt deeper (a new worker: the masks change)
        memo.writer = lambda: _store(index, "a", 3, [*tokens, 9, 9, 9, 9])
        expected = {"a": (0, TierHit(3, 0, 0))}
    got = index.deepest_npu(keys, asked)
    assert memo.writer is None  # the write ran inside the read
    assert got is not first
    assert got == expected
    assert got == _fold(index, keys, asked)


@pytest.mark.unit
def test_remembered_walks_under_a_concurrent_writer_are_whole_states() -> None:
    """A subscriber thread stores and removes a rank's blocks while the loop thread asks
    the same keys again and again (the lock-free remembered path and the locked walk in
    turn): every answer is the index in one of its states, never a mixture."""
    import threading

    index = PrefixIndex(IBS)
    tokens = list(range(4 * IBS))
    _store(index, "a", 0, tokens[: 2 * IBS])
    keys = sequence_keys(tokens, IBS)
    hashes = [random.getrandbits(62) + 1 for _ in range(4)]
    stored = wire.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=IBS)
    removed = wire.BlockRemoved(block_hashes=hashes)
    states = [{"a": (0, TierHit(2, 0, 0))}, {"a": (1, TierHit(4, 0, 0))}]
    stop = threading.Event()
    writes = [0]

    def write() -> None:
        while not stop.is_set():
            for event in (stored, removed):
                index.apply_batch("a", wire.EventBatch(ts=0.0, events=[event], dp_rank=1))
                writes[0] += 1

    thread = threading.Thread(target=write)
    seen: list[Any] = []
    thread.start()
    try:
        while writes[0] < 2_000 and len(seen) < 2_000_000:  # reads for as long as the writer writes
            seen.append(index.deepest_npu(keys, ("a",)))
    finally:
        stop.set()
        thread.join()
    assert writes[0] >= 2_000
    assert all(answer in states for answer in seen), [a for a in seen if a not in states][:3]


@pytest.mark.unit
def test_a_remembered_walk_refreshes_recency_as_a_walk_does() -> None:
    """Past half its capacity the index moves a query's matched keys to the recent end; a
    query answered from a remembered walk must too, or the prompt asked again would be
    evicted before one asked once since."""
    index = PrefixIndex(IBS, capacity_blocks=12)
    asked, often, once = ("a",), list(range(4 * IBS)), list(range(100, 100 + 4 * IBS))
    _store(index, "a", 0, often)
    _store(index, "a", 1, once)  # 8 of 12 entries: queries refresh recency
    often_keys, once_keys = sequence_keys(often, IBS), sequence_keys(once, IBS)
    for _ in range(2):  # walked twice: remembered
        assert index.deepest_npu(often_keys, asked) == {"a": (0, TierHit(4, 0, 0))}
    assert index.deepest_npu(once_keys, asked) == {"a": (1, TierHit(4, 0, 0))}
    assert index.deepest_npu(often_keys, asked) == {"a": (0, TierHit(4, 0, 0))}  # remembered: no change since
    _store(index, "a", 2, list(range(200, 200 + 5 * IBS)))  # 13 > 12: the 2 least recent entries go
    assert index.deepest_npu(often_keys, asked) == {"a": (0, TierHit(4, 0, 0))}
    assert index.deepest_npu(once_keys, asked) == {"a": (1, TierHit(2, 0, 0))}


def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[str, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=3.0) as response:
        return response.headers.get("Content-Type", ""), response.read()


@pytest.mark.integration
def test_a_repeated_body_sees_the_index_as_it_is_now_in_json_or_msgpack(server: Server, zctx: Any) -> None:
    pub = Publisher(zctx, free_tcp_endpoint())
    client = MotorClient(server.url)
    assert client.register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
    connect(server, pub)
    tokens = prompt(11, 6)
    body = msgpack.packb({"model": MODEL, "block_size": BS, "token_ids": tokens, "tenant_id": "default"})
    url = server.url + "/query"
    as_json = {"Content-Type": "application/msgpack"}

    def matched() -> int:
        kind, payload = _post(url, body, as_json)
        assert kind.startswith("application/json")
        answer: dict[str, Any] = json.loads(payload)
        return int(answer["default"]["vllm-prefill-0"]["dp_detail"]["0"]["matched_tokens"])

    assert matched() == 0
    pub.store(tokens[: 2 * BS], rank=3)
    wait_for(lambda: matched() == 2 * BS, "the same body sees 2 blocks")
    pub.store(tokens, rank=1)
    wait_for(lambda: matched() == 6 * BS, "the same body sees 6 blocks")
    kind, payload = _post(url, body, {**as_json, "Accept": "application/msgpack"})
    assert kind.startswith("application/msgpack")
    answer = msgpack.unpackb(payload)
    status, json_answer = http(url, {"model": MODEL, "block_size": BS, "token_ids": tokens, "tenant_id": "default"})
    assert status == 200 and answer == json_answer
    assert answer["default"]["vllm-prefill-0"]["dp_detail"]["0"]["engine_dp_rank"] == 1


def _served_query_url(make_server: Any, zctx: Any, stored: list[int]) -> tuple[str, Publisher]:
    """A fresh server (made after any switch of hashing.NATIVE: its handlers read it when
    built) following one fanned-in instance whose rank 2 holds ``stored``: its /query URL,
    and the instance's publisher (keep it: its socket lives while the test does)."""
    server = make_server()
    pub = Publisher(zctx, free_tcp_endpoint())
    assert MotorClient(server.url).register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
    connect(server, pub)
    pub.store(stored, rank=2)
    return str(server.url) + "/query", pub


def _answers_both_ways(
    monkeypatch: pytest.MonkeyPatch, make_server: Any, zctx: Any, stored: list[int], probe: bytes, bodies: list[bytes]
) -> tuple[dict[bool, list[tuple[int, Any]]], dict[bool, str], list[Publisher]]:
    """``bodies`` posted as msgpack to a server built with the C helpers, then to one built
    without (``hashing.NATIVE`` switched off for the rest of the test), each once ``probe``
    matches all of ``stored``: the answers and /query URLs by path, and the publishers
    (keep them: their sockets live while the test does)."""
    from sglang_kvpub.core import hashing

    headers = {"Content-Type": "application/msgpack"}
    answers: dict[bool, list[tuple[int, Any]]] = {}
    urls: dict[bool, str] = {}
    pubs: list[Publisher] = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(hashing, "NATIVE", None)
            monkeypatch.setattr(router_native, "MODULE", None)  # the router's body helpers too
        url, pub = _served_query_url(make_server, zctx, stored)
        wait_for(functools.partial(_matched_all, url, probe, len(stored)), "the store is indexed")
        answers[native] = [http(url, raw=raw, headers=headers) for raw in bodies]
        urls[native] = url
        pubs.append(pub)
    return answers, urls, pubs


@pytest.mark.parametrize("native", [True, False], ids=["c-helpers", "python"])
def test_msgpack_ids_are_checked_and_hashed_alike_with_or_without_the_c_helpers(
    native: bool, monkeypatch: pytest.MonkeyPatch, zctx: Any, make_server: Any
) -> None:
    """A msgpack body's ids go to u32 in C (``take_token_ids``) when the helpers are built:
    the answers and the refusals must be the ones of the Python path, and of JSON."""
    from sglang_kvpub.core import hashing

    if native and (hashing.NATIVE is None or router_native.MODULE is None):
        pytest.skip("the C helpers are not built")
    if not native:
        monkeypatch.setattr(hashing, "NATIVE", None)
        monkeypatch.setattr(router_native, "MODULE", None)
    tokens = prompt(12, 5)
    url, _pub = _served_query_url(make_server, zctx, tokens[: 3 * BS])
    body = {"tenant_id": "default", "token_ids": tokens, "model": MODEL, "block_size": BS}

    def matched() -> int:
        return int(http(url, body)[1]["default"]["vllm-prefill-0"]["dp_detail"]["0"]["matched_tokens"])

    wait_for(lambda: matched() == 3 * BS, "the store is indexed")
    assert http(url, body, use_msgpack=True) == http(url, body)
    for bad in ([1, -2], [1, 1 << 32], [1, 2.5], [1, "2"]):
        status, answer = http(url, {**body, "token_ids": bad}, use_msgpack=True)
        assert (status, answer["error"]) == (400, "bad_field"), answer
        assert "token_ids" in answer["detail"]  # the C helpers and the range check name the field
    status, answer = http(url, {**body, "token_ids": "1 2"}, use_msgpack=True)
    assert (status, answer["error"]) == (400, "bad_field")  # not an array: the struct decoder's refusal
    truncated = msgpack.packb(body)[:-40]
    status, answer = http(url, raw=truncated, headers={"Content-Type": "application/msgpack"})
    assert (status, answer["error"]) == (400, "invalid_msgpack")
    status, answer = http(url, {**body, "token_ids": None}, use_msgpack=True)
    assert status == 400  # no ids and no prompt: nothing to tokenize (the tokenizer path's refusal)


def _matched_all(url: str, raw: bytes, tokens: int) -> bool:
    answer = http(url, raw=raw, headers={"Content-Type": "application/msgpack"})[1]
    return bool(answer["default"]["vllm-prefill-0"]["dp_detail"]["0"]["matched_tokens"] == tokens)


def _raw_map(*entries: tuple[str, Any]) -> bytes:
    """A msgpack map in the given entry order (duplicates kept, as a client may send them)."""
    return bytes([0x80 | len(entries)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in entries)


@pytest.mark.integration
def test_msgpack_bodies_answer_alike_with_and_without_the_c_helpers(
    monkeypatch: pytest.MonkeyPatch, zctx: Any, make_server: Any
) -> None:
    """The miss path's one C call (``take_query_keys``: ids split, decoded and hashed with
    the spread key) against the Python path on the same bodies, each sent twice (a miss,
    then the cache): the same answers; the same refusals, the same detail wherever it is
    not the id check's own wording (the Python path reports bad ids in msgspec's)."""
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built")
    tokens = [*prompt(13, 5), 70_000, 123, 200]  # a partial block after 5 full ones
    base = [("model", MODEL), ("tenant_id", "default")]
    good = [
        _raw_map(*base, ("block_size", BS), ("token_ids", tokens)),
        _raw_map(("token_ids", tokens), *base, ("block_size", BS)),  # the block size after the ids
        _raw_map(*base, ("token_ids", tokens)),  # the default block size
        _raw_map(*base, ("token_ids", tokens[: 3 * BS]), ("messages", [{"role": "user", "content": "x"}])),
        _raw_map(*base, ("token_ids", tokens[:100])),  # under one block
        _raw_map(*base, ("token_ids", [])),
        _raw_map(*base, ("block_size", 16), ("token_ids", tokens)),  # no index of that block size
        _raw_map(*base, ("block_size", 16), ("token_ids", tokens), ("block_size", BS)),  # twice: the decoder's, last
        _raw_map(("model", MODEL), ("tenant_id", "other"), ("block_size", BS), ("token_ids", tokens)),  # no index
        # the fields beside the ids longer than the handler keeps decoded (read again each time)
        _raw_map(*base, ("token_ids", tokens[: 3 * BS]), ("messages", [{"role": "user", "content": "x" * 600}])),
    ]
    bad_block_size = [
        _raw_map(*base, ("block_size", value), ("token_ids", tokens)) for value in (0, -1, "128", True, 1.0, 1 << 21)
    ]
    bad_ids = [_raw_map(*base, ("token_ids", [*tokens[:200], bad])) for bad in (-1, 1 << 32, 1.5, None, "7")]
    bad_ids.append(_raw_map(*base, ("block_size", "x"), ("token_ids", [1, -1])))
    # fields refused beside good ids: refused again when sent again (a refusal is never kept)
    bad_ids.append(_raw_map(("model", ""), ("tenant_id", "default"), ("block_size", BS), ("token_ids", tokens)))
    bad_ids.append(_raw_map(("model", MODEL), ("tenant_id", 5), ("block_size", BS), ("token_ids", tokens)))
    asked = [raw for raw in good + bad_block_size + bad_ids for _ in "12"]
    answers, _urls, _pubs = _answers_both_ways(monkeypatch, make_server, zctx, tokens[: 3 * BS], good[0], asked)
    c_path, python_path = answers[True], answers[False]
    assert c_path[: 2 * len(good)] == python_path[: 2 * len(good)]
    assert any(status == 200 and answer for status, answer in c_path[: 2 * len(good)])
    for (status, answer), (python_status, python_answer) in zip(
        c_path[2 * len(good) :], python_path[2 * len(good) :], strict=True
    ):
        assert (status, answer["error"]) == (python_status, python_answer["error"]) == (400, "bad_field")
    for (status, answer), (_, python_answer) in zip(c_path, python_path, strict=True):
        if status == 400 and "token_ids" not in answer["detail"]:
            assert answer == python_answer


@pytest.mark.integration
def test_each_msgpack_body_is_answered_for_the_fields_it_states(zctx: Any, make_server: Any) -> None:
    """Bodies that differ only in the fields beside the ids (the tenant, a long prompt text)
    are each answered for the fields they state, whatever bodies came before."""
    tokens = prompt(15, 5)
    server = make_server()
    pub = Publisher(zctx, free_tcp_endpoint())
    assert MotorClient(server.url).register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
    connect(server, pub)
    pub.store(tokens[: 3 * BS], rank=2)
    url = str(server.url) + "/query"
    headers = {"Content-Type": "application/msgpack"}
    base = [("model", MODEL), ("block_size", BS)]
    ours = _raw_map(*base, ("tenant_id", "default"), ("token_ids", tokens))
    wait_for(functools.partial(_matched_all, url, ours, 3 * BS), "the store is indexed")
    for turn in range(16):  # as many tenants, each body new ids
        body = _raw_map(*base, ("tenant_id", f"t{turn}"), ("token_ids", [turn, *tokens]))
        status, answer = http(url, raw=body, headers=headers)
        assert (status, answer["error"]) == (404, "NoIndexer")  # the tenant it states, not one seen before
    long_rest = _raw_map(*base, ("tenant_id", "default"), ("prompt", "y" * 1024), ("token_ids", tokens))
    status, answer = http(url, raw=long_rest, headers=headers)
    assert status == 200 and answer["default"]["vllm-prefill-0"]["dp_detail"]["0"]["matched_tokens"] == 3 * BS
    again = _raw_map(*base, ("tenant_id", "default"), ("token_ids", [*tokens, 9]))  # new ids, the fields of `ours`
    assert http(url, raw=again, headers=headers)[0] == 200


@pytest.mark.integration
def test_conversation_turns_answer_alike_with_and_without_the_c_helpers(
    monkeypatch: pytest.MonkeyPatch, zctx: Any, make_server: Any
) -> None:
    """The turns of a conversation (each body the one before it and more, then a changed last
    id, a bad id past the shared part, the block size stated after the ids): the C path,
    which takes the shared leading blocks from its memo of recent bodies (docs/native.md),
    answers and refuses as the Python path does - and did take blocks from the memo."""
    if router_native.MODULE is None:
        pytest.skip("the C helpers are not built")
    memos: list[Any] = []
    made = router_native.MODULE.QueryKeysMemo

    def kept_memo() -> Any:
        memos.append(made())
        return memos[-1]

    monkeypatch.setattr(router_native.MODULE, "QueryKeysMemo", kept_memo)
    tokens = prompt(14, 80)  # 1,280 ids, ~3.8 KiB of msgpack: long enough to be remembered
    base = [("model", MODEL), ("tenant_id", "default")]
    turns = [tokens[:700], tokens[:1000], tokens, [*tokens[:-1], 7], [*tokens, 70_000, 1 << 20]]
    bodies = [_raw_map(*base, ("block_size", BS), ("token_ids", ids)) for ids in turns]
    bodies.append(_raw_map(*base, ("block_size", BS), ("token_ids", [*tokens, -1])))
    bodies.append(_raw_map(*base, ("token_ids", [*tokens, 5]), ("block_size", BS)))
    bodies.append(_raw_map(*base, ("token_ids", [*tokens, 6]), ("block_size", 2 * BS)))
    bodies.append(bytes(bytearray(bodies[-1])))  # sent again: the memo holds these bytes and their prompt
    answers, urls, _pubs = _answers_both_ways(monkeypatch, make_server, zctx, tokens[: 40 * BS], bodies[2], bodies)
    served = memos[0]  # the first app's handler (the C path)
    before = served.exact_hits  # its readiness polls sent one body again and again: as many as it took
    headers = {"Content-Type": "application/msgpack"}
    assert http(urls[True], raw=bytes(bytearray(bodies[-1])), headers=headers) == answers[True][-1]
    assert served.exact_hits == before + 1  # the body sent again: its prompt, nothing decoded or hashed
    with urllib.request.urlopen(urls[True].removesuffix("/query") + "/metrics", timeout=10) as response:
        exposition = response.read().decode()  # what the C path's memo did
    assert answers[True][:5] == answers[False][:5]
    assert answers[True][6:] == answers[False][6:]
    assert [status for status, _ in answers[True]] == [200] * 5 + [400] + [200] * 3
    assert answers[True][-1] == answers[True][-2]
    assert answers[True][5][1]["error"] == answers[False][5][1]["error"] == "bad_field"
    assert sum(memo.hits for memo in memos) >= 5  # turns 0, 1, 3, 4 and 6 took blocks from the memo
    unlabelled = dict(line.split(" ") for line in exposition.splitlines() if line[:1] != "#" and "{" not in line)
    figures = {name.removeprefix("motor_kv_adapter_query_prefix_"): float(v) for name, v in unlabelled.items()}
    assert figures["reuse_total"] == served.hits
    assert figures["reused_blocks_total"] == served.reused_blocks
    assert figures["memo_bodies"] == len(served)
    assert figures["memo_exact_total"] == served.exact_hits
