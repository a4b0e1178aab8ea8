"""Small helpers shared by the benches: JSON-line output, percentiles, a timer, the targets."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["MOONCAKE_TRACES", "emit", "percentile", "Timer", "timer", "Target", "TARGETS", "with_targets"]

# The public Mooncake traces (FAST'25, Apache-2.0) ship in the repository: see bench/data/mooncake/README.md.
MOONCAKE_TRACES = Path(__file__).resolve().parent / "data" / "mooncake"


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


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: ``figure`` of ``bench`` (the record with ``where``) compared with ``limit``."""

    bench: str
    figure: str
    op: str  # ">=" or "<="
    limit: float | str  # a number, or another figure of the same record (with ``factor``/``offset``)
    factor: float = 1.0
    offset: float = 0.0
    where: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        if isinstance(self.limit, str):
            scale = f"{self.factor:g} x " if self.factor != 1 else ""
            bound = f"{scale}{self.limit}" + (f" + {self.offset:g}" if self.offset else "")
        else:
            bound = f"{self.limit:g}"
        return f"{self.op} {bound}"

    def applies(self, bench: str, record: dict[str, Any]) -> bool:
        return bench == self.bench and all(record.get(key) == value for key, value in self.where)

    def check(self, record: dict[str, Any]) -> tuple[Any, bool | None]:
        """The figure and whether it meets the bound: None when either is missing, or when the
        record says it did not measure what the target bounds (``not_measured``)."""
        value = record.get(self.figure)
        if record.get("not_measured"):
            return value, None
        bound = record.get(self.limit) if isinstance(self.limit, str) else self.limit
        if not isinstance(value, (int, float)) or not isinstance(bound, (int, float)):
            return value, None
        bound = bound * self.factor + self.offset
        return value, (value >= bound if self.op == ">=" else value <= bound)


_CONVERSATION = ("trace", "conversation_trace.jsonl")
_SYNTHETIC = ("trace", "synthetic_trace.jsonl")
_AGENTIC = ("trace", "agentic_sessions")
_ROLLOUT = ("trace", "rollout")
_DEFAULT = ("policy", "default")

# The project's performance targets: ONE list, read by every bench
# for its own JSON line and by run_all.py for the README's table.
TARGETS: tuple[Target, ...] = (
    Target("wire", "decode_ratio", ">=", 0.8, where=(("encoding", "map"),)),
    Target("wire", "decode_ratio", ">=", 0.8, where=(("encoding", "array"),)),
    Target("fanin", "added_latency_p99_ms", "<=", 1.0),
    Target("fanin", "throughput_ratio_vs_direct", ">=", 0.8),
    # The added-latency bound in every one of `bench/fanin.py --runs 5`, not on average.
    Target("fanin", "runs_met", ">=", "runs", where=(("summary", "every run"),)),
    Target("residency", "step_overhead_us_median", "<=", 20.0),
    Target("residency", "reconcile_slice_ms_max", "<=", 1.0),
    Target("index", "ingest_blocks_per_s", ">=", 300_000),
    Target("index", "query_p99_us", "<=", 500.0),
    Target("index", "bytes_per_entry", "<=", 200.0),
    Target("index", "query_cpu_p50_us", "<=", "baseline_query_cpu_p50_us"),
    Target("index", "query_cpu_p99_us", "<=", "baseline_query_cpu_p99_us"),
    Target("index", "ingest_blocks_per_s", ">=", "baseline_ingest_blocks_per_s", factor=2.5),
    Target("service", "query_p99_ms", "<=", "noop_p99_ms", factor=2.0, offset=0.3),
    Target("service", "query_cpu_us", "<=", "noop_cpu_us", factor=1.2),
    Target("service", "query_distinct_p99_ms", "<=", "noop_p99_ms", factor=2.0, offset=0.3),
    Target("service", "query_distinct_cpu_us", "<=", "noop_cpu_us", factor=1.5),
    # The same bounds while rank loads flow, as in production (rank-aware answers).
    Target("service", "query_loads_cpu_us", "<=", "noop_cpu_us", factor=1.2),
    Target("service", "query_distinct_loads_cpu_us", "<=", "noop_cpu_us", factor=1.5),
    Target("replay", "ops_per_s", ">=", "baseline_ops_per_s", factor=2.0),
    Target("replay", "find_matches_p99_us", "<=", "baseline_find_matches_p99_us"),
    Target("scale", "lag_p99_ms", "<=", 100.0, where=(("instances", 100),)),
    Target("scale", "query_p99_ms", "<=", "noop_p99_ms", factor=2.0, offset=0.3, where=(("instances", 100),)),
    # The design estimate, 144 B x entries: RSS within 20 % of it once the index runs in
    # steady churn (every rank's LRU turned over: CPython's dicts re-grown over removed
    # entries), and not above it by more right after the fill (tables allocated but not yet
    # all touched, so RSS sits lower there).  The index's own account (stats(), sampled) is
    # reported beside, not bounded.
    Target(
        "scale", "steady_rss_bytes_per_entry", "<=", "budget_bytes_per_entry", factor=1.2, where=(("instances", 100),)
    ),
    Target(
        "scale", "steady_rss_bytes_per_entry", ">=", "budget_bytes_per_entry", factor=0.8, where=(("instances", 100),)
    ),
    Target("scale", "rss_bytes_per_entry", "<=", "budget_bytes_per_entry", factor=1.2, where=(("instances", 100),)),
    Target("dispatch", "decision_us_p50", "<=", 50.0),
    Target("dispatch", "decision_us_p99_cold", "<=", 50.0),
    Target("dispatch", "decision_us_p99_partial", "<=", 50.0),
    Target("dispatch", "decision_us_p99_full_hit", "<=", 50.0),
    Target("server", "throughput_cost_pct", "<=", 2.0, where=(("tree_core", "rust"), ("control", "-"))),
    Target("server", "plugin_own_us_median", "<=", 20.0, where=(("tree_core", "rust"), ("control", "-"))),
    Target("server", "throughput_cost_pct", "<=", 2.0, where=(("tree_core", "python"), ("control", "-"))),
    Target("server", "plugin_own_us_median", "<=", 20.0, where=(("tree_core", "python"), ("control", "-"))),
    Target("e2e", "repeats_cached_fraction", ">=", 1.0, where=(("dispatch", "cache_aware"),)),
    Target("e2e", "motor_scored_hit_fraction", ">=", 1.0, where=(("dispatch", "cache_aware"),)),
    Target("e2e", "hot_over_cold", "<=", 0.3, where=(("dispatch", "cache_aware"),)),
    # The default path (Motor over the adapter's /query answer + the plugin's dispatcher)
    # on both Mooncake traces and the generated agentic sessions.
    *(
        target
        for workload in (_CONVERSATION, _SYNTHETIC, _AGENTIC)
        for target in (
            Target("routing", "hit_ratio_vs_oracle", ">=", 0.98, where=(_DEFAULT, workload)),
            Target("routing", "hit_ratio", ">=", "best_other_shipped_hit_ratio", where=(_DEFAULT, workload)),
            Target("routing", "ttft_p50_s", "<=", "oracle_ttft_p50_s", factor=1.1, where=(_DEFAULT, workload)),
            Target("routing", "ttft_p90_s", "<=", "oracle_ttft_p90_s", factor=1.1, where=(_DEFAULT, workload)),
        )
    ),
    # RL rollout bursts (GRPO groups sent at once): the default path against the oracle, which
    # knows what every rank is prefilling.
    Target("routing", "hit_ratio_vs_oracle", ">=", 0.95, where=(_DEFAULT, _ROLLOUT)),
    Target("routing", "hit_ratio", ">=", "best_other_shipped_hit_ratio", where=(_DEFAULT, _ROLLOUT)),
    Target("routing", "ttft_p50_s", "<=", "oracle_ttft_p50_s", factor=1.2, where=(_DEFAULT, _ROLLOUT)),
    Target("routing", "ttft_p90_s", "<=", "oracle_ttft_p90_s", factor=1.2, where=(_DEFAULT, _ROLLOUT)),
    Target("e2e_pd", "repeats_cached_fraction", ">=", 1.0, where=(("dispatch", "cache_aware"),)),
    Target("e2e_pd", "hot_over_cold", "<=", 0.3, where=(("dispatch", "cache_aware"),)),
)


def with_targets(record: dict[str, Any], targets: Sequence[Target] = TARGETS) -> dict[str, Any]:
    """``record`` plus ``targets`` (every target of its bench that applies: the bound, the
    value and whether it is met) and ``target_met`` (all met; None when none applies)."""
    bench = str(record.get("bench", ""))
    checked = []
    for target in targets:
        if target.applies(bench, record):
            value, met = target.check(record)
            checked.append({"figure": target.figure, "target": target.describe(), "value": value, "met": met})
    record["targets"] = checked
    record["target_met"] = None if not checked or record.get("not_measured") else all(item["met"] for item in checked)
    return record
