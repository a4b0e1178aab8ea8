"""bench/fanin.py --runs: the summary counts every run and names the disturbed ones from the data."""

from __future__ import annotations

from typing import Any

import pytest

from bench._common import with_targets
from bench.fanin import summarize

pytestmark = pytest.mark.unit


def _run(added_p99: float, direct_p99: float, ratio: float = 1.0) -> dict[str, Any]:
    return {
        "added_latency_p99_ms": added_p99,
        "throughput_ratio_vs_direct": ratio,
        "direct_latency_p50_p99_ms": [0.1, direct_p99],
        "paired_added_latency_p50_p99_ms": [0.1, added_p99 + 0.2],
        "fanin_gc": {"max_ms": 1.0},
        "load_avg_1m": 0.5,
    }


def test_a_miss_in_a_disturbed_run_still_counts_and_is_named() -> None:
    runs = [_run(0.3, 0.4), _run(1.7, 5.2), _run(0.4, 1.4), _run(1.2, 0.5), _run(0.2, 0.3, ratio=0.9)]
    summary = with_targets(summarize(runs))
    assert summary["runs"] == 5 and summary["runs_met"] == 3
    assert summary["disturbed_runs"] == [2, 3]  # their direct arm alone had p99 > 1 ms
    assert summary["missed_runs"] == [2, 4] and summary["missed_runs_disturbed"] == [2]
    assert summary["added_latency_p99_ms"] == 1.7 and summary["throughput_ratio_vs_direct"] == 0.9
    met = {item["figure"]: item["met"] for item in summary["targets"]}
    assert met == {"added_latency_p99_ms": False, "throughput_ratio_vs_direct": True, "runs_met": False}
    assert summary["target_met"] is False


def test_every_run_met_meets_the_target() -> None:
    summary = with_targets(summarize([_run(0.5, 0.6) for _ in range(5)]))
    assert summary["runs_met"] == 5 and summary["disturbed_runs"] == [] and summary["target_met"] is True
