"""Block keys shared by the router index, the in-instance dispatcher and the HTTP service.

The local hash of a block is XXH3-64 with seed 1337 over the block's token ids as
little-endian u32 - the hash Motor's kv-conductor and NVIDIA Dynamo compute, so our
keys can be checked against theirs.  Ids outside u32 are cast ``& 0xFFFFFFFF`` as the
conductor casts them.  A LoRA adapter shifts the seed by the XXH3-64 of its name.
Position comes from chaining: ``chain_i = XXH3-64(local_i as 8 LE bytes, seed=chain_{i-1})``
with ``chain_{-1} = seed``, so equal blocks at different depths, or under different
prefixes, get different keys.  Only full blocks are hashed; a trailing partial block is
ignored.

This module is the ONE implementation (every caller hashes through it); it is on every
query and every stored event, hence the fast paths in :func:`tokens_u32` and the optional
C helpers (``sglang_kvpub.core._native``, docs/native.md): when built, the chained keys
are computed in one C call with the same XXH3 code (the xxhash package's own), else by the
Python loops below, which stay the reference.  ``KVPUB_NATIVE=0`` turns the helpers off.
"""

from __future__ import annotations

import importlib
import logging
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

from sglang_kvpub.core.native_loader import load_extension
from sglang_kvpub.wire import MsgpackIds

__all__ = [
    "BASE_SEED",
    "NATIVE",
    "chain_hashes",
    "chain_next",
    "chained_block_keys",
    "local_block_hash",
    "local_block_hashes",
    "lora_seed",
    "sequence_keys",
    "token_ids_from_msgpack",
    "tokens_u32",
]

BASE_SEED = 1337
_U64 = (1 << 64) - 1
_U32 = 0xFFFFFFFF
_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64 = struct.Struct("<Q").pack
_LITTLE = sys.byteorder == "little"
_INT_FORMATS = frozenset("bBhHiIlLqQnN")  # native-order integer buffer formats (array, numpy)
_PACKERS: dict[int, struct.Struct] = {}  # token count -> "<{n}I" packer (format parsing is costly)
_PACKERS_MAX = 512
_NUMPY: list[Any] = []  # [numpy module or None], once looked up
_NATIVE_NAMES = (
    "chain_keys",
    "npu_walk",
    "npu_walk_ranks",
    "dispatch_score",
    "KeyMasks",
    "wide_walk",
    "emit_hits",
    "emit_ranks",
    "u32_from_ints",
    "u32_from_msgpack",
    "u32_count_msgpack",
)
log = logging.getLogger(__name__)


def _chained_py(
    raw: bytes | memoryview, block_size: int, seed: int, parent_key: int, start: int, end: int
) -> list[int]:
    step = block_size * 4
    keys: list[int] = []
    append = keys.append
    key = parent_key
    for i in range(start * step, end * step, step):
        key = _xxh3(_pack_u64(_xxh3(raw[i : i + step], seed)), key)
        append(key)
    return keys


def lora_seed(lora_name: str | None) -> int:
    """The hashing seed for a LoRA adapter (``BASE_SEED`` without one)."""
    if not lora_name:
        return BASE_SEED
    return (BASE_SEED + _xxh3(lora_name.encode("utf-8"))) & _U64


# --------------------------------------------------------------------------- u32 bytes


def _packer(count: int) -> struct.Struct:
    packer = _PACKERS.get(count)
    if packer is None:
        if len(_PACKERS) >= _PACKERS_MAX:
            _PACKERS.clear()  # prompt lengths vary: bound the cache, rebuilding is cheap
        packer = _PACKERS[count] = struct.Struct(f"<{count}I")
    return packer


def _pack(tokens: Sequence[int]) -> bytes:
    if NATIVE is not None and type(tokens) in (list, tuple):
        return NATIVE.u32_from_ints(tokens)  # one pass, no argument tuple
    # One C call per prompt, faster than array("I", list); "<" makes it endian-proof.
    packer = _packer(len(tokens))
    try:
        return packer.pack(*tokens)
    except struct.error:  # negative or > u32 ids: cast like the conductor
        return packer.pack(*[t & _U32 for t in tokens])


def _numpy() -> Any:
    """numpy when importable (always loaded inside SGLang), else None; looked up once, lazily:
    only 8-byte id buffers (SGLang's ``array("q")``) need it, and they work without."""
    if not _NUMPY:
        try:
            _NUMPY.append(importlib.import_module("numpy"))
        except ImportError:
            _NUMPY.append(None)
    return _NUMPY[0]


def _low_words(view: memoryview) -> bytes:
    """The low 4 bytes of each little-endian 8-byte item: exactly ``id & 0xFFFFFFFF``."""
    numpy = _numpy()
    if numpy is not None:  # ~7x faster than the strided copies below
        return bytes(numpy.frombuffer(view, dtype="<u4")[::2].tobytes())
    raw = view.tobytes()  # bytes: strided copies out of a memoryview go item by item
    out = bytearray(len(raw) // 2)
    for byte in range(4):
        out[byte::4] = raw[byte::8]
    return bytes(out)


def _buffer_u32(tokens: Any) -> bytes | memoryview | None:
    """u32 bytes of a 1-D integer buffer (SGLang's ``array("q")``, ``array("I")``, numpy)
    without a Python loop per token; None when ``tokens`` is no such buffer."""
    try:
        view = memoryview(tokens)
    except TypeError:
        return None
    if view.ndim != 1 or not view.c_contiguous or view.format not in _INT_FORMATS or not _LITTLE:
        return None
    if view.itemsize == 4:
        return view.cast("B")  # zero-copy: signed and unsigned share their bytes for every id
    if view.itemsize == 8:
        return _low_words(view)
    return _pack(view.tolist())  # 1- and 2-byte ids: rare, the generic cast


def tokens_u32(tokens: Sequence[int], limit: int | None = None) -> bytes | memoryview:
    """The first ``limit`` (all by default) token ids as little-endian u32 bytes, ids cast
    ``& 0xFFFFFFFF``.  Takes Python lists and tuples, ``array`` of any integer typecode and
    other integer buffers (numpy); numpy is used when importable, never required.

    4-byte buffers come back as a view of the caller's buffer (no copy; an ``array`` cannot
    be resized while the view lives): ``bytes()`` it to keep it.
    """
    if type(tokens) is MsgpackIds and NATIVE is not None:  # the adapter's decoded ids: read in C
        packed = NATIVE.u32_from_msgpack(tokens.raw)
        return packed if limit is None or limit >= len(tokens) else memoryview(packed)[: max(limit, 0) * 4]
    if limit is not None and limit < len(tokens):
        tokens = tokens[:limit]
    if type(tokens) is not list:
        packed = _buffer_u32(tokens)
        if packed is not None:
            return packed
    return _pack(tokens)


def token_ids_from_msgpack(raw: Any) -> MsgpackIds | None:
    """A stored event's msgpack ``token_ids`` array (a ``msgspec.Raw`` view of the payload)
    as a :class:`~sglang_kvpub.wire.MsgpackIds`: every id checked in one C pass
    (``u32_count_msgpack``), none made into an int object.  The adapter's stream decoder
    keeps stored events' ids so (``wire.BatchDecoder(token_ids=...)``): ~5k ids a batch
    would otherwise be short-lived ints that pymalloc places among the index's long-lived
    ones (bench/memory.py).  None without the C helpers or when an id is not in [0, 2^32)
    (the decoder then makes a list)."""
    if NATIVE is None:
        return None
    try:
        return MsgpackIds(raw, NATIVE.u32_count_msgpack(raw))
    except ValueError:
        return None


# --------------------------------------------------------------------------- hashes


def local_block_hash(tokens: Sequence[int], seed: int = BASE_SEED) -> int:
    """Local hash of one block (all of ``tokens``)."""
    return _xxh3(tokens_u32(tokens), seed)


def _full_bytes(tokens: Sequence[int], block_size: int, max_blocks: int | None) -> tuple[bytes | memoryview, int]:
    """u32 bytes covering at least the full blocks to hash, and the byte length they span."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    blocks = len(tokens) // block_size
    if max_blocks is None:  # lists pack fastest whole (no slice copy): the tail is packed, not hashed
        return tokens_u32(tokens), blocks * block_size * 4
    blocks = max(min(blocks, max_blocks), 0)
    return tokens_u32(tokens, blocks * block_size), blocks * block_size * 4


def local_block_hashes(
    tokens: Sequence[int], block_size: int, seed: int = BASE_SEED, max_blocks: int | None = None
) -> list[int]:
    """Local hashes of every FULL block of ``tokens`` (at most ``max_blocks``); a trailing
    partial block is ignored.  Equal to Dynamo's ``compute_block_hash_for_seq``."""
    raw, end = _full_bytes(tokens, block_size, max_blocks)
    step = block_size * 4
    return [_xxh3(raw[i : i + step], seed) for i in range(0, end, step)]


def chain_next(parent_key: int, local_hash: int) -> int:
    return _xxh3(_pack_u64(local_hash), parent_key)


def chain_hashes(local_hashes: Sequence[int], parent_key: int = BASE_SEED) -> list[int]:
    """Position-aware keys for consecutive blocks hanging under ``parent_key``."""
    keys: list[int] = []
    append = keys.append
    key = parent_key
    for local in local_hashes:
        key = _xxh3(_pack_u64(local), key)
        append(key)
    return keys


def sequence_keys(
    tokens: Sequence[int], block_size: int, lora_name: str | None = None, max_blocks: int | None = None
) -> list[int]:
    """Chained keys for every full block of a prompt (at most the first ``max_blocks``):
    what the index is queried with.  ``chain_hashes(local_block_hashes(..))`` fused into
    one loop (or one C call): this is on every query."""
    seed = lora_seed(lora_name) if lora_name else BASE_SEED
    if NATIVE is not None and isinstance(tokens, (array, memoryview)) and tokens.itemsize >= 4 and block_size > 0:
        # SGLang's array("q") as it is (the C loop casts 8-byte ids a block at a time), u32 views
        blocks = len(tokens) // block_size
        if max_blocks is not None:
            blocks = max(min(blocks, max_blocks), 0)
        try:
            return NATIVE.chain_keys(tokens, block_size, seed, seed, 0, blocks)
        except (TypeError, BufferError):
            pass  # not an integer buffer it reads (floats, strided views): the generic path
    raw, end = _full_bytes(tokens, block_size, max_blocks)
    return chained_block_keys(raw, block_size, seed, seed, 0, end // (block_size * 4))


def chained_block_keys(
    raw: bytes | memoryview | array[int], block_size: int, seed: int, parent_key: int, start: int, end: int
) -> list[int]:
    """Chained keys of blocks ``start..end-1`` of u32 bytes ``raw`` (:func:`tokens_u32`; an
    integer ``array`` is taken as its ids), block ``start`` hanging under ``parent_key``: one
    slice of :func:`sequence_keys`, for callers that hash a prompt a chunk at a time (pass a
    memoryview: slices are not copied)."""
    if NATIVE is not None:
        return NATIVE.chain_keys(raw, block_size, seed, parent_key, start, end)
    u32 = tokens_u32(raw, end * block_size) if isinstance(raw, array) else raw
    return _chained_py(u32, block_size, seed, parent_key, start, end)


NATIVE: Any = load_extension(
    "sglang_kvpub.core._native", _NATIVE_NAMES, reference=_chained_py, seed=BASE_SEED, what="native hashing helpers"
)
