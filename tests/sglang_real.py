"""The real SGLang 0.5.23 loader (``bench/sglang_loader.py``) plus the pytest skip markers.

Tests and their child processes ``import sglang_real``; the loader itself lives in bench/
(benches use it too, and a bench never imports the test suite).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from bench.sglang_loader import *  # noqa: F403  (this module IS the loader, for tests)
from bench.sglang_loader import (
    _ENV_HASH,
    _ENV_MODE,
    _ENV_REQUIRE,
    FULL_DEPS,
    LIGHT_DEPS,
    MANAGER_DEPS,
    RADIX_DEPS,
    _skip_reason,
)

__all__ = [
    "_ENV_HASH",
    "_ENV_MODE",
    "_skip_reason",
    "requires_radix_cache",
    "requires_sglang_full",
    "requires_sglang_kv_events",
    "requires_sglang_managers",
]


def _marker(deps: Sequence[str], what: str) -> pytest.MarkDecorator:
    reason = _skip_reason(deps, what)
    required = os.environ.get(_ENV_REQUIRE) == "1"
    return pytest.mark.skipif(bool(reason) and not required, reason=reason or "available")


requires_sglang_kv_events = _marker(LIGHT_DEPS, "kv_events")
requires_sglang_full = _marker(FULL_DEPS, "package (full import)")
requires_radix_cache = _marker(RADIX_DEPS, "RadixCache")
requires_sglang_managers = _marker(MANAGER_DEPS, "managers (DP controller, kv_events_publisher)")
