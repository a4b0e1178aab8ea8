"""Load: 2 instances x 16 ranks at 5x the expected event rate, with concurrent queries.

Expected rate (the report's prefill fleet): a prefill step every 50-100 ms per rank, each
step a few events -> at most 20 batches/s per rank.  5x: 100 batches/s per rank, 1,600
batches/s per instance, 3,200/s into the adapter, ~2.7 events per batch
(``faults_procs.tree_events``: one 2-block request stored, one evicted from HBM, a third
demoted to host and later dropped), so resident sets are bounded and RSS must plateau.

Each instance is one process (fan-in + 16 rank publishers on its private ipc channel); the
adapter is one process (KvAffinity, 2 query threads, RSS sampled every 0.25 s).

* CI (``integration``): 6 s of load.   * by hand (``slow``): 60 s, ``-m slow``.
Checks: RSS after warm-up within 10%; queues at or under their bounds; every drop reported
(rank drops == fan-in gaps, subscriber gaps all refilled); final index == engine truth.
Numbers go to stdout as one JSON line (``-s``) and into docs/reliability.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_tcp_endpoint
from faults_procs import MEDIA, run_load_adapter, run_load_engine, truth
from kvpub_procs import spawn_context

from sglang_kvpub.config import PluginConfig

DP = 16
RATE_HZ = 100.0  # 5 x 20 batches/s per rank
WARMUP_S = 2.0


class Load:
    def __init__(self, tmp_path: Path, duration_s: float) -> None:
        self.mp = spawn_context()
        self.duration_s = duration_s
        self.stop = self.mp.Event()
        self.engines: list[tuple[Any, Any]] = []
        self.streams: list[tuple[str, str, str]] = []
        for k in range(2):
            config = PluginConfig(
                endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.5
            )
            answers = self.mp.Queue()
            proc = self.mp.Process(
                target=run_load_engine,
                args=(config, DP, RATE_HZ, duration_s, f"ipc://{tmp_path}/load{k}.sock", answers, self.stop),
                daemon=True,
            )
            self.engines.append((proc, answers))
            self.streams.append((f"inst{k}", config.endpoint, config.replay_endpoint or ""))
        self.commands, self.answers = self.mp.Queue(), self.mp.Queue()
        self.adapter = self.mp.Process(
            target=run_load_adapter, args=(self.streams, DP, 2, self.commands, self.answers), daemon=True
        )

    def run(self) -> dict[str, Any]:
        self.adapter.start()
        assert self.answers.get(timeout=30) == "ready"
        for proc, _ in self.engines:
            proc.start()
        for _, answers in self.engines:
            assert answers.get(timeout=30) == "ready"
        engines = [answers.get(timeout=self.duration_s + 60) for _, answers in self.engines]
        want = {}
        for k, report in enumerate(engines):
            n = report["batches_per_rank"]
            for (rank, medium), blocks in truth({r: [(0, n)] for r in range(DP)}).items():
                want[(f"inst{k}", rank, medium)] = blocks
        deadline = time.monotonic() + 30
        while True:
            self.commands.put("report")
            adapter = self.answers.get(timeout=30)
            if adapter["resident"] == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {"engines": engines, "adapter": adapter, "converged": adapter["resident"] == want}

    def close(self) -> None:
        self.stop.set()
        self.commands.put("stop")
        for proc in [self.adapter, *(p for p, _ in self.engines)]:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture
def load(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Load]:
    runner = Load(tmp_path, request.param)
    yield runner
    runner.close()


def _check(result: dict[str, Any], duration_s: float) -> dict[str, Any]:
    engines, adapter = result["engines"], result["adapter"]
    warmup_s = max(WARMUP_S, duration_s / 6)  # the index, buffers and allocator pools fill first
    samples = [(t, rss) for t, rss in adapter["samples"] if t >= warmup_s]
    base = samples[0][1]
    peak = max(rss for _, rss in samples)
    sent = sum(e["batches_per_rank"] for e in engines) * DP
    rank_dropped = sum(r["dropped"] for e in engines for r in e["ranks"])
    fanin_gaps = sum(s["gaps"] for e in engines for s in e["fanin"]["ranks"].values())
    health = [h for hs in adapter["health"].values() for h in hs]
    summary = {
        "bench": "load",
        "duration_s": duration_s,
        "instances": 2,
        "ranks_per_instance": DP,
        "batches_per_s_per_rank": RATE_HZ,
        "rank_batches_sent": sent,
        "instance_batches_applied": sum(h["batches"] for h in health),
        "events_applied": sum(h["events"] for h in health),
        "queries": adapter["counts"]["queries"],
        "queries_with_hit": adapter["counts"]["hits"],
        "rss_after_warmup_mb": round(base / 2**20, 1),
        "rss_peak_mb": round(peak / 2**20, 1),
        "rss_growth_pct": round(100 * (peak - base) / base, 1),
        "warmup_s": warmup_s,
        "rss_mb_trajectory": [
            round(rss / 2**20, 1) for _, rss in adapter["samples"][:: max(1, len(adapter["samples"]) // 12)]
        ],
        "rank_dropped": rank_dropped,
        "fanin_gaps": fanin_gaps,
        "fanin_pub_dropped": sum(e["fanin"]["pub_dropped"] for e in engines),
        "subscriber_gaps": sum(h["gaps"] for h in health),
        "subscriber_replays": sum(h["replays"] for h in health),
        "subscriber_snapshots": sum(h["snapshots"] for h in health),
        "subscriber_dropped_live": sum(h["dropped_live"] for h in health),
        "max_subscriber_pending": adapter["counts"]["max_pending"],
        "max_rank_queue_depth": max(e["peaks"]["rank_queue_depth"] for e in engines),
        "max_fanin_buffered": max(e["peaks"]["fanin_buffered"] for e in engines),
        "converged": result["converged"],
    }
    print(json.dumps(summary))
    assert result["converged"], "the adapter's index != the engines' truth after the load"
    assert summary["rss_growth_pct"] <= 10.0, summary
    assert rank_dropped == fanin_gaps  # every rank-side drop is a reported gap
    assert summary["max_subscriber_pending"] <= 10_000 and summary["max_rank_queue_depth"] <= 10_000
    assert summary["max_fanin_buffered"] <= 10_000 and summary["queries"] > 0
    assert summary["subscriber_gaps"] <= summary["subscriber_replays"] + summary["subscriber_snapshots"]
    assert all(h["decode_errors"] == 0 and h["apply_errors"] == 0 for h in health)
    assert set(MEDIA) >= {k[2] for k in adapter["resident"]}
    return summary


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize("load", [6.0], indirect=True, ids=["6s"])
def test_load_short(load: Load) -> None:
    _check(load.run(), load.duration_s)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("load", [60.0], indirect=True, ids=["60s"])
def test_load_60s(load: Load) -> None:
    _check(load.run(), load.duration_s)
