"""The end-to-end tier (marker ``e2e``): Motor's real coordinator -> SGLang with the plugin.

The rig is ``bench/e2e_rig.py`` (shared with ``bench/e2e.py``).  What it needs beyond the
real-server tier is the real Motor (.ci/requirements-motor.txt); without it the tier is
skipped here, and fails in CI (``KVPUB_REQUIRE_MOTOR=1`` / ``KVPUB_REQUIRE_SGLANG=1``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import e2e_rig  # noqa: E402  (bench/e2e_rig.py)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = e2e_rig.environment_ready()
    required = os.environ.get("KVPUB_REQUIRE_MOTOR") == "1" and os.environ.get("KVPUB_REQUIRE_SGLANG") == "1"
    if not missing or required:
        return
    skip = pytest.mark.skip(reason=f"end-to-end tier needs {', '.join(missing)} (.ci/requirements-*.txt)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)
