"""The optional C helpers (sglang_kvpub/core/_native.c) against the Python reference.

Every helper must give exactly what the Python path gives - the keys, the walk's hits, the
u32 ids - or refuse the same input; and the package must work the same without them
(``hashing.NATIVE`` None).  CI builds them and sets ``KVPUB_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from typing import Any

import msgpack
import pytest

from sglang_kvpub import wire
from sglang_kvpub.core import hashing
from sglang_kvpub.core.dispatch import CacheAwareDispatcher
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.wire import BlockRemoved, BlockStored, EventBatch

pytestmark = pytest.mark.unit

NATIVE = hashing.NATIVE
needs_native = pytest.mark.skipif(NATIVE is None, reason="the C helpers are not built (no C compiler at install)")


def test_helpers_are_built_where_required() -> None:
    if os.environ.get("KVPUB_REQUIRE_NATIVE") == "1":
        assert NATIVE is not None, "KVPUB_REQUIRE_NATIVE=1 but sglang_kvpub.core._native did not build or bind"


def test_switched_off_by_environment() -> None:
    code = "from sglang_kvpub.core import hashing; print(hashing.NATIVE is None)"
    env = {**os.environ, "KVPUB_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _ids(rng: random.Random, count: int, high: int = 1 << 32) -> list[int]:
    return [rng.randrange(high) for _ in range(count)]


@needs_native
@pytest.mark.parametrize("block_size", [1, 16, 128, 1024, 1500])
@pytest.mark.parametrize("typecode", ["I", "i", "q", "Q", "l"])
def test_chain_keys_equal_the_python_loop(block_size: int, typecode: str) -> None:
    rng = random.Random(block_size)
    count = block_size * 5 + rng.randrange(block_size)  # a trailing partial block is ignored
    high = (1 << 31) if typecode in "il" else (1 << 32)
    ids = _ids(rng, count, high)
    if typecode in "qQl":  # 8-byte ids beyond u32: cast like the conductor
        ids = [i | (rng.randrange(1 << 20) << 32) for i in ids] if typecode == "Q" else ids
    raw = hashing.tokens_u32(ids)
    blocks = count // block_size
    for seed, parent, start in [(hashing.BASE_SEED, hashing.BASE_SEED, 0), (7, 99, 2), (1 << 63, 5, blocks)]:
        expected = hashing._chained_py(raw, block_size, seed, parent, start, blocks)
        assert NATIVE.chain_keys(array(typecode, ids), block_size, seed, parent, start, blocks) == expected
        assert NATIVE.chain_keys(raw, block_size, seed, parent, start, blocks) == expected
    assert hashing.sequence_keys(array(typecode, ids), block_size) == hashing._chained_py(
        raw, block_size, hashing.BASE_SEED, hashing.BASE_SEED, 0, blocks
    )


@needs_native
def test_negative_8_byte_ids_are_cast_like_the_python_path() -> None:
    ids = [-1, -(1 << 40), 5, 1 << 35] * 8
    assert hashing.sequence_keys(array("q", ids), 4) == hashing.sequence_keys([i & 0xFFFFFFFF for i in ids], 4)


@needs_native
@pytest.mark.parametrize(
    ("source", "args", "error"),
    [
        (b"\x00" * 6, (1, 0, 0, 0, 1), ValueError),  # not a multiple of 4 bytes
        (array("I", [1, 2]), (1, 0, 0, 0, 3), ValueError),  # blocks past the end
        (array("I", [1, 2]), (0, 0, 0, 0, 1), ValueError),  # block size 0
        (array("I", [1, 2]), (1, 0, 0, 2, 1), ValueError),  # end before start
        (array("h", [1, 2]), (1, 0, 0, 0, 1), TypeError),  # 2-byte ids
        (array("d", [1.0, 2.0]), (1, 0, 0, 0, 1), TypeError),  # floats
        ("text", (1, 0, 0, 0, 1), TypeError),
    ],
)
def test_chain_keys_refuses_what_it_cannot_read(source: Any, args: tuple[int, ...], error: type) -> None:
    block_size, seed, parent, start, end = args
    with pytest.raises(error):
        NATIVE.chain_keys(source, block_size, seed, parent, start, end)


def _python_walk(tokens: list[int], block_size: int, masks: dict[int, int], held: int) -> tuple[list[Any], int]:
    """The reference: PrefixIndex's linear walk, spelled out."""
    ends: list[tuple[int, int]] = []
    position = 0
    for key in hashing.sequence_keys(tokens, block_size):
        holders = masks.get(key, 0)
        kept = held & (holders if holders >= 0 else 1 << ~holders)
        if kept != held:
            if position:
                ends.append((position, held ^ kept))
            if not kept:
                return ends, position
            held = kept
        position += 1
    if position:
        ends.append((position, held))
    return ends, position


def _key_masks(masks: dict[int, int]) -> Any:
    table = NATIVE.KeyMasks()
    for key, value in masks.items():
        table[key] = value
    return table


@needs_native
@pytest.mark.parametrize("table", ["dict", "KeyMasks"])
def test_npu_walk_equals_the_linear_walk_on_random_masks(table: str) -> None:
    rng = random.Random(3)
    block = 8
    for _ in range(300):
        tokens = _ids(rng, block * rng.randrange(1, 12) + rng.randrange(block), 50)
        keys = hashing.sequence_keys(tokens, block)
        masks: dict[int, int] = {}
        for key in keys:
            roll = rng.random()
            if roll < 0.1:
                continue  # a hole
            if roll < 0.3:
                masks[key] = ~rng.randrange(70)  # one worker, some beyond 64 bits
            else:
                masks[key] = rng.getrandbits(rng.choice([8, 64, 100]))  # masks past 64 bits: only the low 64 meet
        held = rng.getrandbits(64) | 1
        walked = masks if table == "dict" else _key_masks(masks)
        blocks = len(tokens) // block
        got = NATIVE.npu_walk(array("q", tokens), block, hashing.BASE_SEED, blocks, walked, held)
        expected = _python_walk(tokens, block, masks, held)
        assert (list(got[0]), got[1]) == expected
        # The same walk emitting straight into rank -> (depth, 0, 0), as PrefixIndex._emit_npu.
        rank_of = [wid % 5 if wid % 7 else -1 for wid in range(64)]  # -1: a worker without a rank
        out: dict[int, tuple[int, int, int]] = {}
        depth = NATIVE.npu_walk_ranks(array("q", tokens), block, hashing.BASE_SEED, blocks, walked, held, out, rank_of)
        reference: dict[int, tuple[int, int, int]] = {}
        for position, mask in expected[0]:
            for wid in range(64):
                if mask >> wid & 1 and rank_of[wid] >= 0:
                    reference[rank_of[wid]] = (position, 0, 0)
        assert (out, depth) == (reference, expected[1])


@needs_native
def test_key_masks_table_follows_every_write_of_the_dict() -> None:
    rng = random.Random(5)
    table = NATIVE.KeyMasks()
    model: dict[int, int] = {}
    keys = [rng.getrandbits(64) for _ in range(3000)] + list(range(64))  # small ints too

    def low_bits(value: int) -> int:
        if value >= 0:
            return value & ((1 << 64) - 1)
        return 1 << ~value if ~value < 64 else 0

    for step in range(60_000):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.5:
            value = rng.choice([~rng.randrange(80), rng.getrandbits(rng.choice([3, 64, 90])), 0])
            table[key] = model[key] = value
        elif roll < 0.7:
            if key in model:
                del table[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        elif roll < 0.95:
            assert table.pop(key, None) == model.pop(key, None)
        elif step % 97 == 0:
            table.clear()
            model.clear()
        if step % 500 == 0:
            assert dict(table) == model and list(table) == list(model)  # insertion order kept
            assert table.table_len() == sum(1 for v in model.values() if low_bits(v))
            assert all(table.table_get(k) == low_bits(model.get(k, 0)) for k in keys)
    assert all(table.table_get(k) == low_bits(model.get(k, 0)) for k in keys)


@needs_native
def test_key_masks_refuses_writes_that_would_bypass_its_table() -> None:
    table = NATIVE.KeyMasks()
    table[1] = 3
    for write in (
        lambda: table.update({2: 1}),
        lambda: table.setdefault(2, 1),
        lambda: table.popitem(),
        lambda: table.__ior__({2: 1}),
        lambda: NATIVE.KeyMasks({2: 1}),
    ):
        with pytest.raises(TypeError):
            write()
    with pytest.raises(TypeError):
        table["a"] = 1  # keys are u64 ints
    with pytest.raises(OverflowError):
        table[-1] = 1
    with pytest.raises(TypeError):
        table[2] = 1.0  # values are int holders
    with pytest.raises(KeyError):
        table.pop(9)
    assert dict(table) == {1: 3} and table.table_get(1) == 3 and table.table_get(2) == 0
    assert sys.getsizeof(table) > sys.getsizeof({1: 3})  # the table is counted


@needs_native
def test_npu_walk_takes_only_dicts_and_64_bit_worker_sets() -> None:
    tokens = array("I", range(16))
    with pytest.raises(TypeError):
        NATIVE.npu_walk(tokens, 4, 1, 4, [], 1)
    with pytest.raises(OverflowError):
        NATIVE.npu_walk(tokens, 4, 1, 4, {}, 1 << 64)


def _populated(rng: random.Random, ranks: int, block: int, **options: Any) -> tuple[PrefixIndex, list[list[int]]]:
    index = PrefixIndex(block, **{"capacity_blocks": None, **options})
    prompts = []
    for rank in range(ranks):
        for _ in range(6):
            prompt = _ids(rng, block * rng.randrange(1, 10), 40)  # small ids: shared prefixes happen
            blocks = len(prompt) // block
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
            index.apply_batch("i", EventBatch(0.0, [BlockStored(hashes, None, prompt, block)], rank), rank)
            if rng.random() < 0.3:
                index.apply_batch("i", EventBatch(0.0, [BlockRemoved(hashes[-1:])], rank), rank)
            prompts.append(prompt)
    return index, prompts


@needs_native
@pytest.mark.parametrize(
    "options",
    [{}, {"npu_walk_table": True}, {"npu_walk_table": True, "capacity_blocks": 120}],
    ids=["dict", "walk-table", "walk-table-evicting"],
)
def test_index_and_dispatcher_answer_the_same_with_and_without_the_helpers(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    rng = random.Random(11)
    block = 4
    index, prompts = _populated(rng, 8, block, **options)
    assert type(index._masks[0]).__name__ == ("KeyMasks" if options else "dict")
    queries = [p[: rng.randrange(len(p) + 1)] + _ids(rng, rng.randrange(3 * block), 40) for p in prompts]
    queries += [_ids(rng, 6 * block, 40) for _ in range(20)]
    native = [index.longest_prefixes_tokens("i", array("q", q)) for q in queries]
    dispatcher = CacheAwareDispatcher(8, block, index=index, instance="i")
    loads = [float(rng.randrange(100)) for _ in range(8)]
    native_decisions = []
    for q in queries:
        dispatcher._rotation = 0
        native_decisions.append(dispatcher.choose(array("q", q), loads))
    monkeypatch.setattr(hashing, "NATIVE", None)
    assert [index.longest_prefixes_tokens("i", q) for q in queries] == native
    assert [index.query_keys(hashing.sequence_keys(q, block), ["i"]).get("i", {}) for q in queries] == [
        {rank: index._hit(*hit) for rank, hit in answer.items()} for answer in native
    ]
    python_decisions = []
    for q in queries:
        dispatcher._rotation = 0
        python_decisions.append(dispatcher.choose(q, loads))
    assert python_decisions == native_decisions


def _random_dispatcher(rng: random.Random, index: PrefixIndex, ranks: int) -> CacheAwareDispatcher:
    return CacheAwareDispatcher(
        ranks,
        index.block_size,
        index=index,
        instance="i",
        load_weight=rng.choice([1.0, 0.5, 2, 0.0]),
        prefill_load_scale=rng.choice([1.0, 0.25, 3]),
        overlap_credit=rng.choice([1.0, 0.5, 1]),
        hotspot_spread=rng.choice([None, 0.0, 10.0, 16384.0]),
        hotspot_relative=rng.choice([None, 0.5, 1.0]),
        w_npu=rng.choice([1.0, 0.8]),
        w_cpu=rng.choice([1.0, 0.5, 0]),
        w_disk=rng.choice([0.0, 0.25]),
    )


@needs_native
def test_dispatch_score_decides_as_the_python_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C scorer against _decide's Python lines: costs, first-among-equals in the rotated
    order, the guard, int and float loads, candidate subsets, every weight and threshold."""
    rng = random.Random(23)
    block = 4
    index, prompts = _populated(rng, 8, block)
    for tier in ("CPU", "DISK"):  # lower tiers too: hits (npu, cpu, disk) with every part set
        for rank in range(0, 8, 3):
            prompt = prompts[rng.randrange(len(prompts))]
            hashes = [rng.getrandbits(63) for _ in range(len(prompt) // block)]
            index.apply_batch("i", EventBatch(0.0, [BlockStored(hashes, None, prompt, block, medium=tier)], rank), rank)
    cases = []
    for _ in range(600):
        dispatcher = _random_dispatcher(rng, index, 8)
        prompt = prompts[rng.randrange(len(prompts))]
        query = prompt[: rng.randrange(len(prompt) + 1)] + _ids(rng, rng.randrange(3 * block), 40)
        size = rng.choice([8, 8, 6])
        loads: list[Any] = [rng.choice([0, 5, 5.0, 100, rng.uniform(0, 200)]) for _ in range(size)]
        candidates = rng.choice([None, list(range(8)), [7, 2, 5], [1], [3, 9, -1, 0]])
        rotation = rng.randrange(8)
        cases.append((dispatcher, query, loads, candidates, rotation))

    def decide_all() -> list[Any]:
        out = []
        for dispatcher, query, loads, candidates, rotation in cases:
            dispatcher._rotation = rotation
            out.append(dispatcher.choose(query, loads, candidates=candidates))
        return out

    native = decide_all()
    monkeypatch.setattr(hashing, "NATIVE", None)
    python = decide_all()
    assert native == python
    assert {d.reason for d in native} >= {"cache_hit", "no_hit", "hotspot"}  # every branch ran
    assert any(d.cpu_blocks or d.disk_blocks for d in native)


@needs_native
def test_dispatch_score_refuses_what_it_cannot_score() -> None:
    args = ({0: (1, 0, 0)}, [1.0], [0], 0, 8, 4, (1.0, 1.0, 0.0), 1.0, 1.0, 1.0, None, None)
    assert NATIVE.dispatch_score(*args) == (0, 0, 4, 4.0 + 1.0, 1.0)
    with pytest.raises(ValueError):
        NATIVE.dispatch_score(args[0], args[1], [], *args[3:])  # no candidates
    with pytest.raises(IndexError):
        NATIVE.dispatch_score(args[0], args[1], [3], *args[3:])  # a rank without a load
    with pytest.raises(TypeError):
        NATIVE.dispatch_score({0: [1, 0, 0]}, *args[1:])  # a hit that is no tuple
    with pytest.raises(TypeError):
        NATIVE.dispatch_score(args[0], ["x"], *args[2:])  # a load that is no number


# --------------------------------------------------------------------------- msgpack ids


@needs_native
@pytest.mark.parametrize("count", [0, 1, 15, 16, 65_535, 65_536])
def test_u32_from_msgpack_reads_every_integer_form(count: int) -> None:
    rng = random.Random(count)
    forms = [0, 127, 128, 255, 256, 65_535, 65_536, 0xFFFFFFFF]
    ids = [rng.choice(forms) if rng.random() < 0.5 else rng.randrange(1 << 32) for _ in range(count)]
    assert array("I", NATIVE.u32_from_msgpack(msgpack.packb(ids))).tolist() == ids
    # signed and 64-bit encodings of values in range are ids too
    signed = b"\x93" + b"\xd0\x05" + b"\xd3" + (7).to_bytes(8, "big") + b"\xcf" + (9).to_bytes(8, "big")
    assert array("I", NATIVE.u32_from_msgpack(signed)).tolist() == [5, 7, 9]


@needs_native
@pytest.mark.parametrize("at", [0, 1, 2, 500, 998, 999])
def test_u32_from_msgpack_reads_other_forms_and_names_bad_items_amid_a_long_run(at: int) -> None:
    """The per-id loop takes fixint/0xcc/0xcd/0xce items in one go and hands any other item
    to the general reader: a signed or 64-bit encoding amid the run is still an id, and a bad
    item is named by its index wherever it sits."""
    rng = random.Random(at)
    ids = [rng.randrange(1 << rng.choice((7, 8, 16, 32))) for _ in range(1000)]
    packed = [msgpack.packb(i) for i in ids]
    head = b"\xdc" + len(ids).to_bytes(2, "big")
    packed[at] = b"\xcf" + ids[at].to_bytes(8, "big")  # an id in a 64-bit form
    assert array("I", NATIVE.u32_from_msgpack(head + b"".join(packed))).tolist() == ids
    packed[at] = b"\xd0\xff"  # -1
    with pytest.raises(ValueError, match=rf"token_ids\[{at}\] must be an integer"):
        NATIVE.u32_from_msgpack(head + b"".join(packed))
    packed[at] = b"\xce\x00"  # cut short: the array runs past the end
    with pytest.raises(ValueError):
        NATIVE.u32_from_msgpack(head + b"".join(packed[: at + 1]))


@needs_native
@pytest.mark.parametrize(
    ("items", "bad"),
    [([1, -1], 1), ([1 << 32], 0), ([1, 2, 1.5], 2), ([1, "2"], 1), ([None], 0), ([True], 0), ([[1]], 0)],
)
def test_u32_from_msgpack_names_the_first_bad_item(items: list[Any], bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token_ids\[{bad}\]"):
        NATIVE.u32_from_msgpack(msgpack.packb(items))


@needs_native
@pytest.mark.parametrize("raw", [b"", b"\x92\x01", b"\x91\x01\x02", b"\xa1x", b"\xdc\x00"])
def test_u32_from_msgpack_refuses_malformed_arrays(raw: bytes) -> None:
    with pytest.raises(ValueError):
        NATIVE.u32_from_msgpack(raw)


@needs_native
def test_u32_from_ints_takes_what_struct_takes() -> None:
    numpy = pytest.importorskip("numpy")
    ids = [0, 1, 0xFFFFFFFF, -1, 1 << 40 | 7, True, numpy.int64(5), numpy.uint32(9)]
    expected = hashing._packer(len(ids)).pack(*[int(i) & 0xFFFFFFFF for i in ids])
    assert NATIVE.u32_from_ints(ids) == expected
    assert NATIVE.u32_from_ints(tuple(ids)) == expected
    with pytest.raises(TypeError):
        NATIVE.u32_from_ints([1, 2.0])
    with pytest.raises(TypeError):
        NATIVE.u32_from_ints(array("I", [1]))


@needs_native
def test_router_queries_answer_the_same_with_and_without_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrefixIndex.query`` over many instances (worker sets past 64 bits): the C emission
    of the per-instance hits equals the Python one, key order included."""
    rng = random.Random(5)
    block = 4
    index = PrefixIndex(block, capacity_blocks=None)
    prompts = []
    for instance in range(12):
        for rank in range(9):
            for _ in range(3):
                prompt = _ids(rng, block * rng.randrange(1, 8), 6)  # tiny vocabulary: many ranks share prefixes
                hashes = [rng.getrandbits(63) for _ in range(len(prompt) // block)]
                batch = EventBatch(0.0, [BlockStored(hashes, None, prompt, block)], rank)
                index.apply_batch(f"inst-{instance}", batch, rank)
                prompts.append(prompt)
    index.clear_rank("inst-3", 4)  # a hole in the worker ids
    queries = [p[: rng.randrange(len(p) + 1)] + _ids(rng, rng.randrange(2 * block), 6) for p in prompts]
    native = [index.query(q) for q in queries]
    assert sum(len(ranks) for answer in native for ranks in answer.values()) > 200
    monkeypatch.setattr(hashing, "NATIVE", None)
    python = [index.query(q) for q in queries]
    assert native == python
    assert [[list(ranks) for ranks in answer.values()] for answer in native] == [
        [list(ranks) for ranks in answer.values()] for answer in python
    ]


@needs_native
def test_hash_keys_follows_a_dict_model() -> None:
    """Insert, replace, lookup, remove (backward shift), growth and clear against a dict,
    engine hash 0 (the table's empty mark) and the u64 extremes included."""
    rng = random.Random(41)
    table = NATIVE.HashKeys()
    model: dict[int, int] = {}
    keys = [rng.getrandbits(64) for _ in range(4000)] + list(range(64)) + [(1 << 64) - 1]
    for step in range(80_000):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.45:
            value = rng.choice([0, 1, (1 << 64) - 1, rng.getrandbits(64)])
            table[key] = model[key] = value
        elif roll < 0.6:
            if key in model:
                del table[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        elif roll < 0.8:
            assert table.pop(key, None) == model.pop(key, None)
        elif roll < 0.99:
            assert table.get(key) == model.get(key) and (key in table) == (key in model)
        elif step % 31 == 0:
            table.clear()
            model.clear()
        if step % 1000 == 0:
            assert len(table) == len(model)
            assert dict(table.items()) == model and sorted(table) == sorted(model)
            assert sorted(table.keys()) == sorted(model) and sorted(table.values()) == sorted(model.values())
            assert all(table.get(k) == model.get(k) for k in keys)
    assert dict(table.items()) == model


@needs_native
def test_hash_keys_grows_with_entries_not_with_churn() -> None:
    table = NATIVE.HashKeys()
    assert table.capacity() == 0 and len(table) == 0
    for n in range(1, 1001):
        table[n * 7919] = n
    grown = table.capacity()
    assert len(table) <= 0.75 * grown and len(table) > 0.75 * grown / 2  # load <= 0.75, doubling
    rng = random.Random(3)
    live = list(range(1, 1001))
    for n in range(1001, 50_001):  # an LRU's life: one in, one out, 49k times
        table[n * 7919] = n
        out = live.pop(rng.randrange(len(live)))
        assert table.pop(out * 7919) == out
        live.append(n)
    assert table.capacity() == grown  # no tombstones: removals make room again
    assert dict(table.items()) == {n * 7919: n for n in live}
    assert sys.getsizeof(table) >= grown * 16
    table.clear()
    assert table.capacity() == 0 and len(table) == 0 and table.get(7919) is None


@needs_native
def test_hash_keys_add_new_is_all_or_nothing() -> None:
    table = NATIVE.HashKeys()
    assert table.add_new([5, 0, 9], [50, 0, 90]) is True
    assert dict(table.items()) == {5: 50, 0: 0, 9: 90}
    assert table.add_new([1, 2, 9], [10, 20, 30]) is False  # 9 is present
    assert table.add_new([1, 2, 1], [10, 20, 30]) is False  # a repeat within the call
    assert table.add_new([0], [1]) is False  # engine hash 0 too
    assert dict(table.items()) == {5: 50, 0: 0, 9: 90}
    big = [n * 104_729 + 1 for n in range(5000)]
    assert table.add_new(big, big) is True and len(table) == 5003  # grows in one step
    with pytest.raises(ValueError):
        table.add_new([1, 2], [1])
    with pytest.raises(OverflowError):
        table.add_new([1, -2], [1, 2])
    assert len(table) == 5003


@needs_native
def test_hash_keys_takes_u64_ints_only() -> None:
    table = NATIVE.HashKeys()
    with pytest.raises(OverflowError):
        table[-1] = 1
    with pytest.raises(OverflowError):
        table[1] = 1 << 64
    with pytest.raises(TypeError):
        table["a"] = 1
    with pytest.raises(TypeError):
        NATIVE.HashKeys({1: 2})
    table[1] = 2
    assert table.get(-1) is None and -1 not in table and table.pop(1 << 70, "x") == "x"  # a miss, as a dict's
    with pytest.raises(KeyError):
        table[3]


def _churned(rng: random.Random, capacity: int | None) -> tuple[PrefixIndex, list[list[int]]]:
    """An index fed stores, replacements (same engine hash, new content), repeats, removals,
    rank clears and an instance leaving: every write path of the engine hash -> key maps."""
    block = 4
    index = PrefixIndex(block, capacity_blocks=capacity)
    prompts: list[list[int]] = []
    held: dict[tuple[str, int], list[int]] = {}

    def engine_hash() -> int:  # u64, i64 or small (0 too)
        return rng.choice((rng.getrandbits(64), -rng.getrandbits(63), rng.randrange(8)))

    for _ in range(1500):
        instance, rank = f"i{rng.randrange(3)}", rng.randrange(4)
        hashes_held = held.setdefault((instance, rank), [])
        roll = rng.random()
        if roll < 0.6 or not hashes_held:
            prompt = _ids(rng, block * rng.randrange(1, 6), 30)
            blocks = len(prompt) // block
            if rng.random() < 0.2 and len(hashes_held) >= blocks:
                hashes = rng.sample(hashes_held, blocks)  # known ids: replaced or repeated
            else:
                hashes = [engine_hash() for _ in range(blocks)]
            medium = rng.choice(["GPU", "GPU", "CPU_PINNED"])
            event = BlockStored(hashes, None, prompt, block, medium=medium)
            index.apply_batch(instance, EventBatch(0.0, [event], rank), rank)
            hashes_held.extend(hashes)
            prompts.append(prompt)
        elif roll < 0.95:
            gone = rng.sample(hashes_held, min(len(hashes_held), rng.randrange(1, 4)))
            medium = rng.choice(["GPU", "CPU_PINNED"])
            index.apply_batch(instance, EventBatch(0.0, [BlockRemoved(gone, medium=medium)], rank), rank)
        elif roll < 0.99:
            index.clear_rank(instance, rank, rng.choice([None, "GPU"]))
        else:
            index.clear_instance(instance)
            held = {k: v for k, v in held.items() if k[0] != instance}
    return index, prompts


@needs_native
@pytest.mark.parametrize("capacity", [None, 150], ids=["unbounded", "evicting"])
def test_index_keeps_the_same_state_with_hash_keys_as_with_dicts(
    monkeypatch: pytest.MonkeyPatch, capacity: int | None
) -> None:
    native_index, prompts = _churned(random.Random(17), capacity)
    assert type(next(iter(native_index._workers.values())).maps[0]).__name__ == "HashKeys"
    with monkeypatch.context() as patch:
        patch.setattr(hashing, "NATIVE", None)
        python_index, _ = _churned(random.Random(17), capacity)
    assert type(next(iter(python_index._workers.values())).maps[0]) is dict
    for index in (native_index, python_index):
        index._hits.clear()
    native_stats, python_stats = native_index.stats(), python_index.stats()
    assert native_stats.blocks > 100 and native_stats.unknown_removals > 0
    assert (native_stats.evicted > 0) == (capacity is not None)
    for name in ("blocks", "keys", "workers", "tier_blocks", "orphans", "evicted", "unknown_removals", "stored"):
        assert getattr(native_stats, name) == getattr(python_stats, name), name
    for (instance, rank), worker in native_index._workers.items():
        for medium in ("GPU", "CPU_PINNED"):
            assert native_index.resident(instance, rank, medium) == python_index.resident(instance, rank, medium)
        other = python_index._workers[(instance, rank)]
        assert [dict(m.items()) for m in worker.maps] == [dict(m) for m in other.maps]
    for prompt in prompts[-200:]:
        assert native_index.query(prompt) == python_index.query(prompt)
    assert native_stats.bytes_per_entry < python_stats.bytes_per_entry  # no int object per engine hash


# --------------------------------------------------------------------------- compact decoded ids


@needs_native
@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb([]),
        msgpack.packb([0, 127, 128, 65_536, 0xFFFFFFFF]),
        msgpack.packb(list(range(0, 1 << 20, 7))),
        b"\x93" + b"\xd0\x05" + b"\xd3" + (7).to_bytes(8, "big") + b"\xcf" + (9).to_bytes(8, "big"),
        msgpack.packb([1, -1]),
        msgpack.packb([1 << 32]),
        msgpack.packb([1, "2"]),
        msgpack.packb([1.5]),
        b"\x92\x01",
        b"\x91\x01\x02",
        b"\xa1x",
        b"",
    ],
)
def test_u32_count_msgpack_checks_what_u32_from_msgpack_reads(raw: bytes) -> None:
    try:
        ids = array("I", NATIVE.u32_from_msgpack(raw))
    except ValueError:
        with pytest.raises(ValueError):
            NATIVE.u32_count_msgpack(raw)
    else:
        assert NATIVE.u32_count_msgpack(raw) == len(ids)


def _store_batch(rng: random.Random, tokens: list[int]) -> EventBatch:
    blocks = len(tokens) // 4
    stored = BlockStored([rng.getrandbits(64) for _ in range(blocks)], rng.getrandbits(63), tokens, 4, medium="GPU")
    return EventBatch(1.5, [BlockRemoved([rng.getrandbits(64)], medium="GPU"), stored], 3)


@needs_native
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_compact_ids_decode_as_the_list_and_encode_to_the_same_bytes(encoding: str) -> None:
    """The adapter's decoder keeps stored ids as their msgpack bytes (MsgpackIds): equal to
    the list, the same len/items/slices, hashed to the same keys, re-encoded byte for byte."""
    rng = random.Random(encoding == "map")
    tokens = _ids(rng, 40 * 4, rng.choice([1 << 7, 1 << 16, 1 << 32]))
    batch = _store_batch(rng, tokens)
    payload = wire.BatchEncoder(encoding).encode(batch)  # type: ignore[arg-type]
    compact = wire.BatchDecoder(token_ids=hashing.token_ids_from_msgpack).decode(payload)
    plain = wire.BatchDecoder().decode(payload)
    ids = compact.events[1].token_ids
    if encoding == "map":  # the fast path the fan-in's stream takes
        assert type(ids) is wire.MsgpackIds
    assert compact == plain == batch  # MsgpackIds equals the list it stands for
    assert len(ids) == len(tokens) and list(ids) == tokens and ids[5] == tokens[5] and ids[3:9] == tokens[3:9]
    assert bytes(hashing.tokens_u32(ids)) == bytes(hashing.tokens_u32(tokens))
    assert bytes(hashing.tokens_u32(ids, 8)) == bytes(hashing.tokens_u32(tokens, 8))
    for form in ("map", "array"):
        assert wire.BatchEncoder(form).encode(compact) == wire.BatchEncoder(form).encode(batch)  # type: ignore[arg-type]
    assert wire.split_stored(compact.events[1]) == wire.split_stored(batch.events[1])


@needs_native
@pytest.mark.parametrize(
    "tokens",
    [[-1, 2, 3, 4], [1 << 32, 2, 3, 4], [(1 << 63) - 1, 0, 0, 0]],
    ids=["negative", "beyond-u32", "i64-max"],
)
def test_compact_decoding_keeps_ids_outside_u32_as_a_list(tokens: list[int]) -> None:
    batch = _store_batch(random.Random(1), tokens)
    payload = wire.BatchEncoder().encode(batch)
    decoded = wire.BatchDecoder(token_ids=hashing.token_ids_from_msgpack).decode(payload)
    assert type(decoded.events[1].token_ids) is list and decoded == batch


def test_compact_decoding_refuses_what_the_plain_decoder_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad id (not an int) is the plain decoder's WireError either way; without the C
    helpers the reader declines and the ids are a list."""
    stored = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, "x", 3, 4], "block_size": 4}
    payload = msgpack.packb([1.0, [stored], 0])
    for reader in (hashing.token_ids_from_msgpack, None):
        with pytest.raises(wire.WireError):
            wire.BatchDecoder(token_ids=reader).decode(payload)
    monkeypatch.setattr(hashing, "NATIVE", None)
    batch = _store_batch(random.Random(2), [5, 6, 7, 8])
    decoded = wire.BatchDecoder(token_ids=hashing.token_ids_from_msgpack).decode(wire.BatchEncoder().encode(batch))
    assert type(decoded.events[1].token_ids) is list and decoded == batch


@needs_native
def test_index_applies_compact_ids_as_it_applies_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(9)
    batches = [_store_batch(rng, _ids(rng, 4 * rng.randrange(1, 8), 50)) for _ in range(60)]
    for batch in batches:
        batch.events[1].parent_block_hash = None
    payloads = [wire.BatchEncoder().encode(b) for b in batches]
    compact_decoder = wire.BatchDecoder(token_ids=hashing.token_ids_from_msgpack)
    from_lists, from_compact = PrefixIndex(4), PrefixIndex(4)
    for n, payload in enumerate(payloads):
        from_lists.apply_batch("i", wire.BatchDecoder().decode(payload), n % 4)
        decoded = compact_decoder.decode(payload)
        assert type(decoded.events[1].token_ids) is wire.MsgpackIds
        from_compact.apply_batch("i", decoded, n % 4)
    queries = [list(b.events[1].token_ids) for b in batches]
    assert [from_compact.query(q) for q in queries] == [from_lists.query(q) for q in queries]
    assert from_compact.stats().blocks == from_lists.stats().blocks > 0
    decoded_all = [compact_decoder.decode(payload) for payload in payloads]
    monkeypatch.setattr(hashing, "NATIVE", None)  # ids decoded with the helpers, hashed without them
    python_index = PrefixIndex(4)
    for n, decoded in enumerate(decoded_all):
        python_index.apply_batch("i", decoded, n % 4)
    assert [python_index.query(q) for q in queries] == [from_lists.query(q) for q in queries]
