"""The router's C helpers (``motor_adapter._answer``, docs/native.md), loaded once.

What the adapter runs per ``/query`` and the engine never needs: the msgpack body's ids split
off, decoded and hashed in one call (``take_query_keys``, ``take_token_ids``, with
``QueryKeysMemo``'s prefix reuse), a body key no Python calls (``body_key``) and the
rank-aware answer (``rank_answer``, :mod:`motor_adapter.rank_render`).  Bound to the xxhash
package's XXH3 as the engine's helpers are, and checked against the Python loops; ``MODULE``
is None - and the Python paths answer - when not built, turned off with ``KVPUB_NATIVE=0``,
or disagreeing.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

import xxhash

from sglang_kvpub.core import hashing

__all__ = ["MODULE"]

log = logging.getLogger(__name__)
_NAMES = ("take_token_ids", "take_query_keys", "QueryKeysMemo", "body_key", "rank_answer", "u32_decode_wide")


def _load() -> Any:
    if os.environ.get("KVPUB_NATIVE", "1").strip() == "0":
        return None
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]

        from motor_adapter import _answer  # type: ignore[attr-defined]

        _answer.bind(_xxhash.__file__)
        for name in _NAMES:
            getattr(_answer, name)
    except (ImportError, AttributeError, OSError) as exc:
        log.debug("the router's C helpers are unavailable (%s): the Python paths answer", exc)
        return None
    for size, block in ((16, 4), (300, 128), (1100, 1024)):
        ids = [(i * 2_654_435_761) & 0xFFFFFFFF for i in range(size)]
        raw = struct.pack(f"<{size}I", *ids)
        blocks = size // block
        expected = hashing._chained_py(raw, block, 7, hashing.BASE_SEED, 0, blocks)  # the Python loops
        if _answer.chain_keys(raw, block, 7, hashing.BASE_SEED, 0, blocks) != expected:
            log.warning("the router's C helpers disagree with the Python loops: not used")
            return None
        if _answer.body_key(raw, True) != (xxhash.xxh3_128_intdigest(raw) << 1) | 1:
            log.warning("the router's body key disagrees with xxhash's XXH3-128: the C helpers are not used")
            return None
    return _answer


MODULE: Any = _load()
