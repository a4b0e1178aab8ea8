"""The one block-key implementation (``sglang_kvpub.core.hashing``) against a plain reference:
XXH3-64 over ``array("I", [t & 0xFFFFFFFF ...])`` bytes, chained - for every input shape
callers pass (lists, SGLang's ``array("q")``, u32 arrays from the HTTP path, numpy) - and
against Dynamo's ``compute_block_hash_for_seq`` when it is installed."""

from __future__ import annotations

import contextlib
import struct
import sys
from array import array
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvpub.core import hashing
from sglang_kvpub.core.hashing import (
    BASE_SEED,
    chain_hashes,
    chain_next,
    local_block_hash,
    local_block_hashes,
    lora_seed,
    sequence_keys,
    tokens_u32,
)

pytestmark = pytest.mark.unit

_U32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- reference


def ref_bytes(tokens: list[int]) -> bytes:
    packed = array("I", [t & _U32 for t in tokens])
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def ref_locals(tokens: list[int], block_size: int, seed: int) -> list[int]:
    full = len(tokens) // block_size
    blocks = [tokens[i * block_size : (i + 1) * block_size] for i in range(full)]
    return [xxhash.xxh3_64_intdigest(ref_bytes(b), seed) for b in blocks]


def ref_keys(tokens: list[int], block_size: int, lora_name: str | None = None) -> list[int]:
    seed = BASE_SEED
    if lora_name:
        seed = (BASE_SEED + xxhash.xxh3_64_intdigest(lora_name.encode())) & ((1 << 64) - 1)
    keys, key = [], seed
    for local in ref_locals(tokens, block_size, seed):
        key = xxhash.xxh3_64_intdigest(struct.pack("<Q", local), key)
        keys.append(key)
    return keys


def shapes(tokens: list[int]) -> dict[str, Any]:
    """``tokens`` in every container a caller passes (only those that can hold the ids)."""
    out: dict[str, Any] = {"list": list(tokens), "tuple": tuple(tokens)}
    for code in "qlQLiIhHbB":
        with contextlib.suppress(OverflowError):  # the typecode cannot hold some id
            out[code] = array(code, tokens)
    return out


TOKENS = st.lists(
    st.integers(0, 200_000) | st.integers(-(1 << 63), (1 << 64) - 1) | st.integers(-(1 << 31), _U32), max_size=70
)


# --------------------------------------------------------------------------- bytes


@settings(max_examples=300, deadline=None)
@given(TOKENS)
def test_tokens_u32_casts_every_shape_like_the_reference(tokens: list[int]) -> None:
    for name, data in shapes(tokens).items():
        assert bytes(tokens_u32(data)) == ref_bytes(tokens), name
        assert bytes(tokens_u32(data, 3)) == ref_bytes(tokens[:3]), name


def test_wide_and_negative_ids_are_cast_like_the_conductor() -> None:
    tokens = [-1, 2**32 + 5, 7, 2**40 + 3, -(2**63), 2**64 - 1]
    want = struct.pack("<6I", _U32, 5, 7, 3, 0, _U32)
    assert tokens_u32(tokens) == want
    assert tokens_u32(array("q", tokens[:5])) == want[:20]
    assert tokens_u32(array("Q", [t & ((1 << 64) - 1) for t in tokens])) == want


def test_the_strided_copy_without_numpy_equals_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [-3, 2**33 + 9, 151_000, 0, 2**31]
    with_numpy = tokens_u32(array("q", tokens))
    monkeypatch.setattr(hashing, "_NUMPY", [None])  # as without numpy
    assert tokens_u32(array("q", tokens)) == with_numpy == ref_bytes(tokens)


def test_numpy_arrays_and_non_contiguous_buffers() -> None:
    numpy = pytest.importorskip("numpy")
    tokens = [5, -1, 2**35 + 1, 9, 11, 13]
    assert tokens_u32(numpy.array(tokens, dtype=numpy.int64)) == ref_bytes(tokens)
    assert tokens_u32(numpy.array(tokens, dtype=numpy.int64)[::2]) == ref_bytes(tokens[::2])
    assert tokens_u32(numpy.array(tokens[:1] + tokens[3:], dtype=">i8")) == ref_bytes(tokens[:1] + tokens[3:])
    assert tokens_u32(memoryview(array("q", tokens))[1::2]) == ref_bytes(tokens[1::2])


def test_non_integer_ids_are_rejected() -> None:
    floats: Any = [1, 2.5]
    with pytest.raises(TypeError):
        tokens_u32(floats)
    with pytest.raises(TypeError):
        tokens_u32(array("d", floats))


def test_packer_cache_stays_bounded() -> None:
    for n in range(hashing._PACKERS_MAX + 50):
        tokens_u32(list(range(n)))
    assert len(hashing._PACKERS) <= hashing._PACKERS_MAX


# --------------------------------------------------------------------------- hashes


@settings(max_examples=200, deadline=None)
@given(TOKENS, st.integers(1, 9), st.sampled_from([None, "adapter-a"]))
def test_hashes_equal_the_reference_for_every_shape(tokens: list[int], bs: int, lora: str | None) -> None:
    seed = lora_seed(lora)
    want_keys = ref_keys(tokens, bs, lora)
    for name, data in shapes(tokens).items():
        assert local_block_hashes(data, bs, seed) == ref_locals(tokens, bs, seed), name
        assert sequence_keys(data, bs, lora) == want_keys, name
        assert sequence_keys(data, bs, lora, max_blocks=2) == want_keys[:2], name
        assert chain_hashes(local_block_hashes(data, bs, seed), seed) == want_keys, name


def test_partial_block_is_ignored_and_edge_cases() -> None:
    tokens = list(range(1, 11))
    assert len(sequence_keys(tokens, 4)) == 2
    assert sequence_keys(tokens, 4) == sequence_keys(tokens[:8], 4)
    assert sequence_keys(tokens, 11) == [] == local_block_hashes([], 4)
    assert sequence_keys(tokens, 4, max_blocks=0) == []
    assert local_block_hash(tokens[:4]) == local_block_hashes(tokens, 4)[0]
    assert chain_next(BASE_SEED, local_block_hash(tokens[:4])) == sequence_keys(tokens, 4)[0]
    with pytest.raises(ValueError):
        local_block_hashes(tokens, 0)


def test_lora_and_position_change_the_keys() -> None:
    block = list(range(4))
    assert lora_seed(None) == lora_seed("") == BASE_SEED
    assert sequence_keys(block, 4, "a") != sequence_keys(block, 4) != sequence_keys(block, 4, "b")
    keys = sequence_keys(block * 2, 4)
    assert keys[0] != keys[1]  # equal content, different depth


@pytest.mark.parametrize("lora", [None, "adapter-a"])
def test_equal_to_dynamo_compute_block_hash_for_seq(lora: str | None) -> None:
    core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (dynamo._core) is not installed")
    tokens = [(i * 7919) % 150_000 for i in range(3 * 16 + 5)]
    want = core.compute_block_hash_for_seq(tokens, 16, lora_name=lora)
    assert local_block_hashes(tokens, 16, lora_seed(lora)) == want
    assert local_block_hashes(array("q", tokens), 16, lora_seed(lora)) == want
