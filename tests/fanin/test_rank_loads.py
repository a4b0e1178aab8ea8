"""Rank loads on the instance stream: the contract, who skips it, the fan-in that
sends it, the adapter that reads it, the answer Motor's unchanged cost reads, the metrics and
the Grafana dashboard built from them."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_tcp_endpoint, offline_adapter

from motor_adapter.adapter_metrics import RANK_METRICS
from motor_adapter.affinity import KvAffinity
from motor_adapter.rank_loads import RankLoadBook
from motor_adapter.scoring import MOTOR_BOOK_MARGIN, KvAffinityConfig, RankScored, motor_values, pick_instance
from motor_adapter.settings import ServiceConfig
from motor_adapter.state import AdapterState
from motor_adapter.stream import StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.errors import ConfigError
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.engine.load_report import ControllerLoads
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.tools.tail import describe_batch

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-routing.json"


def _report(loads: list[float], dispatch: dict[str, int] | None = None) -> bytes:
    figures = wire.RankLoads([wire.RankLoad(r, v, 1, 10 * r, 20 * r) for r, v in enumerate(loads)], dispatch or {}, 0.1)
    return wire.LoadReportCodec().encode(1.5, figures)


# --------------------------------------------------------------------------- contract


@pytest.mark.unit
def test_a_load_report_round_trips_and_every_other_payload_is_not_one() -> None:
    codec = wire.LoadReportCodec()
    report = codec.decode(_report([5.0, 0.0, 7.5], {"cache_hit": 3}))
    assert report is not None and report.events == [] and report.dp_rank is None
    assert [(r.dp_rank, r.load_tokens, r.cached_tokens_total) for r in report.loads.ranks] == [
        (0, 5.0, 0),
        (1, 0.0, 10),
        (2, 7.5, 20),
    ]
    assert report.loads.dispatch == {"cache_hit": 3}
    encoder = wire.BatchEncoder()
    assert codec.decode(encoder.encode(wire.EventBatch(1.0, [], None))) is None  # a heartbeat
    stored = wire.BlockStored([1], None, list(range(4)), 4, medium="GPU")
    assert codec.decode(encoder.encode(wire.EventBatch(1.0, [stored], 0))) is None
    with pytest.raises(wire.WireError):
        codec.decode(msgspec.msgpack.encode([1.0, [], None, {"type": "RankLoads", "ranks": "nope"}]))
    with pytest.raises(wire.WireError):  # bounded: a consumer keeps one entry per rank
        codec.decode(_report([0.0] * (wire.MAX_LOAD_RANKS + 1)))
    with pytest.raises(wire.WireError):
        codec.decode(msgspec.msgpack.encode([1.0, [], None, {"type": "RankLoads", "ranks": [[99999, 1.0]]}]))


@pytest.mark.unit
def test_consumers_that_do_not_know_it_read_a_heartbeat() -> None:
    payload = _report([1.0, 2.0])
    batch = wire.BatchDecoder().decode(payload)  # the adapter's (and every older adapter's) decoder
    assert (batch.events, batch.dp_rank) == ([], None)
    assert "heartbeat" in describe_batch(wire.make_seq(3, 9), batch)  # sglang-kvpub tail
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    theirs = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)  # SGLang 0.5.23's own struct
    assert list(theirs.events) == []


@pytest.mark.unit
def test_load_report_period_is_checked_at_start() -> None:
    assert PluginConfig().load_report_s == 0.1
    assert PluginConfig(load_report_s=0).load_report_s == 0
    with pytest.raises(ConfigError, match="load_report_s"):
        PluginConfig(load_report_s=0.001)
    assert PluginConfig.from_mapping({}, env={"SGLANG_KVPUB_LOAD_REPORT_S": "0.5"}).load_report_s == 0.5


# --------------------------------------------------------------------------- fan-in -> subscriber


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_fanin_sends_rank_loads_and_the_subscriber_hands_them_to_the_book() -> None:
    endpoint = free_tcp_endpoint()
    config = PluginConfig(endpoint=endpoint, bind=True, heartbeat_s=0.2, load_report_s=0.02)
    figures = {"loads": [3.0, 0.0]}
    calls = threading.Event()

    def source() -> wire.RankLoads:
        calls.set()
        return wire.RankLoads([wire.RankLoad(r, v) for r, v in enumerate(figures["loads"])], {"no_hit": 2}, 0.02)

    ctx: zmq.Context[Any] = zmq.Context()
    fanin = FanIn(config, 2, listen_channel=False)
    fanin.set_load_source(source)
    book = RankLoadBook()
    received = threading.Condition()

    def sink(instance: str, report: wire.LoadReport) -> None:
        with received:
            book.apply(instance, report)
            received.notify_all()

    options = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, backoff_max_s=0.5, poll_s=0.02)
    sub = StreamSubscriber("inst", endpoint, PrefixIndex(16), context=ctx, options=options, load_sink=sink)
    fanin.start()
    sub.start()
    try:

        def seen(loads: list[float]) -> bool:
            found = book.get("inst")
            return found is not None and list(found.loads) == loads

        with received:
            assert received.wait_for(lambda: seen([3.0, 0.0]), timeout=10)
            figures["loads"] = [0.0, 9.5]
            assert received.wait_for(lambda: seen([0.0, 9.5]), timeout=10)
        found = book.get("inst")
        assert found is not None and found.dispatch == {"no_hit": 2} and found.dp_size == 2
        # Unchanged figures go out once per heartbeat only, not every period.
        before = fanin.stats()["load_reports"]
        time.sleep(0.5)
        assert fanin.stats()["load_reports"] - before <= 4
        assert sub.health().load_reports >= 2 and sub.health().decode_errors == 0
    finally:
        sub.stop()
        fanin.stop()
        ctx.term()
    assert calls.is_set()


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_a_failing_load_source_is_switched_off_and_the_stream_goes_on() -> None:
    config = PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.05, load_report_s=0.02)
    fanin = FanIn(config, 1, listen_channel=False)

    def broken() -> wire.RankLoads:
        raise RuntimeError("no snapshot")

    fanin.set_load_source(broken)
    fanin.start()
    try:
        deadline = time.monotonic() + 10
        while fanin.stats()["load_report_errors"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        beats = fanin.stats()["heartbeats"]
        while fanin.stats()["heartbeats"] < beats + 3:  # still beating
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert fanin.stats()["load_report_errors"] == 1  # once, then off
    finally:
        fanin.stop()


@pytest.mark.unit
def test_controller_loads_add_commits_and_count_cached_tokens() -> None:
    class Snap:
        def __init__(self, rank: int, ts: float, total: int, uncached: int, hit_rate: float) -> None:
            self.dp_rank, self.timestamp, self.num_total_tokens = rank, ts, total
            self.num_running_reqs, self.num_waiting_reqs = 1, 2
            self.total_prefill_uncached_tokens, self.cache_hit_rate = uncached, hit_rate

    class Dispatcher:
        commits = [[(time.time() + 5.0, 100.0)], []]  # one commit after rank 0's snapshot

        def decision_counts(self) -> dict[str, int]:
            return {"cache_hit": 4}

    snaps = [Snap(0, 10.0, 500, 1000, 0.0), Snap(1, 10.0, 0, 0, 0.0)]
    source = ControllerLoads(lambda: snaps, Dispatcher(), 0.1)  # type: ignore[arg-type]
    first = source()
    assert first is not None
    assert [r.load_tokens for r in first.ranks][1] == 0.0 and first.ranks[0].load_tokens > 500.0
    assert first.dispatch == {"cache_hit": 4} and first.ranks[0].requests == 3
    snaps[0] = Snap(0, 11.0, 0, 1300, 0.75)  # 300 computed at a 75 % hit rate: 900 served from cache
    second = source()
    assert second is not None
    assert (second.ranks[0].cached_tokens_total, second.ranks[0].prefill_tokens_total) == (900, 1300)
    assert ControllerLoads(lambda: [], None, 0.1)() is None


# --------------------------------------------------------------------------- the answer Motor reads


def _ascend_cost(dp: int, isl: int, load: float, cfg: KvAffinityConfig) -> float:
    """The Ascend source's unchanged cost of one instance (tests/fixtures/motor_versions.json)."""
    matched = min(dp, isl)
    return cfg.prefill_load_scale * max(0.0, isl - cfg.overlap_credit * matched) + cfg.load_weight * load


@pytest.mark.unit
def test_motor_values_make_both_motors_pick_the_cheapest_rank() -> None:
    rng = random.Random(4)
    for _ in range(500):
        cfg = KvAffinityConfig(
            prefill_load_scale=rng.choice([1.0, 0.5, 2.0]),
            overlap_credit=rng.choice([1.0, 0.8]),
            load_weight=rng.choice([1.0, 0.5]),
        )
        isl = rng.randint(200, 8000)
        scored = []
        motor_loads = []
        for _ in range(rng.randint(1, 4)):
            matched = rng.choice([0, rng.randint(0, isl)])
            rank_load = rng.choice([0.0, rng.uniform(0, 40_000)])
            total = rank_load + rng.uniform(0, 300_000)  # the instance's other ranks
            cost = cfg.prefill_load_scale * max(0.0, isl - cfg.overlap_credit * matched) + cfg.load_weight * rank_load
            scored.append(RankScored(1, None, matched, cost, total, rank_load))
            motor_loads.append(total)  # what Motor's own load term holds: the instance's load
        spread = rng.getrandbits(32)
        best = pick_instance(scored, spread)
        fresh = [rng.random() < 0.8 for _ in scored]
        dp, gpu = motor_values(scored, best, cfg, isl, fresh)
        assert dp[best] == min(scored[best].matched, isl)  # Motor's log shows the true hit
        assert max(range(len(gpu)), key=lambda i: (gpu[i], i)) == best  # 3.0.0b2: the last largest GPU
        assert all(g >= 0 for g in gpu) and dp[best] >= 0  # 3.0.0b2 skips negative values
        motor = [_ascend_cost(d, isl, load, cfg) for d, load in zip(dp, motor_loads, strict=True)]
        for i, s in enumerate(scored):  # the Ascend source's scores differ as the rank costs do
            held = MOTOR_BOOK_MARGIN * cfg.load_weight if i != best and fresh[i] and fresh[best] else 0.0
            if dp[i] < isl:
                assert motor[i] - motor[best] == pytest.approx(s.cost - scored[best].cost + held, abs=2.5)
            else:  # capped: only ever makes a costlier instance look costlier still
                assert motor[i] >= motor[best] - 2.5
        if all(fresh):  # Motor's own book (3.1: isl - matched per prefill in flight) cannot move the pick
            book = [rng.uniform(0, 2_000_000) for _ in scored]
            own = [_ascend_cost(d, isl, load, cfg) for d, load in zip(dp, book, strict=True)]
            assert min(range(len(own)), key=lambda i: (own[i], i != best)) == best


def _state() -> tuple[AdapterState, KvAffinity]:
    instances = [(f"vllm-prefill-{i}", f"tcp://127.0.0.{i + 1}:5557") for i in range(2)]
    return offline_adapter(ServiceConfig(kv_affinity=KvAffinityConfig(block_size=16)), instances, 16)


@pytest.mark.unit
def test_query_scores_the_rank_that_would_serve_and_metrics_show_it() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 8 * 16))
    stored = wire.BlockStored(list(range(100, 108)), None, prompt, 16, medium="GPU")
    affinity.index.apply_batch("tcp://127.0.0.1:5557", wire.EventBatch(0.0, [stored], 3))
    codec = wire.LoadReportCodec()
    busy = codec.decode(_report([0.0, 0.0, 0.0, 5000.0], {"cache_hit": 7, "no_hit": 2}))
    idle = codec.decode(_report([0.0, 0.0, 0.0, 0.0]))
    assert busy is not None and idle is not None
    affinity.loads.apply("tcp://127.0.0.1:5557", busy)
    affinity.loads.apply("tcp://127.0.0.2:5557", idle)
    answer = state.query("m", "default", 16, prompt)["default"]
    warm, cold = answer["vllm-prefill-0"], answer["vllm-prefill-1"]
    # Rank 3 holds all 128 tokens but has 5000 queued: an idle cold rank is cheaper (128 + 0).
    assert warm["dp_detail"]["0"]["scored_rank"] != 3 and warm["dp_detail"]["0"]["rank_cost"] == 128
    assert warm["longest_matched"] == 128  # the real longest hit is still shown
    affinity.loads.apply("tcp://127.0.0.1:5557", idle)
    answer = state.query("m", "default", 16, prompt)["default"]
    warm, cold = answer["vllm-prefill-0"], answer["vllm-prefill-1"]
    assert warm["dp_detail"]["0"]["scored_rank"] == 3 and warm["DP"]["0"] == 128 and warm["GPU"] == 128
    assert cold["dp_detail"]["0"]["engine_dp_rank"] is None  # no hit: no rank named for the figures
    assert cold["GPU"] < warm["GPU"] and cold["DP"]["0"] < warm["DP"]["0"]
    text = state.render_metrics()
    for name in RANK_METRICS:
        assert f"# TYPE {name} " in text, name
    assert 'motor_kv_adapter_scored_hit_tokens_total{engine_dp_rank="3",instance="vllm-prefill-0"} 128' in text
    assert 'motor_kv_adapter_dispatch_decisions_total{instance="vllm-prefill-0",reason="cache_hit"}' not in text
    assert 'motor_kv_adapter_rank_cached_tokens_total{dp_rank="3",instance="vllm-prefill-1"} 30' in text
    affinity.loads.apply("tcp://127.0.0.1:5557", busy)
    text = state.render_metrics()
    assert 'motor_kv_adapter_dispatch_decisions_total{instance="vllm-prefill-0",reason="cache_hit"} 7' in text
    assert 'motor_kv_adapter_instance_rank_load_skew{instance="vllm-prefill-0"} 4' in text


@pytest.mark.unit
def test_cold_prompts_tied_over_instances_reach_every_rank_of_each() -> None:
    # The instance is named by the tie-break key's high bits, the rank scan starts at its low
    # bits: were both the low bits, instance 0 would take ties only on even ranks, 1 on odd.
    state, affinity = _state()
    codec = wire.LoadReportCodec()
    idle = codec.decode(_report([0.0] * 16))
    assert idle is not None
    seen = set()
    for p in range(200):
        for stream in ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557"):
            affinity.loads.apply(stream, idle)  # drops the previous answer's commit
        answer = state.query("m", "default", 16, [p * 1000 + i for i in range(1, 1 + 4 * 16)])["default"]
        [best] = [name for name, entry in answer.items() if entry["GPU"] == 1]  # a cold best shows 1
        seen.add((best, answer[best]["dp_detail"]["0"]["scored_rank"] % 2))
    assert seen == {(f"vllm-prefill-{i}", parity) for i in range(2) for parity in range(2)}


@pytest.mark.unit
def test_without_rank_loads_the_answer_is_the_fold_as_before() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 4 * 16))
    stored = wire.BlockStored(list(range(100, 104)), None, prompt, 16, medium="GPU")
    affinity.index.apply_batch("tcp://127.0.0.2:5557", wire.EventBatch(0.0, [stored], 2))
    entry = state.query("m", "default", 16, prompt)["default"]["vllm-prefill-1"]
    assert (entry["GPU"], entry["DP"], entry["dp_detail"]["0"]["engine_dp_rank"]) == (64, {"0": 64}, 2)
    assert "rank_cost" not in entry["dp_detail"]["0"]


# --------------------------------------------------------------------------- Grafana


@pytest.mark.unit
def test_grafana_dashboard_panels_name_metrics_the_adapter_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    state, affinity = _state()
    affinity.loads.apply("tcp://127.0.0.1:5557", wire.LoadReportCodec().decode(_report([1.0, 2.0], {"no_hit": 1})))
    state.query("m", "default", 16, list(range(1, 1 + 4 * 16)))
    exported = {line.split()[2] for line in state.render_metrics().splitlines() if line.startswith("# TYPE ")}
    titles = set()
    for panel in dashboard["panels"]:
        titles.add(panel["title"])
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = {tok for tok in _identifiers(expr) if tok.startswith("motor_kv_adapter_")}
            assert names, f"{panel['title']!r}: {expr} names no adapter metric"
            for name in names:
                base = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                assert base in exported, f"{panel['title']!r} uses {name}, which the adapter does not export"
    assert {"Hit ratio", "Rank load skew", "Dispatch reasons"} <= {t.split(":")[0] for t in titles}


def _identifiers(expr: str) -> list[str]:
    out, word = [], ""
    for char in expr + " ":
        if char.isalnum() or char == "_":
            word += char
        else:
            if word:
                out.append(word)
            word = ""
    return out
