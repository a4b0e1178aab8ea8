"""The PD tier (marker ``pd``): Motor's ``pd_dual_dispatch`` -> two SGLang PD prefills -> a decode.

The rig is ``bench/pd_rig.py`` (shared with ``bench/e2e.py --pd``).  Beyond the end-to-end
tier it needs Mooncake's transfer engine (.ci/requirements-pd.txt) and the system library
``libibverbs.so.1`` (Debian ``libibverbs1``); without them the tier is skipped here, and
fails in CI (``KVPUB_REQUIRE_PD=1``).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import e2e_rig  # noqa: E402  (bench/e2e_rig.py)


def missing() -> list[str]:
    found = [] if importlib.util.find_spec("mooncake") is not None else ["mooncake-transfer-engine-non-cuda"]
    if ctypes.util.find_library("ibverbs") is None:
        found.append("libibverbs1 (system library)")
    return [*e2e_rig.environment_ready(), *found]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    absent = missing()
    if not absent or os.environ.get("KVPUB_REQUIRE_PD") == "1":
        return
    skip = pytest.mark.skip(reason=f"PD tier needs {', '.join(absent)} (.ci/requirements-pd.txt, .ci/run)")
    for item in items:
        if "pd" in item.keywords:
            item.add_marker(skip)
