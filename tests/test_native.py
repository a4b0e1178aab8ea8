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


@needs_native
def test_npu_walk_equals_the_linear_walk_on_random_masks() -> None:
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
        got = NATIVE.npu_walk(array("q", tokens), block, hashing.BASE_SEED, len(tokens) // block, masks, held)
        assert (list(got[0]), got[1]) == _python_walk(tokens, block, masks, held)


@needs_native
def test_npu_walk_takes_only_dicts_and_64_bit_worker_sets() -> None:
    tokens = array("I", range(16))
    with pytest.raises(TypeError):
        NATIVE.npu_walk(tokens, 4, 1, 4, [], 1)
    with pytest.raises(OverflowError):
        NATIVE.npu_walk(tokens, 4, 1, 4, {}, 1 << 64)


def _populated(rng: random.Random, ranks: int, block: int) -> tuple[PrefixIndex, list[list[int]]]:
    index = PrefixIndex(block, capacity_blocks=None)
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
def test_index_and_dispatcher_answer_the_same_with_and_without_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    block = 4
    index, prompts = _populated(rng, 8, block)
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
def test_take_token_ids_splits_a_body_in_one_pass() -> None:
    ids = list(range(0, 200_000, 7))
    body = {
        "model": "m",
        "block_size": 128,
        "token_ids": ids,
        "messages": [{"role": "user", "content": "x" * 300, "extra": [1, 2.5, None, True, b"\x00" * 70_000]}],
        "tenant_id": "t" * 40,
    }
    taken, rest = NATIVE.take_token_ids(msgpack.packb(body))
    assert array("I", taken).tolist() == ids
    assert msgpack.unpackb(rest) == {k: v for k, v in body.items() if k != "token_ids"}
    many = {f"k{i}": i for i in range(40)} | {"token_ids": [3, 4]}  # a map16 header, 40 entries left
    taken, rest = NATIVE.take_token_ids(msgpack.packb(many))
    assert (array("I", taken).tolist(), msgpack.unpackb(rest)) == ([3, 4], {f"k{i}": i for i in range(40)})


@needs_native
@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb({"model": "m"}),  # no token_ids
        msgpack.packb({"model": "m", "token_ids": None}),  # nil: the tokenizer path
        msgpack.packb({"token_ids": "1 2 3"}),  # not an array: the struct decoder refuses it
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"model": "m", "token_ids": [1, 2]})[:-2],  # truncated
        b"\x82\xa9token_ids\x91\x01\xa9token_ids\x91\x02",  # twice
        b"",
    ],
)
def test_take_token_ids_leaves_what_it_does_not_take(raw: bytes) -> None:
    assert NATIVE.take_token_ids(raw) == (None, raw)


@needs_native
def test_take_token_ids_refuses_bad_ids() -> None:
    with pytest.raises(ValueError, match=r"token_ids\[2\]"):
        NATIVE.take_token_ids(msgpack.packb({"model": "m", "token_ids": [1, 2, -3]}))


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
