"""The router's C helpers (``motor_adapter._answer``, docs/native.md), loaded once.

What the adapter runs per ``/query`` and the engine never needs: the msgpack body's ids split
off, decoded and hashed in one call (``take_query_keys``, ``take_token_ids``, with
``QueryKeysMemo``'s prefix reuse) and the rank-aware answer (``rank_answer``,
:mod:`motor_adapter.rank_render`).  Bound to the xxhash package's XXH3 and checked as the
engine's helpers are (:mod:`sglang_kvpub.core.native_loader`);
``MODULE`` is None - and the Python paths answer - when not built, turned off with
``KVPUB_NATIVE=0``, or disagreeing.
"""

from __future__ import annotations

from typing import Any

from sglang_kvpub.core import hashing
from sglang_kvpub.core.native_loader import load_extension

__all__ = ["MODULE"]

_NAMES = ("take_token_ids", "take_query_keys", "QueryKeysMemo", "rank_answer", "u32_decode_wide")

MODULE: Any = load_extension(
    "motor_adapter._answer",
    _NAMES,
    reference=hashing._chained_py,  # the Python loops
    seed=hashing.BASE_SEED,
    what="the router's C helpers",
)
