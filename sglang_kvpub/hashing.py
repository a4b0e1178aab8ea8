"""Block keys shared by the router index and the in-instance dispatcher.

The local hash of a block is XXH3-64 with seed 1337 over the block's token ids as
little-endian u32 - the hash Motor's kv-conductor and NVIDIA Dynamo compute, so our
keys can be checked against theirs.  A LoRA adapter shifts the seed by the XXH3-64 of its
name.  Position comes from chaining: ``chain_i = XXH3-64(local_i as 8 LE bytes,
seed=chain_{i-1})`` with ``chain_{-1} = seed``, so equal blocks at different depths, or
under different prefixes, get different keys.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = [
    "BASE_SEED",
    "chain_hashes",
    "chain_next",
    "local_block_hash",
    "local_block_hashes",
    "lora_seed",
    "sequence_keys",
]

BASE_SEED = 1337
_U64 = (1 << 64) - 1
_U32 = 0xFFFFFFFF
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


def lora_seed(lora_name: str | None) -> int:
    """The hashing seed for a LoRA adapter (``BASE_SEED`` without one)."""
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + _xxh3(lora_name.encode("utf-8"))) & _U64


def _u32_bytes(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except OverflowError:  # negative or > u32 ids are cast the way the conductor casts them
        packed = array("I", [t & _U32 for t in tokens])
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def local_block_hash(tokens: Sequence[int], seed: int = BASE_SEED) -> int:
    return _xxh3(_u32_bytes(tokens), seed)


def local_block_hashes(tokens: Sequence[int], block_size: int, seed: int = BASE_SEED) -> list[int]:
    """Local hashes of every FULL block of ``tokens``; a trailing partial block is ignored."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = _u32_bytes(tokens)
    step = block_size * 4
    full = len(raw) - len(raw) % step
    return [_xxh3(raw[i : i + step], seed) for i in range(0, full, step)]


def chain_next(parent_key: int, local_hash: int) -> int:
    return _xxh3(local_hash.to_bytes(8, "little"), parent_key)


def chain_hashes(local_hashes: Sequence[int], parent_key: int = BASE_SEED) -> list[int]:
    """Position-aware keys for consecutive blocks hanging under ``parent_key``."""
    keys: list[int] = []
    key = parent_key
    for local in local_hashes:
        key = _xxh3(local.to_bytes(8, "little"), key)
        keys.append(key)
    return keys


def sequence_keys(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Chained keys for every full block of a prompt: what the index is queried with."""
    seed = lora_seed(lora_name)
    return chain_hashes(local_block_hashes(tokens, block_size, seed), seed)
