"""Block hashes on the wire: the two 64-bit forms, and every form an engine writes read as one int.

Engines write hashes as u64 or i64 ints (vLLM: sha256 bytes); the instance stream writes
them in one declared form (``HashForm``).  Shared by the decoder and the encoder.
"""

from __future__ import annotations

from typing import Any, Union

from sglang_kvpub.wire.contract import _I64_MAX, _I64_MIN, U64_MASK, HashForm, WireError

__all__ = ["to_u64", "to_i64", "hash_from_wire"]


def to_u64(value: int) -> int:
    return value & U64_MASK


def to_i64(value: int) -> int:
    value &= U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def hash_from_wire(value: Any) -> int:
    """One engine block hash as an int; bytes hashes (vLLM sha256) keep their last 8 bytes."""
    if isinstance(value, bool):
        raise WireError("bad hash", "bool")
    if isinstance(value, int):
        if value < _I64_MIN or value > U64_MASK:
            raise WireError("bad hash", "outside the 64-bit range")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise WireError("bad hash", "empty bytes")
        return int.from_bytes(raw[-8:], "big")
    if isinstance(value, str):
        try:
            parsed = int(value, 16) if value.lower().startswith("0x") else int(value)
        except ValueError as exc:
            raise WireError("bad hash", "unparsable string") from exc
        return hash_from_wire(parsed)
    raise WireError("bad hash", type(value).__name__)


def hash_list(values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise WireError("bad block_hashes", type(values).__name__)
    return [hash_from_wire(v) for v in values]


def optional_hash(value: Any) -> Union[int, None]:
    return None if value is None else hash_from_wire(value)


def hashes_in_form(hashes: list[int], hash_form: HashForm) -> list[int]:
    """64-bit int hashes in ``hash_form``: the same list when every one already is."""
    if not hashes:
        return hashes
    if hash_form == "u64":
        return hashes if min(hashes) >= 0 else [to_u64(h) for h in hashes]
    return hashes if max(hashes) <= _I64_MAX else [to_i64(h) for h in hashes]


def hash_in_form(value: int, hash_form: HashForm) -> int:
    return to_u64(value) if hash_form == "u64" else to_i64(value)
