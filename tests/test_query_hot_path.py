"""The ``/query`` hot path: the index's one-pass fold, the hashed-prompt cache, msgpack answers.

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

from motor_adapter.scoring import KvAffinityConfig, best_rank
from motor_adapter.service import _Prompt, _PromptCache
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.index import PrefixIndex, TierHit
from tests.conftest import free_tcp_endpoint
from tests.test_service import (  # noqa: F401  (pytest fixtures shared with test_service)
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
    zctx,
)

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
    native, hashing.NATIVE = hashing.NATIVE, None
    try:
        in_python = index.deepest_npu(keys, instances)
    finally:
        hashing.NATIVE = native
    assert in_c == in_python
    assert in_c is not None
    assert {k: (r, h.npu_blocks) for k, (r, h) in in_c.items()} == {
        k: (r, h.npu_blocks) for k, (r, h) in _fold(index, keys, instances).items()
    }


@pytest.mark.unit
def test_wide_walk_refuses_a_word_count_out_of_range() -> None:
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("the C helpers are not built here")
    with pytest.raises(ValueError, match="words must be in"):
        hashing.NATIVE.wide_walk([1], {}, 1, 17)
    assert hashing.NATIVE.wide_walk([5, 6], {5: (1 << 130) | 1, 6: ~130}, (1 << 130) | 1, 3) == (
        [(1, 1), (2, 1 << 130)],
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


@pytest.mark.unit
def test_prompt_cache_confirms_the_body_and_stays_bounded() -> None:
    cache = _PromptCache(max_entries=3, max_bytes=1 << 20)
    bodies = [bytes([i]) * 100 for i in range(5)]
    for i, body in enumerate(bodies):
        for _ in range(2):  # kept from the second sight on
            cache.put(cache.key(body, True), body, _Prompt(MODEL, "default", BS, [i], 1))
    assert cache.get(cache.key(bodies[0], True), bodies[0]) is None  # evicted, oldest first
    hit = cache.get(cache.key(bodies[4], True), bodies[4])
    assert hit is not None and hit.keys == [4]
    assert cache.get(cache.key(bodies[4], False), bodies[4]) is None  # JSON and msgpack never mix
    assert cache.get(cache.key(bodies[4], True), bodies[3]) is None  # a digest whose body differs: a miss
    big = b"x" * (1 << 18)  # over an eighth of max_bytes: not kept
    for _ in range(2):
        cache.put(cache.key(big, True), big, _Prompt(MODEL, "default", BS, [9], 1))
    assert cache.get(cache.key(big, True), big) is None
    assert cache.get(cache.key(bodies[3], True), bodies[3]) is not None


@pytest.mark.unit
def test_prompt_cache_keeps_a_body_from_its_second_sight_within_a_bounded_doorkeeper() -> None:
    cache = _PromptCache(max_entries=8, max_bytes=1 << 20, max_seen=2)
    bodies = [bytes([i]) * 100 for i in range(4)]
    keys = [cache.key(body, True) for body in bodies]
    cache.put(keys[0], bodies[0], _Prompt(MODEL, "default", BS, [0], 1))
    assert cache.get(keys[0], bodies[0]) is None  # seen once: only its digest is remembered
    cache.put(keys[0], bodies[0], _Prompt(MODEL, "default", BS, [0], 1))
    assert cache.get(keys[0], bodies[0]) is not None  # seen twice: kept
    for i in (1, 2, 3):  # three first sights through a doorkeeper of two: body 1's digest is pushed out
        cache.put(keys[i], bodies[i], _Prompt(MODEL, "default", BS, [i], 1))
    cache.put(keys[1], bodies[1], _Prompt(MODEL, "default", BS, [1], 1))
    assert cache.get(keys[1], bodies[1]) is None  # a first sight again
    cache.put(keys[3], bodies[3], _Prompt(MODEL, "default", BS, [3], 1))
    assert cache.get(keys[3], bodies[3]) is not None
    assert len(cache._seen) <= 2


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


@pytest.mark.parametrize("native", [True, False], ids=["c-helpers", "python"])
def test_msgpack_ids_are_checked_and_hashed_alike_with_or_without_the_c_helpers(
    native: bool, monkeypatch: pytest.MonkeyPatch, zctx: Any, make_server: Any
) -> None:
    """A msgpack body's ids go to u32 in C (``take_token_ids``) when the helpers are built:
    the answers and the refusals must be the ones of the Python path, and of JSON."""
    from sglang_kvpub.core import hashing

    if native and hashing.NATIVE is None:
        pytest.skip("the C helpers are not built")
    if not native:
        monkeypatch.setattr(hashing, "NATIVE", None)
    server = make_server()  # after the switch: the handlers read hashing.NATIVE when built
    pub = Publisher(zctx, free_tcp_endpoint())
    assert MotorClient(server.url).register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
    connect(server, pub)
    tokens = prompt(12, 5)
    pub.store(tokens[: 3 * BS], rank=2)
    url = server.url + "/query"
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
    ]
    bad_block_size = [
        _raw_map(*base, ("block_size", value), ("token_ids", tokens)) for value in (0, -1, "128", True, 1.0, 1 << 21)
    ]
    bad_ids = [_raw_map(*base, ("token_ids", [*tokens[:200], bad])) for bad in (-1, 1 << 32, 1.5, None, "7")]
    bad_ids.append(_raw_map(*base, ("block_size", "x"), ("token_ids", [1, -1])))
    headers = {"Content-Type": "application/msgpack"}
    answers: dict[bool, list[tuple[int, Any]]] = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(hashing, "NATIVE", None)
        server = make_server()  # after the switch: the handlers read hashing.NATIVE when built
        pub = Publisher(zctx, free_tcp_endpoint())
        assert MotorClient(server.url).register_hbm_dp("vllm-prefill-0", pub.endpoint, fanned_in=True)[0] == 200
        connect(server, pub)
        pub.store(tokens[: 3 * BS], rank=2)
        url = server.url + "/query"
        wait_for(functools.partial(_matched_all, url, good[0], 3 * BS), "the store is indexed")
        answers[native] = [http(url, raw=raw, headers=headers) for raw in good + bad_block_size + bad_ids for _ in "12"]
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
