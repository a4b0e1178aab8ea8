"""The router's C helpers (motor_adapter._answer: the /query body's ids split off, decoded and
hashed in one call, QueryKeysMemo's prefix reuse, the body key) against the
Python path: the same keys, ids and refusals, with and without the memo, with both id
decoders.  CI builds them and sets ``KVPUB_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import os
import random
import weakref
from array import array
from typing import Any

import msgpack
import pytest

from motor_adapter import native
from sglang_kvpub.core import hashing
from sglang_kvpub.core.rank_cost import spread_key

pytestmark = pytest.mark.unit

NATIVE = native.MODULE  # the router's extension
ENGINE = hashing.NATIVE  # the engine's: the stream's ids decode there, with the same decoders
needs_native = pytest.mark.skipif(
    NATIVE is None or ENGINE is None, reason="the C helpers are not built (no C compiler at install)"
)


def test_router_helpers_are_built_where_required() -> None:
    if os.environ.get("KVPUB_REQUIRE_NATIVE") == "1":
        assert NATIVE is not None, "KVPUB_REQUIRE_NATIVE=1 but motor_adapter._answer did not build or bind"


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


def _packed_id(rng: random.Random, value: int, forms: str) -> bytes:
    """``value`` in msgpack, in its shortest form or (``forms="any"``) at random in any
    integer form wide enough - msgpack allows longer ones, and the decoder must read them."""
    if forms == "short" or rng.random() < 0.9:
        return msgpack.packb(value)
    candidates = [(0xCE, 4), (0xCF, 8), (0xD3, 8)] + ([(0xD2, 4)] if value < 1 << 31 else [])
    candidates += [(0xCC, 1), (0xD0, 1)] if value < 128 else []
    candidates += [(0xCD, 2), (0xD1, 2)] if value < 1 << 15 else []
    tag, size = rng.choice(candidates)
    return bytes([tag]) + value.to_bytes(size, "big")


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_long_id_arrays_decode_in_two_chains_as_in_one(seed: int) -> None:
    """Arrays long enough for the two-chain decoder (u32_run_split, docs/native.md): every
    mix of forms, ids of any width, other integer forms amid the run, fields after the
    array; a bad id anywhere is named by its index, a cut array is malformed."""
    rng = random.Random(seed)
    count = rng.choice([1023, 1024, 1100, 4096, 6144, 20_000])
    top = rng.choice([128, 256, 65_536, 150_000, 1 << 32])
    ids = [rng.randrange(top) if rng.random() < 0.95 else rng.randrange(1 << 32) for _ in range(count)]
    forms = "short" if seed % 2 else "any"
    array_bytes = b"\xdd" + count.to_bytes(4, "big") + b"".join(_packed_id(rng, v, forms) for v in ids)
    body = b"\x83\xa5model\xa1m\xa9token_ids" + array_bytes + b"\xa6tenant\xa5" + b"t" * 5
    taken, rest = NATIVE.take_token_ids(body)
    assert array("I", taken).tolist() == ids
    assert msgpack.unpackb(rest) == {"model": "m", "tenant": "ttttt"}
    assert array("I", ENGINE.u32_from_msgpack(array_bytes)).tolist() == ids
    bad = rng.randrange(count)
    wrong = (
        b"\xdd" + count.to_bytes(4, "big") + b"".join(msgpack.packb(-1 if i == bad else v) for i, v in enumerate(ids))
    )
    with pytest.raises(ValueError, match=rf"token_ids\[{bad}\]"):
        ENGINE.u32_from_msgpack(wrong)
    with pytest.raises(ValueError, match="truncated"):
        ENGINE.u32_from_msgpack(array_bytes[: rng.randrange(6, len(array_bytes))])


def _query_keys_reference(raw: bytes, default_block_size: int, seed: int) -> Any:
    """``take_query_keys``'s answer by the Python path: ``take_token_ids``'s split, the
    block size the struct decoder reads, the Python loops' keys and ``spread_key``."""
    taken, rest = NATIVE.take_token_ids(raw)
    if taken is None:
        return None
    block_size = msgpack.unpackb(raw, strict_map_key=False).get("block_size", default_block_size)
    if type(block_size) is not int or not 0 < block_size <= 1 << 20:
        return None
    ids = array("I", taken).tolist()
    blocks = len(ids) // block_size
    keys = hashing._chained_py(taken, block_size, seed, seed, 0, blocks)
    if blocks:
        local = hashing._xxh3(taken[(blocks - 1) * block_size * 4 : blocks * block_size * 4], seed)
    else:
        local = hashing._xxh3(taken, seed) if ids else 0
    if seed == hashing.BASE_SEED:
        assert local == spread_key(ids, block_size)
    return rest, keys, len(ids), local, block_size


def _random_query_body(rng: random.Random) -> tuple[bytes, list[int]]:
    """A msgpack /query body: ids of every msgpack width (in any integer form wide enough),
    0..several blocks, the block size before or after the ids or absent, fields around."""
    block_size = rng.choice([1, 2, 16, 100, 128, 128, 333, 1024])
    count = rng.choice([0, 1, rng.randrange(block_size + 1), rng.randrange(6 * block_size + 2), 1100, 6144])
    top = rng.choice([128, 256, 65_536, 150_000, 1 << 32])
    ids = [rng.randrange(top) for _ in range(count)]
    forms = rng.choice(["short", "any"])
    array_bytes = msgpack.packb([]) if not ids else b"\xdd" + count.to_bytes(4, "big")
    array_bytes += b"".join(_packed_id(rng, v, forms) for v in ids)
    if rng.random() < 0.3 and count < 1 << 16:
        array_bytes = msgpack.packb(ids)  # fixarray / array16 headers
    entries = [
        msgpack.packb("model") + msgpack.packb("m"),
        msgpack.packb("tenant_id") + msgpack.packb(rng.choice(["default", "t" * 40])),
        msgpack.packb("messages") + msgpack.packb([{"role": "user", "content": "x" * rng.randrange(300)}]),
    ]
    if rng.random() < 0.8:
        entries.append(msgpack.packb("block_size") + _packed_id(rng, block_size, forms))
    rng.shuffle(entries)
    entries.insert(rng.randrange(len(entries) + 1), b"\xa9token_ids" + array_bytes)
    return bytes([0x80 | len(entries)]) + b"".join(entries), ids


@needs_native
@pytest.mark.parametrize("seed", range(300))
def test_take_query_keys_equals_the_python_path(seed: int) -> None:
    """One C call for the /query miss path: the split, the chained keys, the id count and
    the spread key equal the Python path's over random bodies."""
    rng = random.Random(seed)
    raw, ids = _random_query_body(rng)
    hash_seed = hashing.BASE_SEED if seed % 3 else hashing.lora_seed(f"lora-{seed}")
    expected = _query_keys_reference(raw, 128, hash_seed)
    assert expected is not None and expected[2] == len(ids)
    assert NATIVE.take_query_keys(raw, 128, hash_seed) == expected
    if hash_seed == hashing.BASE_SEED:
        _, keys, _, spread, block_size = expected
        assert keys == hashing.sequence_keys(ids, block_size)
        assert spread == spread_key(ids, block_size)


@needs_native
@pytest.mark.parametrize(
    "block_size",
    [None, 0, -1, 1 << 20, (1 << 20) + 1, 1 << 32, 1.0, "128", True, b"\x80"],
)
def test_take_query_keys_leaves_a_block_size_out_of_range_to_the_decoder(block_size: Any) -> None:
    raw = msgpack.packb({"model": "m", "token_ids": list(range(300)), "block_size": block_size})
    expected = (1 << 20, 0) if block_size == 1 << 20 and type(block_size) is int else None
    got = NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED)
    assert (got if got is None else (got[4], len(got[1]))) == expected
    twice = b"\x83\xaablock_size\x10\xa9token_ids\x92\x01\x02\xaablock_size\x10"  # one block size, twice
    assert NATIVE.take_query_keys(twice, 128, hashing.BASE_SEED) is None


@needs_native
@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb({"model": "m"}),
        msgpack.packb({"model": "m", "token_ids": None}),
        msgpack.packb({"token_ids": "1 2 3"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"model": "m", "token_ids": [1, 2]})[:-2],
        msgpack.packb({"model": "m", "token_ids": [1, 2], "block_size": 2})[:-1],
        b"\x82\xa9token_ids\x91\x01\xa9token_ids\x91\x02",
        b"\x81\xa9token_ids\xdd\x00\x00\x00\x09\x01",  # a count past the body
        b"",
    ],
)
def test_take_query_keys_takes_what_take_token_ids_takes(raw: bytes) -> None:
    assert NATIVE.take_token_ids(raw) == (None, raw)
    assert NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED) is None


@needs_native
@pytest.mark.parametrize("bad", [-1, -129, 1 << 32, 1.5, None, "7", True, [1]])
@pytest.mark.parametrize("where", [0, 127, 128, 6143])
def test_take_query_keys_refuses_bad_ids_as_take_token_ids(bad: Any, where: int) -> None:
    ids: list[Any] = list(range(100_000, 106_144))
    ids[where] = bad
    for block_size in (16, "bad"):  # the id is refused before the block size is looked at
        raw = msgpack.packb({"block_size": block_size, "model": "m", "token_ids": ids})
        with pytest.raises(ValueError, match=rf"token_ids\[{where}\]") as taken:
            NATIVE.take_token_ids(raw)
        with pytest.raises(ValueError, match=rf"token_ids\[{where}\]") as keyed:
            NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED)
        assert str(keyed.value) == str(taken.value)


def _memo_body(rng: random.Random, ids: list[Any], block_size: int | None, forms: str = "short") -> bytes:
    """A /query body of ``ids`` (packed as ``_packed_id`` packs them; anything else as msgpack
    does), its block size before the ids, after them or absent (``None``)."""
    if forms == "short":
        array_bytes = msgpack.packb(ids)
    else:
        items = (_packed_id(rng, v, forms) if type(v) is int and v >= 0 else msgpack.packb(v) for v in ids)
        array_bytes = b"\xdd" + len(ids).to_bytes(4, "big") + b"".join(items)
    entries = [b"\xa5model\xa1m", b"\xa9token_ids" + array_bytes]
    if block_size is not None:
        entries.insert(rng.choice([0, 2]), msgpack.packb("block_size") + msgpack.packb(block_size))
    return bytes([0x80 | len(entries)]) + b"".join(entries)


def _keys_with_and_without(raw: bytes, default_block_size: int, seed: int, memo: Any) -> tuple[Any, Any]:
    """``take_query_keys`` without the memo, then with it (each its value or its ValueError's message)."""

    def run(*memo_arg: Any) -> Any:
        try:
            return NATIVE.take_query_keys(raw, default_block_size, seed, *memo_arg)
        except ValueError as exc:
            return f"ValueError: {exc}"

    return run(), run(memo)


@needs_native
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_take_query_keys_with_a_memo_equals_without(seed: int, wide: bool) -> None:
    """Bodies that share leading ids with the ones before them (a conversation's turns, a
    shared system prompt), cut anywhere - inside a block, on a block's edge, inside an item's
    bytes - under block sizes and seeds that share one memo, the body sent again, shorter,
    longer, ids of every msgpack width, a bad id after the shared part: with the memo, the
    very answer (or refusal) of the call without it, with either id decoder."""
    if wide and not NATIVE.u32_decode_wide(None):
        pytest.skip("this CPU has no AVX-512 VBMI: the two chains decode")
    rng = random.Random(seed)
    memo = NATIVE.QueryKeysMemo(rng.choice([1, 2, 16, 256]))
    top = rng.choice([128, 256, 65_536, 150_000, 1 << 32])
    ids = [rng.randrange(top) for _ in range(rng.randrange(1000, 4000))]
    was_wide = NATIVE.u32_decode_wide(None)
    NATIVE.u32_decode_wide(wide)
    last: tuple[bytes, int, int] | None = None
    try:
        for _ in range(40):
            block_size = rng.choice([16, 100, 128, 128, 128, 256])
            cut = rng.choice([rng.randrange(len(ids) + 1), block_size * rng.randrange(len(ids) // block_size + 1)])
            change = rng.random()
            if change < 0.15:
                pass  # the same ids again
            elif change < 0.3:
                ids = ids[:cut]  # shorter
            elif change < 0.45 and cut < len(ids):  # one id changed in its last byte or its form
                ids = [*ids[:cut], ids[cut] ^ rng.choice([1, 0x100, 0x10000]), *ids[cut + 1 :]]
            else:  # the next turn: the prefix, then new ids
                ids = ids[:cut] + [
                    rng.randrange(rng.choice([128, 256, 65_536, 1 << 32])) for _ in range(rng.randrange(2000))
                ]
            sent: list[Any] = list(ids)
            if sent and rng.random() < 0.1:
                sent[rng.randrange(len(sent))] = rng.choice([-1, 1 << 32, 1.5, None, "7"])
            forms = "any" if rng.random() < 0.15 else "short"
            raw = _memo_body(rng, sent, rng.choice([None, block_size, block_size]), forms)
            hash_seed = rng.choice([hashing.BASE_SEED, hashing.BASE_SEED, 7])
            default_block_size = rng.choice([128, 16])
            if last is not None and rng.random() < 0.2:  # the very body again (a retry), in another bytes object
                raw, default_block_size, hash_seed = bytes(bytearray(last[0])), last[1], last[2]
            last = (raw, default_block_size, hash_seed)
            without, with_memo = _keys_with_and_without(raw, default_block_size, hash_seed, memo)
            if type(with_memo) is _Attached:  # given back only for the very bytes (and call) it was attached to
                call = (default_block_size, hash_seed)
                assert (with_memo.raw, with_memo.call, with_memo.answer) == (raw, call, without)
            else:
                assert with_memo == without
                if type(with_memo) is tuple and rng.random() < 0.5:  # the handler's prompt, here what it was made of
                    memo.attach(raw, _Attached(bytes(raw), (default_block_size, hash_seed), with_memo))
            assert len(memo) <= memo.max_entries and memo.bytes <= memo.max_bytes
    finally:
        NATIVE.u32_decode_wide(was_wide)
    # the cases above reused remembered blocks or answered a body sent again with what was
    # attached to it, not only decoded afresh
    assert memo.hits + memo.exact_hits > 0


class _Attached:
    """What a test attaches to a body in a ``QueryKeysMemo``: the bytes, the call and the answer it was for."""

    def __init__(self, raw: bytes, call: tuple[int, int], answer: Any) -> None:
        self.raw, self.call, self.answer = raw, call, answer


@needs_native
def test_take_query_keys_memo_gives_the_attached_object_for_the_same_bytes_only() -> None:
    """``attach`` keeps an object with the body remembered last (that very object, else
    False); the same bytes again (another bytes object) give it back, nothing decoded;
    a byte changed before the ids, in them or after them gives the tuple; another body
    taking the slot drops it, and ``clear`` releases it."""
    rng = random.Random(5)
    memo = NATIVE.QueryKeysMemo()
    ids = [rng.randrange(150_000) for _ in range(20 * 128 + 7)]
    tail = msgpack.packb("block_size") + msgpack.packb(128)  # stated after the ids
    raw = b"\x83\xa5model\xa1m\xa9token_ids" + msgpack.packb(ids) + tail
    first = NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED, memo)
    prompt = _Attached(raw, (128, hashing.BASE_SEED), first)
    assert memo.attach(bytes(bytearray(raw)), prompt) is False  # equal bytes, not the body remembered
    assert memo.attach(raw, prompt) is True and memo.exact_hits == 0
    assert NATIVE.take_query_keys(bytes(bytearray(raw)), 128, hashing.BASE_SEED, memo) is prompt
    assert memo.exact_hits == 1 and memo.hits == 0
    head = b"\x83\xa5model\xa1m\xa9token_ids"
    in_block = [*ids[:600], ids[600] ^ 1, *ids[601:]]
    in_last_block = [*ids[:-10], ids[-10] ^ 1, *ids[-9:]]
    changed = (
        raw.replace(b"\xa1m", b"\xa1n", 1),  # the model
        head + msgpack.packb(in_block) + tail,  # an id
        head + msgpack.packb(in_last_block) + tail,  # an id of the last full block (always decoded)
        head + msgpack.packb(ids) + msgpack.packb("block_size") + msgpack.packb(64),
    )
    for other in changed:
        answer = NATIVE.take_query_keys(other, 128, hashing.BASE_SEED, memo)
        assert answer == _query_keys_reference(other, 128, hashing.BASE_SEED)
        assert memo.attach(raw, prompt) is False  # not the body remembered last any more: nothing kept
    assert memo.exact_hits == 1
    # the last changed body took the probe's slot: the first body decodes again, its answer unchanged
    assert NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED, memo) == first
    short = _memo_body(rng, ids[:300], 128)  # under the memo's 2 KiB of ids: not remembered
    NATIVE.take_query_keys(short, 128, hashing.BASE_SEED, memo)
    assert memo.attach(short, prompt) is False
    gone = weakref.ref(kept := _Attached(raw, (0, 0), None))
    assert memo.attach(raw, kept) is True
    del kept
    assert gone() is not None  # the memo holds it
    memo.clear()
    assert gone() is None
    with pytest.raises(TypeError):
        memo.attach(raw)


@needs_native
def test_take_query_keys_memo_reuses_the_shared_blocks() -> None:
    """A next turn reuses every full block the turn before it holds, but its own last one (the
    spread key's); a body under another seed, or stating another block size, reuses nothing;
    one stating the block size after its ids, unlike the remembered body's, decodes them all."""
    rng = random.Random(1)
    memo = NATIVE.QueryKeysMemo()
    first = [rng.randrange(150_000) for _ in range(10 * 128 + 5)]
    second = first + [rng.randrange(150_000) for _ in range(3 * 128)]
    for ids, reused in ((first, 0), (second, 10), (second, 12), (first, 9)):
        raw = _memo_body(rng, ids, 128)
        before = memo.reused_blocks
        assert NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED, memo) == _query_keys_reference(
            raw, 128, hashing.BASE_SEED
        )
        assert memo.reused_blocks - before == reused
    assert (len(memo), memo.hits) == (1, 3)
    for raw, seed in ((_memo_body(rng, second, 128), 7), (_memo_body(rng, second, 64), hashing.BASE_SEED)):
        before = memo.reused_blocks
        assert NATIVE.take_query_keys(raw, 128, seed, memo) == _query_keys_reference(raw, 128, seed)
        assert memo.reused_blocks == before
    no_size = _memo_body(rng, second, None)
    after = no_size[:1].replace(b"\x82", b"\x83") + no_size[1:] + b"\xaablock_size\x40"  # 64, after the ids
    # the probe takes the block size known before the ids (else the default): 64 meets the body remembered at 64
    # just above, 128 `first`; one stated after the ids is reused when it turns out the remembered body's
    for raw, default_block_size, reused in ((no_size, 64, 25), (no_size, 128, 10), (after, 128, 0), (after, 128, 25)):
        before = memo.reused_blocks
        got = NATIVE.take_query_keys(raw, default_block_size, hashing.BASE_SEED, memo)
        assert got == _query_keys_reference(raw, default_block_size, hashing.BASE_SEED)
        assert memo.reused_blocks - before == reused


@needs_native
def test_take_query_keys_memo_stays_within_its_bounds() -> None:
    """At most ``max_entries`` bodies and ``max_bytes`` (the bodies plus 64 bytes a block),
    oldest out first; a body over an eighth of the byte bound, a short one, one with an id
    in a longer form than needed, are not remembered; ``clear`` forgets all."""
    rng = random.Random(2)
    bodies = [_memo_body(rng, [rng.randrange(65_536, 150_000) for _ in range(2048)], 128) for _ in range(40)]
    size = len(bodies[0]) + 16 * 64  # every id 5 bytes: every body this long
    for max_entries, max_bytes, kept in ((16, 10 * size, 10), (4, 100 * size, 4)):
        memo = NATIVE.QueryKeysMemo(max_entries, max_bytes)
        for raw in bodies:
            NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED, memo)
            assert len(memo) <= kept and memo.bytes == len(memo) * size
        assert len(memo) >= kept // 2  # two slots a probe: a few may share theirs
        reused = memo.reused_blocks
        NATIVE.take_query_keys(bodies[-1], 128, hashing.BASE_SEED, memo)  # the newest is kept
        assert memo.reused_blocks == reused + 15
        memo.clear()
        assert (len(memo), memo.bytes) == (0, 0)
    small = NATIVE.QueryKeysMemo(8, 8 * size - 1)
    NATIVE.take_query_keys(bodies[0], 128, hashing.BASE_SEED, small)
    assert len(small) == 0
    short = _memo_body(rng, list(range(100_000, 100_300)), 16)  # 18 blocks, but 1,500 bytes of ids
    longer_forms = _memo_body(rng, [rng.randrange(150_000) for _ in range(2048)], 128, "any")
    for raw in (short, longer_forms):
        NATIVE.take_query_keys(raw, 128, hashing.BASE_SEED, memo)
    assert len(memo) == 0
    with pytest.raises(TypeError, match="QueryKeysMemo"):
        NATIVE.take_query_keys(bodies[0], 128, hashing.BASE_SEED, {})
    with pytest.raises(ValueError):
        NATIVE.QueryKeysMemo(0)


def _decoded_both_ways(decode: Any, module: Any = None) -> tuple[Any, Any]:
    """``decode()`` (its value, or its ValueError's message) with ``module``'s wide id decode
    on, then off (each extension has its own switch: the router's by default)."""
    module = module or NATIVE

    def run() -> Any:
        try:
            return decode()
        except ValueError as exc:
            return f"ValueError: {exc}"

    assert module.u32_decode_wide(True)
    wide = run()
    try:
        assert not module.u32_decode_wide(False)
        chains = run()
    finally:
        module.u32_decode_wide(True)
    return wide, chains


@needs_native
@pytest.mark.parametrize("seed", range(250))
def test_wide_id_decode_equals_the_two_chains(seed: int) -> None:
    """The AVX-512 VBMI id decode (64-byte windows, docs/native.md) against the two chains:
    lengths around the window sizes, every mix of forms, other integer forms and bad items
    anywhere (window edges included), bytes after the array that read as ids, a short tail."""
    if not NATIVE.u32_decode_wide(None):
        pytest.skip("this CPU has no AVX-512 VBMI: the two chains decode")
    rng = random.Random(seed)
    count = rng.choice([0, 1, 20, 25, 26, 40, 63, 64, 65, 100, 127, 128, 129, 300, 1023, 1024, 4000, 6144])
    top = rng.choice([128, 256, 65_536, 150_000, 1 << 32])
    forms = "short" if seed % 3 else "any"
    items = [_packed_id(rng, rng.randrange(top), forms) for _ in range(count)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        if count:
            odd = rng.choice([-1, -200, 1 << 32, 1 << 40, 1.5, None, "x", [1], True, 7, 200, 70_000, 1 << 31])
            form = rng.choice(["short", "any"]) if type(odd) is int and 0 <= odd < 1 << 32 else "short"
            items[rng.randrange(count)] = (
                _packed_id(rng, odd, form) if type(odd) is int and odd >= 0 else msgpack.packb(odd)
            )
    array_bytes = b"\xdd" + count.to_bytes(4, "big") + b"".join(items)
    after = rng.choice([b"", msgpack.packb("pad") + msgpack.packb([5] * rng.randrange(200)), b"\xa3end\x07"])
    body = bytes([0x82 + (after != b"")]) + b"\xa5model\xa1m\xa9token_ids" + array_bytes + after
    wide, chains = _decoded_both_ways(lambda: NATIVE.take_token_ids(body))
    assert wide == chains
    wide, chains = _decoded_both_ways(lambda: ENGINE.u32_from_msgpack(array_bytes), ENGINE)
    assert wide == chains
    default_block_size = rng.choice([1, 16, 128])
    wide, chains = _decoded_both_ways(lambda: NATIVE.take_query_keys(body, default_block_size, 7))
    assert wide == chains
