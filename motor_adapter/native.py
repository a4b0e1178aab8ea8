"""The router's C helpers (``motor_adapter._answer``, docs/native.md), loaded once.

What the adapter runs per ``/query`` and the engine never needs: the msgpack body's ids split
off, decoded and hashed in one call (``take_query_keys``, ``take_token_ids``, with
``QueryKeysMemo``'s prefix reuse), a body key no Python calls (``body_key``) and the
rank-aware answer (``rank_answer``, :mod:`motor_adapter.rank_render`).  Bound to the xxhash
package's XXH3 and checked as the engine's helpers are (:mod:`sglang_kvpub.core.native_loader`);
``MODULE`` is None - and the Python paths answer - when not built, turned off with
``KVPUB_NATIVE=0``, or disagreeing.
"""

from __future__ import annotations

from typing import Any, Union

import xxhash

from sglang_kvpub.core import hashing
from sglang_kvpub.core.native_loader import load_extension

__all__ = ["MODULE"]

_NAMES = ("take_token_ids", "take_query_keys", "QueryKeysMemo", "body_key", "rank_answer", "u32_decode_wide")


def _body_key_check(module: Any, raw: bytes) -> Union[str, None]:
    if module.body_key(raw, True) != (xxhash.xxh3_128_intdigest(raw) << 1) | 1:
        return "the body key disagrees with xxhash's XXH3-128"
    return None


MODULE: Any = load_extension(
    "motor_adapter._answer",
    _NAMES,
    reference=hashing._chained_py,  # the Python loops
    seed=hashing.BASE_SEED,
    what="the router's C helpers",
    check=_body_key_check,
)
