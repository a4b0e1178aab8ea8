"""The HTTP contract of the conductor API: request bodies, field checks and the refusal type.

What a client may send (``QueryBody`` is decoded and validated in C, the hot path) and how a
bad request is refused (:class:`RequestError`: status, stable reason, detail).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Union

import msgspec

from motor_adapter.registration import DEFAULT_TENANT
from motor_adapter.scoring import Candidate

__all__ = [
    "I64_MIN",
    "U64_MASK",
    "field_str",
    "field_block_size",
    "candidates_of",
    "QueryBody",
    "RequestError",
    "MSGPACK_TYPES",
    "token_ids_of",
    "u32_tokens",
    "take_token_ids",
    "take_query_keys",
    "as_dict",
]


_U32_MAX = 0xFFFFFFFF
U64_MASK = (1 << 64) - 1
I64_MIN = -(1 << 63)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

_U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
_BLOCK_SIZE = Annotated[int, msgspec.Meta(gt=0, le=1 << 20)]
_DEFAULT_BLOCK_SIZE = 128
_BAD_IDS = "token_ids must be a list of integers in [0, 2^32)"


class RequestError(Exception):
    """A request we refuse: HTTP ``status``, a stable ``reason`` and a human ``detail``."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail


class QueryBody(msgspec.Struct, kw_only=True):
    """``/query`` and ``/query_by_hash``: decoded AND validated in C (the hot path)."""

    model: Union[str, None] = None
    block_size: _BLOCK_SIZE = _DEFAULT_BLOCK_SIZE
    tenant_id: Union[str, None] = None
    token_ids: Union[list[int], None] = None  # range-checked by u32_tokens in one C call
    block_hashes: Union[list[int], None] = None  # i64 or u64: range checked by the handler
    prompt: Any = None
    messages: Any = None
    tools: Any = None
    units: Union[str, None] = None  # /query_by_hash: "tokens" or "blocks" (Motor 3.1's conductor)

    def common(self) -> tuple[str, str, int]:
        if not self.model:
            raise RequestError(400, "bad_field", "model must be a non-empty string")
        return self.model, self.tenant_id or DEFAULT_TENANT, self.block_size


def take_token_ids(raw: bytes, native: Any) -> tuple[bytes | None, bytes]:
    """A msgpack ``/query`` body split by the C helpers (``native``: ``hashing.NATIVE``):
    its ``token_ids`` as little-endian u32 bytes (None when there is no id array to take)
    and the body without them, for the :class:`QueryBody` decoder - no Python int per id.
    The same refusal as :func:`u32_tokens` for anything but integers in [0, 2^32)."""
    try:
        return native.take_token_ids(raw)
    except ValueError as exc:
        raise RequestError(400, "bad_field", f"{_BAD_IDS}: {exc}") from exc


def take_query_keys(raw: bytes, native: Any, seed: int, memo: Any = None) -> object:
    """:func:`take_token_ids` with the ids hashed in the same C call instead of returned:
    ``(rest, keys, tokens, spread, block_size)``, ``keys`` the prompt's
    ``hashing.sequence_keys`` under ``seed`` for the body's ``block_size`` (the
    :class:`QueryBody` default without one), ``spread`` its ``rank_cost.spread_key``,
    ``tokens`` the id count - no u32 bytes object, no view of it, the last block hashed once.
    None where :func:`take_token_ids` takes nothing, and when the body's ``block_size`` is not
    one integer in range (take the generic path: its decoder says what is wrong). The same
    refusal as :func:`take_token_ids` for a bad id. ``memo``: a ``native.QueryKeysMemo``
    (docs/native.md): the leading blocks a recent body shares byte for byte are taken from
    it instead of decoded and hashed - the same answer; and a body it remembers whole, with
    an object attached to it (``memo.attach(raw, answer)``), gives that object instead of a
    tuple: the caller's answer to the same bytes."""
    try:
        split: object = native.take_query_keys(raw, _DEFAULT_BLOCK_SIZE, seed, memo)
    except ValueError as exc:
        raise RequestError(400, "bad_field", f"{_BAD_IDS}: {exc}") from exc
    return split


# --------------------------------------------------------------------------- request fields


def field_str(body: Mapping[str, Any], key: str, default: Union[str, None] = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise RequestError(400, "bad_field", f"{key} must be a non-empty string")
    return value


def field_block_size(body: Mapping[str, Any], default: int) -> int:
    value = body.get("block_size", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 20:
        raise RequestError(400, "bad_field", f"block_size must be a positive integer, got {value!r}")
    return value


def token_ids_of(value: Any) -> list[int]:
    """Validated token ids: integers in [0, 2^32) (the conductor hashes them as u32)."""
    try:
        return msgspec.convert(value, list[_U32])
    except msgspec.ValidationError as exc:
        raise RequestError(400, "bad_field", f"{_BAD_IDS}: {exc}") from exc


def u32_tokens(tokens: Sequence[int]) -> array[int]:
    """Token ids packed as u32 in one C call, which is also the range check [0, 2^32)."""
    try:
        return array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise RequestError(400, "bad_field", f"{_BAD_IDS}: {exc}") from exc


def candidates_of(value: Any) -> list[Candidate]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "bad_field", "candidates must be a non-empty list of {instance_id, load}")
    out: list[Candidate] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("instance_id"), str):
            raise RequestError(400, "bad_field", f"each candidate needs a string instance_id, got {item!r}")
        load = _load(item.get("load", 0))
        endpoint = item.get("endpoint")
        out.append(Candidate(item["instance_id"], load, endpoint if isinstance(endpoint, str) else None))
    return out


def _load(value: Any) -> float:
    """A candidate's load: a finite number >= 0 (a huge int overflows float, NaN/inf never rank)."""
    load = math.nan
    shown = type(value).__name__
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int beyond float range (its repr may fail too)
            load = float(value)
        shown = repr(load) if not math.isnan(load) or isinstance(value, float) else "an integer beyond float range"
    if not (math.isfinite(load) and load >= 0):
        raise RequestError(400, "bad_field", f"candidate load must be a finite number >= 0, got {shown}")
    return load


def as_dict(value: Any) -> Any:
    """A dataclass instance as a dict for a JSON answer, anything else as it is.  A dict keyed by
    tuples (``StreamHealth.removed``: (engine rank, reason) -> blocks) is nested by the tuple's
    parts, ``{"0": {"capacity_eviction": 2}}``: JSON keys are strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _json_keys(dataclasses.asdict(value))
    return value


def _json_keys(value: Any) -> Any:
    if isinstance(value, dict):
        if not any(isinstance(key, tuple) for key in value):
            return {key: _json_keys(item) for key, item in value.items()}
        nested: dict[str, Any] = {}
        for key, item in value.items():
            parts = key if isinstance(key, tuple) else (key,)
            node = nested
            for part in parts[:-1]:
                node = node.setdefault(str(part), {})
            node[str(parts[-1])] = _json_keys(item)
        return nested
    if isinstance(value, list):
        return [_json_keys(item) for item in value]
    return value
