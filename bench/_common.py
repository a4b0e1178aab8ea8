"""Small helpers shared by the benches: JSON-line output, percentiles, a timer."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["emit", "percentile", "Timer", "timer"]


def emit(record: dict[str, Any]) -> None:
    """Prints one bench result as one JSON line on stdout (flushed: run_all reads it live)."""
    sys.stdout.write(json.dumps(record, sort_keys=False) + "\n")
    sys.stdout.flush()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in 0..100; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


class Timer:
    """Elapsed wall time of a ``with timer() as t:`` block, in ``t.seconds``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds = 0.0


@contextmanager
def timer() -> Iterator[Timer]:
    t = Timer()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - t.start
