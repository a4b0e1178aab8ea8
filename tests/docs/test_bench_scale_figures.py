"""bench/scale.py's figures say what they measured: an empty index gives no per-entry figure,
each side's capacity comes from its own CPU per batch, and a row whose generator fell behind
is neither met nor failed."""

from __future__ import annotations

from typing import Any

import pytest

from bench._common import with_targets
from bench.scale import _capacity, _memory_figures

pytestmark = pytest.mark.unit

_SNAPSHOT = {"rss": 100 << 20, "pymalloc_used": 1000, "malloc_in_use": 2000}


def _row(**figures: Any) -> dict[str, Any]:
    row = {
        "bench": "scale",
        "instances": 100,
        "lag_p99_ms": 5.0,
        "query_p99_ms": 1.0,
        "noop_p99_ms": 1.0,
        "steady_rss_bytes_per_entry": 150.0,
        "rss_bytes_per_entry": 150.0,
        "budget_bytes_per_entry": 144,
        "ingest_cpu_us_per_batch": 250.0,
        "offered_batches_per_s": 3200.0,
        "achieved_batches_per_s": 3200.0,
        "generator_keeps_up": True,
        "generator_cpu_pct": 40.0,
    }
    row.update(figures)
    return row


def test_an_empty_index_gives_no_per_entry_figure() -> None:
    empty = {**_SNAPSHOT, "index_entries": 0, "index_bytes": 0}
    figures = _memory_figures(empty, _SNAPSHOT, 0)
    assert figures["estimate_bytes_per_entry"] is None
    assert figures["rss_over_estimate"] is None
    assert figures["rss_bytes_per_entry"] is None
    assert figures["pymalloc_used_per_entry"] is None
    assert figures["rss_index_mb"] == 0.0


def test_a_filled_index_gives_its_per_entry_figures() -> None:
    full = {"rss": (100 << 20) + 144_000, "pymalloc_used": 3000, "malloc_in_use": 2000}
    figures = _memory_figures({**full, "index_entries": 1000, "index_bytes": 120_000}, _SNAPSHOT, 1000)
    assert figures["rss_bytes_per_entry"] == 144.0
    assert figures["estimate_bytes_per_entry"] == 120.0
    assert figures["rss_over_estimate"] == 1.2
    assert figures["pymalloc_used_per_entry"] == 2.0


def test_capacity_comes_from_each_sides_own_cpu_per_batch() -> None:
    row = _row()
    row.update(_capacity(row, gen_batches=10_000, gen_cpu_s=2.0, rps_per_rank=2.0))
    assert row["adapter_capacity_batches_per_s"] == 4000  # 250 us a batch
    assert row["adapter_capacity_instances"] == 125.0  # 32 batches/s an instance
    assert row["generator_cpu_us_per_batch"] == 200.0
    assert row["generator_capacity_batches_per_s"] == 5000
    assert "not_measured" not in row
    assert with_targets(row)["target_met"] is True


@pytest.mark.parametrize(
    "behind",
    [{"achieved_batches_per_s": 2800.0, "generator_keeps_up": False}, {"generator_cpu_pct": 89.5}],
    ids=["sent-too-few", "busy-core"],
)
def test_a_row_whose_generator_fell_behind_is_not_measured(behind: dict[str, Any]) -> None:
    # figures that would fail every target: the row must not say failed (nor met)
    row = _row(lag_p99_ms=900.0, query_p99_ms=50.0, **behind)
    row.update(_capacity(row, gen_batches=10_000, gen_cpu_s=9.0, rps_per_rank=2.0))
    assert "generator" in row["not_measured"]
    judged = with_targets(row)
    assert judged["target_met"] is None
    assert judged["targets"] and all(item["met"] is None for item in judged["targets"])


def test_no_applied_batch_gives_no_adapter_capacity() -> None:
    row = _row(ingest_cpu_us_per_batch=None)
    figures = _capacity(row, gen_batches=0, gen_cpu_s=0.0, rps_per_rank=2.0)
    assert figures["adapter_capacity_batches_per_s"] is None
    assert figures["generator_capacity_batches_per_s"] is None
