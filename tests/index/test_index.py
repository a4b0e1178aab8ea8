"""Unit tests of the shared prefix index (sglang_kvpub.core.index)."""

from __future__ import annotations

import logging
import random
from array import array
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_kvpub.core.hashing import chain_hashes, local_block_hashes, lora_seed, sequence_keys
from sglang_kvpub.core.index import (
    TIER_CPU,
    TIER_DISK,
    TIER_NPU,
    PrefixIndex,
    TierHit,
    tier_of_medium,
)
from sglang_kvpub.wire import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    to_i64,
    to_u64,
)

pytestmark = pytest.mark.unit

BS = 4


def tokens(n_blocks: int, start: int = 1, bs: int = BS) -> list[int]:
    return list(range(start, start + n_blocks * bs))


def ehash(key: int, salt: int = 0) -> int:
    """An engine block id derived from content, like SGLang's (opaque to the index)."""
    return (key * 0x9E3779B97F4A7C15 + salt) & ((1 << 64) - 1)


def store(
    idx: PrefixIndex,
    inst: str,
    rank: int,
    toks: list[int],
    *,
    first: int = 0,
    medium: str | None = MEDIUM_GPU,
    lora: str | None = None,
    salt: int = 0,
    merged: bool = True,
    bs: int = BS,
) -> list[int]:
    """Stores blocks ``first..`` of ``toks`` (parent = block first-1); returns their engine ids."""
    keys = sequence_keys(toks, bs, lora)
    hashes = [ehash(k, salt) for k in keys]
    parent = hashes[first - 1] if first else None
    runs = [range(first, len(keys))] if merged else [range(i, i + 1) for i in range(first, len(keys))]
    for run in runs:
        event = BlockStored(
            block_hashes=[hashes[i] for i in run],
            parent_block_hash=parent,
            token_ids=toks[run.start * bs : run.stop * bs],
            block_size=bs,
            medium=medium,
            lora_name=lora,
        )
        idx.apply_event(inst, rank, event)
        parent = hashes[run.stop - 1]
    return hashes


def test_tier_of_medium() -> None:
    assert tier_of_medium(None) == TIER_NPU
    assert tier_of_medium("GPU") == TIER_NPU
    assert tier_of_medium("CPU_PINNED") == TIER_CPU
    assert tier_of_medium("cpu") == TIER_CPU
    assert tier_of_medium("DISK") == TIER_DISK
    assert tier_of_medium("EXTERNAL") == TIER_DISK
    assert tier_of_medium("SOMETHING_NEW") == TIER_DISK


def test_store_query_and_prefix() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(5)
    store(idx, "a", 0, toks)
    assert idx.query(toks) == {"a": {0: TierHit(5, 0, 0)}}
    assert idx.query(toks[:11]) == {"a": {0: TierHit(2, 0, 0)}}  # partial block ignored
    assert idx.query(toks[:8] + [999] * 8) == {"a": {0: TierHit(2, 0, 0)}}
    assert idx.query([999] * 8) == {}
    assert idx.query(toks[:3]) == {}
    assert idx.query_keys(sequence_keys(toks, BS)) == idx.query(toks)
    assert TierHit(5, 1, 2).total_blocks == 8


def test_removal_does_not_cascade_and_unknown_removals() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(5)
    hashes = store(idx, "a", 0, toks)
    result = idx.apply_event("a", 0, BlockRemoved(block_hashes=[hashes[2]], medium=None))  # None -> default GPU
    assert result.removed == 1
    assert idx.query(toks) == {"a": {0: TierHit(2, 0, 0)}}
    assert idx.resident("a", 0, MEDIUM_GPU) == {hashes[i] for i in (0, 1, 3, 4)}
    result = idx.apply_event("a", 0, BlockRemoved(block_hashes=[hashes[2], 12345], medium=MEDIUM_GPU))
    assert (result.removed, result.unknown_removals) == (0, 2)
    # removing in another medium does not touch GPU
    result = idx.apply_event("a", 0, BlockRemoved(block_hashes=[hashes[0]], medium=MEDIUM_CPU))
    assert result.unknown_removals == 1
    assert idx.query(toks) == {"a": {0: TierHit(2, 0, 0)}}
    assert idx.stats().unknown_removals == 3


def test_default_medium_applies_to_stores_and_removals() -> None:
    idx = PrefixIndex(BS, default_medium=MEDIUM_CPU)
    toks = tokens(3)
    hashes = store(idx, "a", 0, toks, medium=None)
    assert idx.query(toks) == {"a": {0: TierHit(0, 3, 0)}}
    idx.apply_event("a", 0, BlockRemoved(block_hashes=[hashes[1]]))
    assert idx.query(toks) == {"a": {0: TierHit(0, 1, 0)}}


def test_clear_per_rank_and_medium() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(4)
    for rank in (0, 1):
        store(idx, "a", rank, toks, medium=MEDIUM_GPU)
        store(idx, "a", rank, toks, medium=MEDIUM_CPU)
    idx.clear_rank("a", 0, MEDIUM_GPU)
    assert idx.query(toks) == {"a": {0: TierHit(0, 4, 0), 1: TierHit(4, 0, 0)}}
    result = idx.apply_batch("a", EventBatch(ts=0.0, events=[AllBlocksCleared()], dp_rank=1))
    assert result.cleared == 1
    assert idx.query(toks) == {"a": {0: TierHit(0, 4, 0)}}
    assert idx.resident("a", 1, MEDIUM_CPU) == set()
    idx.clear_rank("a", 0)
    assert idx.query(toks) == {}
    assert idx.ranks("a") == [0, 1]
    assert idx.stats().blocks == 0


def test_clear_instance_recycles_workers() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    store(idx, "a", 0, toks)
    store(idx, "a", 3, toks)
    store(idx, "b", 0, toks)
    idx.clear_instance("a")
    assert idx.ranks("a") == []
    assert idx.query(toks) == {"b": {0: TierHit(3, 0, 0)}}
    store(idx, "c", 5, toks[:8])  # takes a recycled worker id: must not inherit a's blocks
    assert idx.query(toks) == {"b": {0: TierHit(3, 0, 0)}, "c": {5: TierHit(2, 0, 0)}}
    assert idx.stats().workers == 2


def test_recycled_worker_ids_answer_with_their_new_ranks() -> None:
    """A recycled page of worker ids (one mask byte) answers with its new instance's ranks,
    never with those of the instance that held it before."""
    idx = PrefixIndex(BS)
    toks = tokens(3)
    for rank in (0, 1, 2):
        store(idx, "a", rank, toks)
    assert idx.query(toks) == {"a": {r: TierHit(3, 0, 0) for r in (0, 1, 2)}}
    idx.clear_instance("a")
    for rank in (7, 8, 9):  # the same worker ids (and mask byte), other ranks
        store(idx, "c", rank, toks)
    assert idx.query(toks) == {"c": {r: TierHit(3, 0, 0) for r in (7, 8, 9)}}
    store(idx, "c", 10, toks)  # a new worker in the same byte
    assert idx.query(toks) == {"c": {r: TierHit(3, 0, 0) for r in (7, 8, 9, 10)}}


def test_batch_rank_override_and_default() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(2)
    event = BlockStored(block_hashes=[1, 2], token_ids=toks, block_size=BS, medium=MEDIUM_GPU)
    idx.apply_batch("a", EventBatch(ts=0.0, events=[event], dp_rank=None))
    idx.apply_batch("a", EventBatch(ts=0.0, events=[event], dp_rank=3))
    idx.apply_batch("a", EventBatch(ts=0.0, events=[event], dp_rank=3), dp_rank=5)
    assert sorted(idx.query(toks)["a"]) == [0, 3, 5]
    idx.apply_batch("x", EventBatch(ts=0.0, events=[], dp_rank=2))  # heartbeat: the rank is known
    assert idx.ranks("x") == [2]


def test_merged_store_equals_single_block_stores() -> None:
    toks = tokens(6)
    merged, single = PrefixIndex(BS), PrefixIndex(BS)
    store(merged, "a", 0, toks, merged=True)
    store(single, "a", 0, toks, merged=False)
    assert merged.query(toks) == single.query(toks) == {"a": {0: TierHit(6, 0, 0)}}
    assert merged.resident("a", 0, MEDIUM_GPU) == single.resident("a", 0, MEDIUM_GPU)
    # a merged continuation under an existing parent
    store(merged, "a", 1, toks[:8])
    store(merged, "a", 1, toks, first=2)
    assert merged.query(toks)["a"][1] == TierHit(6, 0, 0)


def test_orphans_are_counted_skipped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    idx = PrefixIndex(BS)
    toks = tokens(4)
    caplog.set_level(logging.DEBUG, logger="sglang_kvpub.core.index")
    for _ in range(3):
        event = BlockStored(block_hashes=[7, 8], parent_block_hash=99, token_ids=toks[:8], block_size=BS)
        result = idx.apply_event("a", 0, event)
        assert (result.orphans, result.stored) == (1, 0)
    assert idx.stats().orphans == 3
    assert idx.resident("a", 0, MEDIUM_GPU) == set()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unknown" in warnings[0].getMessage()


def test_block_size_mismatch_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    idx = PrefixIndex(128)
    caplog.set_level(logging.WARNING, logger="sglang_kvpub.core.index")
    toks = tokens(2, bs=64)
    for _ in range(2):
        event = BlockStored(block_hashes=[1, 2], token_ids=toks, block_size=64, medium=MEDIUM_GPU)
        assert idx.apply_event("a", 0, event).ignored_block_size == 1
    idx.apply_event("b", 0, BlockStored(block_hashes=[1], token_ids=toks[:64], block_size=64))
    assert idx.stats().ignored_block_size == 3
    assert idx.stats().blocks == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # once per instance
    assert "64" in messages[0] and "128" in messages[0] and "instance a" in messages[0]


def test_i64_and_u64_engine_hashes_are_the_same_block() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    keys = sequence_keys(toks, BS)
    big = [(1 << 63) + i for i in range(3)]  # negative as i64
    idx.apply_event("a", 0, BlockStored(block_hashes=[to_i64(big[0])], token_ids=toks[:4], block_size=BS))
    child = BlockStored(block_hashes=big[1:], parent_block_hash=big[0], token_ids=toks[4:], block_size=BS)
    assert idx.apply_event("a", 0, child).stored == 2  # parent sent as u64, stored as i64
    assert idx.query_keys(keys) == {"a": {0: TierHit(3, 0, 0)}}
    assert idx.resident("a", 0, MEDIUM_GPU) == set(big)
    idx.apply_event("a", 0, BlockRemoved(block_hashes=[to_i64(big[1])]))
    assert idx.query(toks) == {"a": {0: TierHit(1, 0, 0)}}
    assert to_u64(to_i64(big[1])) not in idx.resident("a", 0, MEDIUM_GPU)


def test_lora_keys_differ() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    store(idx, "a", 0, toks, lora="adapter-1")
    assert idx.query(toks) == {}
    assert idx.query(toks, lora_name="adapter-2") == {}
    assert idx.query(toks, lora_name="adapter-1") == {"a": {0: TierHit(3, 0, 0)}}
    assert sequence_keys(toks, BS, "adapter-1") == chain_hashes(
        local_block_hashes(toks, BS, lora_seed("adapter-1")), lora_seed("adapter-1")
    )


def test_prefix_split_across_ranks_is_not_a_hit() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    store(idx, "a", 0, toks[:8])  # rank 0: blocks 0, 1
    hashes = store(idx, "a", 1, toks)  # rank 1: blocks 0, 1, 2 ...
    idx.apply_event("a", 1, BlockRemoved(block_hashes=hashes[:2]))  # ... then only block 2
    assert idx.query(toks) == {"a": {0: TierHit(2, 0, 0)}}
    # a rank cannot attach a child to a parent another rank holds
    other = PrefixIndex(BS)
    h = store(other, "a", 0, toks[:8])
    event = BlockStored(block_hashes=[555], parent_block_hash=h[1], token_ids=toks[8:], block_size=BS)
    assert other.apply_event("a", 1, event).orphans == 1
    assert other.query(toks) == {"a": {0: TierHit(2, 0, 0)}}


def test_report_scenario_rank7_holds_5000_tokens() -> None:
    idx = PrefixIndex(128)
    rng = random.Random(7)
    prompt = [rng.randrange(150_000) for _ in range(5000)]
    for rank in range(16):
        if rank == 7:
            store(idx, "prefill-0", rank, prompt[: 39 * 128], bs=128)
        else:
            other = [rng.randrange(150_000) for _ in range(1024)]
            store(idx, "prefill-0", rank, other, bs=128)
    assert idx.query(prompt) == {"prefill-0": {7: TierHit(39, 0, 0)}}


def test_exclusive_tier_split() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(18)
    store(idx, "a", 0, toks[: 10 * BS], medium=MEDIUM_GPU)  # 0-9 on NPU
    store(idx, "a", 0, toks[: 15 * BS], medium=MEDIUM_CPU)  # 0-14 on CPU (write-through)
    store(idx, "a", 0, toks, first=15, medium=MEDIUM_DISK)  # 15-17 on disk, parent on CPU
    store(idx, "a", 1, toks[: 6 * BS], medium=MEDIUM_CPU)  # a rank with only host memory
    store(idx, "a", 2, toks[: 2 * BS], medium=MEDIUM_DISK)
    assert idx.query(toks) == {
        "a": {0: TierHit(10, 5, 3), 1: TierHit(0, 6, 0), 2: TierHit(0, 0, 2)},
    }
    # a hole in the NPU phase: the NPU prefix stops, CPU continues from there
    hashes = store(idx, "a", 3, toks[: 8 * BS], medium=MEDIUM_GPU)
    store(idx, "a", 3, toks[: 8 * BS], medium=MEDIUM_CPU)
    idx.apply_event("a", 3, BlockRemoved(block_hashes=[hashes[3]], medium=MEDIUM_GPU))
    assert idx.query(toks)["a"][3] == TierHit(3, 5, 0)
    # a block back on NPU after the CPU phase does not restart the NPU phase
    store(idx, "a", 4, toks[: 2 * BS], medium=MEDIUM_GPU)
    cpu = store(idx, "a", 4, toks[: 3 * BS], medium=MEDIUM_CPU)
    idx.apply_event(
        "a", 4, BlockStored(block_hashes=[ehash(sequence_keys(toks, BS)[3])], parent_block_hash=cpu[2],
                            token_ids=toks[12:16], block_size=BS, medium=MEDIUM_GPU)
    )  # fmt: skip
    assert idx.query(toks)["a"][4] == TierHit(2, 1, 0)
    assert idx.stats().tier_blocks[TIER_DISK] == 5


def test_instances_filter() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(2)
    for inst in ("a", "b", "c"):
        store(idx, inst, 0, toks)
    assert set(idx.query(toks, instances=["a", "c"])) == {"a", "c"}
    assert idx.query(toks, instances=["zzz"]) == {}
    assert idx.instances() == ["a", "b", "c"]
    idx.clear_instance("a")
    store(idx, "d", 1, toks)  # reuses a's worker id
    assert idx.query(toks, instances=["a"]) == {}
    assert set(idx.query(toks, instances=["a", "d"])) == {"d"}


def test_duplicate_engine_ids_for_one_key() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(2)
    first = store(idx, "a", 0, toks, salt=0)
    second = store(idx, "a", 0, toks, salt=1)  # same content under other engine ids (e.g. cache salt)
    idx.apply_event("a", 0, BlockRemoved(block_hashes=first))
    assert idx.query(toks) == {"a": {0: TierHit(2, 0, 0)}}
    idx.apply_event("a", 0, BlockRemoved(block_hashes=second))
    assert idx.query(toks) == {}
    assert idx.stats().keys == 0


def test_clear_with_duplicate_engine_ids() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(2)
    store(idx, "a", 0, toks, salt=0)
    store(idx, "a", 0, toks, salt=1)
    idx.clear_rank("a", 0, MEDIUM_GPU)
    assert idx.query(toks) == {}
    assert idx.stats().keys == 0


def test_restore_is_idempotent() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    store(idx, "a", 0, toks)
    store(idx, "a", 0, toks)
    assert idx.stats().blocks == 3
    idx.apply_event("a", 0, BlockRemoved(block_hashes=[ehash(sequence_keys(toks, BS)[0])]))
    assert idx.query(toks) == {}


def test_capacity_eviction() -> None:
    idx = PrefixIndex(BS, capacity_blocks=64)
    hot = tokens(4, start=10_000)
    store(idx, "a", 0, hot)
    for i in range(60):
        store(idx, "a", i % 4, tokens(4, start=i * 100))
        assert idx.query(hot) == {"a": {0: TierHit(4, 0, 0)}}  # queried: stays recent
        assert idx.stats().blocks <= 64
    stats = idx.stats()
    assert stats.evicted > 0
    assert stats.blocks + stats.evicted == stats.stored - stats.removed
    assert idx.query(tokens(4, start=0)) == {}  # the oldest prompt is gone
    # whatever remains is consistent: a hit never exceeds what the rank still holds
    for i in range(60):
        toks = tokens(4, start=i * 100)
        for ranks in idx.query(toks).values():
            for rank, hit in ranks.items():
                held = idx.resident("a", rank, MEDIUM_GPU)
                expect = [ehash(k) for k in sequence_keys(toks, BS)][: hit.npu_blocks]
                assert set(expect) <= held


def test_capacity_evicts_leaves_before_their_parents() -> None:
    idx = PrefixIndex(BS, capacity_blocks=32)
    shared = tokens(2, start=5_000)
    for i in range(40):
        store(idx, "a", 0, shared + tokens(2, start=i * 100), first=0)
    # the shared prefix is touched by every store: it must survive every eviction
    assert idx.query(shared) == {"a": {0: TierHit(2, 0, 0)}}
    assert idx.stats().evicted > 0


def test_many_workers_wide_masks() -> None:
    """Over 60 workers: holders switch between one worker and wide bitmasks."""
    idx = PrefixIndex(BS)
    toks = tokens(3)
    workers = [(f"i{n}", r) for n in range(5) for r in range(16)]
    held = {}
    for n, (inst, rank) in enumerate(workers):
        held[(inst, rank)] = store(idx, inst, rank, toks[: (1 + n % 3) * BS])
    result = idx.query(toks)
    assert sum(len(r) for r in result.values()) == 80
    assert result["i4"][15] == TierHit(1 + 79 % 3, 0, 0)
    for inst, rank in workers[:-1]:  # leave one holder: back to the single-holder form
        idx.apply_event(inst, rank, BlockRemoved(block_hashes=held[(inst, rank)]))
    assert idx.query(toks) == {"i4": {15: TierHit(2, 0, 0)}}
    store(idx, "i0", 0, toks)
    assert idx.query(toks) == {"i0": {0: TierHit(3, 0, 0)}, "i4": {15: TierHit(2, 0, 0)}}
    idx.clear_instance("i4")
    assert idx.query(toks) == {"i0": {0: TierHit(3, 0, 0)}}


def test_concurrent_writers_and_readers() -> None:
    import threading

    idx = PrefixIndex(BS)
    toks = tokens(4)
    errors: list[BaseException] = []

    def writer(inst: str) -> None:
        try:
            for _ in range(200):
                hashes = store(idx, inst, 0, toks)
                idx.apply_event(inst, 0, BlockRemoved(block_hashes=hashes[2:]))
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(400):
                for ranks in idx.query(toks).values():
                    assert ranks[0].npu_blocks in (2, 4)  # a batch is seen whole or not at all
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert idx.query(toks) == {"w0": {0: TierHit(2, 0, 0)}, "w1": {0: TierHit(2, 0, 0)}}


def test_stats_shape() -> None:
    idx = PrefixIndex(BS)
    toks = tokens(3)
    store(idx, "a", 0, toks)
    store(idx, "a", 1, toks, medium=MEDIUM_CPU)
    idx.query(toks)
    stats = idx.stats()
    assert (stats.blocks, stats.keys, stats.workers, stats.queries) == (6, 6, 2, 1)
    assert stats.tier_blocks == {TIER_NPU: 3, TIER_CPU: 3, TIER_DISK: 0}
    assert 0 < stats.bytes_per_entry < 10_000


# ---------------------------------------------------------------------- property test against a naive model

UNIVERSE_RNG = random.Random(1234)
_A = [UNIVERSE_RNG.randrange(1000) for _ in range(2 * BS)]
PROMPTS = [
    _A + [UNIVERSE_RNG.randrange(1000) for _ in range(4 * BS)],
    _A + [UNIVERSE_RNG.randrange(1000) for _ in range(4 * BS)],  # shares 2 blocks with prompt 0
    [UNIVERSE_RNG.randrange(1000) for _ in range(6 * BS)],
]
PROMPT_KEYS = [sequence_keys(p, BS) for p in PROMPTS]
WORKERS = [("a", 0), ("a", 1), ("b", 0)]
MEDIA = [MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK]


class Model:
    """Per worker and medium: engine id -> key; walks prefixes the obvious way."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], dict[str, dict[int, int]]] = {w: {m: {} for m in MEDIA} for w in WORKERS}

    def store(self, worker: tuple[str, int], medium: str, parent: int | None, items: list[tuple[int, int]]) -> None:
        if parent is not None and not any(parent in self.held[worker][m] for m in MEDIA):
            return
        for h, key in items:
            self.held[worker][medium][h] = key

    def query(self, keys: list[int]) -> dict[str, dict[int, TierHit]]:
        out: dict[str, dict[int, TierHit]] = {}
        for worker in WORKERS:
            i = 0
            counts = []
            for medium in MEDIA:
                held = set(self.held[worker][medium].values())
                start = i
                while i < len(keys) and keys[i] in held:
                    i += 1
                counts.append(i - start)
            if i:
                out.setdefault(worker[0], {})[worker[1]] = TierHit(*counts)
        return out


op_strategy = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "clear", "clear_medium"]),
    st.integers(0, len(WORKERS) - 1),
    st.integers(0, 2),  # medium
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, 5),  # first block
    st.integers(1, 6),  # block count
    st.integers(0, 1),  # engine id variant of the stored blocks
    st.integers(0, 1),  # engine id variant of the parent
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_strategy, max_size=40), st.booleans())
# one key held under two engine ids, then one id removed / the rank cleared
@example([("store", 0, 0, 0, 0, 3, 0, 0), ("store", 0, 0, 0, 0, 3, 1, 0), ("remove", 0, 0, 0, 0, 3, 0, 0)], True)
@example([("store", 1, 1, 0, 0, 3, 0, 0), ("store", 1, 1, 0, 0, 3, 1, 0), ("clear", 1, 0, 0, 0, 0, 0, 0)], False)
def test_matches_naive_model(ops: list[tuple[int, ...]], signed: bool) -> None:
    idx = PrefixIndex(BS)
    capped = PrefixIndex(BS, capacity_blocks=8)  # evicts: never more, and never a false hit
    model = Model()

    def eid(key: int, variant: int) -> int:
        h = ehash(key, variant)
        return to_i64(h) if signed else h

    for kind, w, m, p, first, count, variant, parent_variant in ops:
        worker, medium = WORKERS[w], MEDIA[m]
        keys = PROMPT_KEYS[p]
        last = min(first + count, len(keys))
        if kind == "store":
            parent = eid(keys[first - 1], parent_variant) if first else None
            items = [(to_u64(eid(keys[i], variant)), keys[i]) for i in range(first, last)]
            model.store(worker, medium, None if parent is None else to_u64(parent), items)
            event = BlockStored(
                block_hashes=[eid(keys[i], variant) for i in range(first, last)],
                parent_block_hash=parent,
                token_ids=PROMPTS[p][first * BS : last * BS],
                block_size=BS,
                medium=medium,
            )
            idx.apply_batch(worker[0], EventBatch(ts=0.0, events=[event], dp_rank=worker[1]))
            capped.apply_batch(worker[0], EventBatch(ts=0.0, events=[event], dp_rank=worker[1]))
        elif kind == "remove":
            hashes = [eid(keys[i], variant) for i in range(first, last)]
            for h in hashes:
                model.held[worker][medium].pop(to_u64(h), None)
            idx.apply_event(worker[0], worker[1], BlockRemoved(block_hashes=hashes, medium=medium))
            capped.apply_event(worker[0], worker[1], BlockRemoved(block_hashes=hashes, medium=medium))
        elif kind == "clear":
            for held in model.held[worker].values():
                held.clear()
            idx.apply_event(worker[0], worker[1], AllBlocksCleared())
            capped.apply_event(worker[0], worker[1], AllBlocksCleared())
        else:
            model.held[worker][medium].clear()
            idx.clear_rank(worker[0], worker[1], medium)
            capped.clear_rank(worker[0], worker[1], medium)
        assert capped.stats().blocks <= 8
        for keys in PROMPT_KEYS:
            for length in (1, 3, len(keys)):
                expected = model.query(keys[:length])
                assert idx.query_keys(keys[:length]) == expected
                for inst, ranks in capped.query_keys(keys[:length]).items():
                    for rank, hit in ranks.items():
                        assert hit.total_blocks <= expected[inst][rank].total_blocks
    for worker in WORKERS:
        for medium in MEDIA:
            assert idx.resident(worker[0], worker[1], medium) == set(model.held[worker][medium])


# ---------------------------------------------------------------------- longest_prefixes (one instance, lean)


def _as_tuples(hits: dict[int, TierHit]) -> dict[int, tuple[int, int, int]]:
    return {rank: (h.npu_blocks, h.cpu_blocks, h.disk_blocks) for rank, h in hits.items()}


@pytest.mark.parametrize("media", [[MEDIUM_GPU], [MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK]], ids=["npu_only", "tiers"])
@pytest.mark.parametrize("capacity", [None, 40])
def test_longest_prefixes_equals_query_keys_on_random_data(media: list[str], capacity: int | None) -> None:
    rng = random.Random(len(media) * 100 + (capacity or 0))
    idx = PrefixIndex(BS, capacity_blocks=capacity)
    shared = [rng.randrange(50) for _ in range(3 * BS)]  # a common head: multi-holder masks
    prompts = [shared + [rng.randrange(50) for _ in range(rng.randrange(1, 6) * BS)] for _ in range(12)]
    instances = ["a", "b"]
    for step in range(300):
        inst, rank = rng.choice(instances), rng.randrange(20)  # > 1 worker per instance, wide masks
        toks = rng.choice(prompts)
        blocks = len(toks) // BS
        roll = rng.random()
        if roll < 0.6:
            first = rng.randrange(blocks)
            store(idx, inst, rank, toks[: rng.randrange(first + 1, blocks + 1) * BS], first=first,
                  medium=rng.choice(media), salt=rng.randrange(2), merged=rng.random() < 0.5)  # fmt: skip
        elif roll < 0.9:
            hashes = [ehash(k, rng.randrange(2)) for k in sequence_keys(toks, BS)]
            gone = rng.sample(hashes, rng.randrange(1, 3))
            idx.apply_event(inst, rank, BlockRemoved(block_hashes=gone, medium=rng.choice(media)))
        elif roll < 0.97:
            idx.clear_rank(inst, rank, rng.choice([None, *media]))
        else:
            idx.clear_instance(inst)
        if step % 5:
            continue
        for toks in [*prompts, [rng.randrange(50) for _ in range(4 * BS)]]:
            keys = sequence_keys(toks, BS)
            cut = keys[: rng.randrange(1, len(keys) + 1)]
            for inst in [*instances, "unknown"]:
                expected = _as_tuples(idx.query_keys(cut, [inst]).get(inst, {}))
                assert idx.longest_prefixes(inst, cut) == expected
                assert idx.longest_prefixes(inst, iter(cut)) == expected  # a one-shot iterator too
                assert idx.longest_prefixes_tokens(inst, toks, len(cut)) == expected  # hashed as it walks
                assert idx.longest_prefixes_tokens(inst, array("q", toks), len(cut)) == expected


@pytest.mark.parametrize("medium", [MEDIUM_GPU, MEDIUM_CPU])
def test_longest_prefixes_pulls_keys_only_up_to_the_first_unheld(medium: str) -> None:
    idx = PrefixIndex(BS, capacity_blocks=1000)
    toks = tokens(8)
    store(idx, "a", 0, toks[: 3 * BS], medium=medium)
    store(idx, "a", 1, toks[: 5 * BS], medium=medium)
    store(idx, "b", 2, toks, medium=medium)  # another instance holds all 8: it does not count
    keys = sequence_keys(toks, BS)
    pulled: list[int] = []

    def lazy() -> Iterator[int]:
        for key in keys:
            pulled.append(key)
            yield key

    hits = idx.longest_prefixes("a", lazy())
    assert hits == ({0: (3, 0, 0), 1: (5, 0, 0)} if medium == MEDIUM_GPU else {0: (0, 3, 0), 1: (0, 5, 0)})
    assert pulled == keys[:6]  # block 5 is held by no rank of "a": the walk stops there
    pulled.clear()
    assert idx.longest_prefixes("a", lazy()) == hits  # and again (recency touches change no answer)
    assert idx.longest_prefixes("a", iter([])) == {}
    assert idx.longest_prefixes("zzz", lazy()) == {} and pulled == keys[:6]  # unknown instance: nothing pulled
    assert idx.stats().queries == 4
