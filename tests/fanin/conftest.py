"""Fixtures the fan-in tests share."""

from __future__ import annotations

from typing import Any

import pytest
import zmq


@pytest.fixture
def ctx(zctx: zmq.Context[Any]) -> zmq.Context[Any]:
    """The fan-in tests' name for ``zctx`` (tests/conftest.py)."""
    return zctx
