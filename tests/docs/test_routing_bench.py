"""Unit tests of sglang_kvpub/tools/sim_cache.py (the rank prefix-cache model) and bench/routing.py (routing sim)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


routing = _load("kvpub_bench_routing", "routing.py")
RankCache = routing.RankCache


# ------------------------------------------------------------------------------------------ RankCache
def test_match_counts_leading_cached_pages_only() -> None:
    c = RankCache(10, page_size=128)
    assert c.insert(["a", "b", "c"]) == (["a", "b", "c"], [])
    assert c.match(["a", "b", "c", "d"]) == 3
    assert c.match(["a", "x", "c"]) == 1  # a gap ends the prefix
    assert c.match(["x", "a"]) == 0
    assert c.match_tokens(["a", "b"]) == 256
    assert len(c) == 3


def test_insert_returns_only_new_pages_and_parent_links() -> None:
    c = RankCache(10)
    c.insert(["a", "b"])
    res = c.insert(["a", "b", "c", "d"])
    assert res.stored == ["c", "d"]
    assert res.evicted == []
    assert c.parent_of("c") == "b"
    assert c.parent_of("a") is None
    assert c.insert(["a", "b"]).stored == []  # fully cached: nothing new


def test_lru_evicts_least_recent_leaf_and_reports_it() -> None:
    c = RankCache(4)
    c.insert(["a", "a1"])
    c.insert(["b", "b1"])
    c.match(["a", "a1"], touch=True)  # a-path is now more recent than b-path
    res = c.insert(["c", "c1"])
    assert res.stored == ["c", "c1"]
    assert res.evicted == ["b1", "b"]  # leaf before its parent
    assert c.match(["a", "a1"]) == 2
    assert "b" not in c


def test_router_lookup_does_not_touch_lru() -> None:
    c = RankCache(4)
    c.insert(["a", "a1"])
    c.insert(["b", "b1"])
    c.match(["a", "a1"])  # touch=False: a look-up must not change what gets evicted
    assert c.insert(["c", "c1"]).evicted == ["a1", "a"]


def test_eviction_takes_leaves_so_shared_prefix_survives() -> None:
    c = RankCache(4)
    c.insert(["s", "x1"])
    c.insert(["s", "y1"])
    c.insert(["s", "z1"])  # 4 pages: s, x1, y1, z1
    res = c.insert(["s", "w1"])
    assert res.evicted == ["x1"]  # the oldest leaf, never the shared parent "s"
    assert c.match(["s", "y1"]) == 2
    assert c.match(["s", "w1"]) == 2


def test_insert_never_evicts_its_own_path_and_truncates_to_capacity() -> None:
    c = RankCache(3)
    c.insert(["p", "q"])
    res = c.insert(["p", "q", "r", "s", "t"])
    assert res.stored == ["r"]  # only what fits after the path; the cache stays prefix-closed
    assert res.evicted == []
    assert c.match(["p", "q", "r", "s"]) == 3


def test_locked_pages_are_not_evicted() -> None:
    c = RankCache(3)
    c.insert(["a", "a1"])
    n = c.lock(["a", "a1"])
    assert n == 2
    res = c.insert(["b", "b1"])
    assert res.evicted == []
    assert res.stored == ["b"]  # one free page only
    c.unlock(["a", "a1"], n)
    res = c.insert(["b", "b1"])
    assert res.evicted == ["a1"]
    assert res.stored == ["b1"]


def test_clear_and_tokens_and_resident_order() -> None:
    c = RankCache(8, page_size=2)
    c.insert(["a", "b"], tokens=[[1, 2], [3, 4]])
    c.insert(["a", "c"], tokens=[[1, 2], [5, 6]])
    assert c.tokens_of("b") == (3, 4)
    order = list(c.resident())
    assert order.index("a") < order.index("b") and order.index("a") < order.index("c")
    dropped = c.clear()
    assert sorted(dropped) == ["a", "b", "c"]
    assert len(c) == 0 and c.tokens_of("b") is None


def test_random_operations_keep_cache_prefix_closed_and_bounded() -> None:
    rng = random.Random(7)
    c = RankCache(20)
    held: set[Any] = set()
    for _ in range(400):
        path = [(i, rng.randrange(3)) for i in range(rng.randrange(1, 8))]
        keys = [tuple(path[: i + 1]) for i in range(len(path))]  # prefix-chained keys
        if rng.random() < 0.3:
            c.match(keys, touch=True)
            continue
        res = c.insert(keys)
        held |= set(res.stored)
        held -= set(res.evicted)
        assert len(c) <= 20
        assert held == set(c.resident())  # stored/evicted reports reproduce the exact content
        for key in held:
            assert len(key) == 1 or key[:-1] in c  # parent present: prefix-closed


# ------------------------------------------------------------------------------------------ workload
def test_page_keys_share_exactly_the_common_prefix() -> None:
    a = routing.page_keys([1, 2, 3], 3 * 512)
    b = routing.page_keys([1, 2, 9], 3 * 512)
    c = routing.page_keys([7, 2, 3], 3 * 512)
    assert len(a) == 12
    assert a[:8] == b[:8] and a[8] != b[8]
    assert not set(a) & set(c)  # same later ids after a different first block: no shared keys
    assert len(routing.page_keys([1, 2], 512 + 300)) == 6  # full pages only: 4 + 2


def test_arrivals_are_scaled_to_the_target_load() -> None:
    recs = [{"timestamp": t * 1000, "input_length": 1000, "output_length": 1, "hash_ids": [t, t]} for t in range(11)]
    reqs, _ = routing.build_requests(recs, capacity_tokens_per_s=1000.0, load=0.5)
    # 11,000 tokens at half of 1,000 tokens/s -> 22 s between first and last arrival
    assert reqs[-1].arrival_s == pytest.approx(22.0)


# ------------------------------------------------------------------------------------------ simulation
def _synthetic_trace(path: Path, n_groups: int = 24, turns: int = 6, seed: int = 3) -> Path:
    """Multi-turn conversations with long private prefixes, interleaved in time: each turn extends the
    previous turn's prompt, so the hit depends on landing on the rank that served the conversation."""
    rng = random.Random(seed)
    next_id = 0
    records: list[dict[str, Any]] = []
    for g in range(n_groups):
        ids: list[int] = []
        at = rng.uniform(0, 60)
        for t in range(turns):
            for _ in range(3 if t == 0 else 1):
                ids.append(next_id)
                next_id += 1
            records.append(
                {
                    "timestamp": int(at * 1000),
                    "input_length": len(ids) * 512,
                    "output_length": 10,
                    "hash_ids": list(ids),
                    "group": g,
                }
            )
            at += rng.uniform(20, 50)  # think time between turns
    records.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_policy_runs_and_the_oracle_bounds_all(tmp_path: Path) -> None:
    trace = _synthetic_trace(tmp_path / "synthetic.jsonl")
    records = routing.load_trace(trace)
    cfg = routing.SimConfig(instances=2, ranks=4, capacity_pages=200)
    reqs, _ = routing.build_requests(records, 2 * 4 * cfg.tokens_per_s, load=0.5)
    results = routing.run(reqs, cfg, routing.ALL_POLICIES, {"trace": trace.name})
    by = {r["policy"]: r for r in results}
    assert set(by) == set(routing.ALL_POLICIES)
    for r in results:
        assert r["requests"] == len(records)
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert 0.0 <= r["hit_ratio"] <= 1.0
        assert r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert r["code"] == ("shipped" if r["policy"] in routing.SHIPPED_POLICIES else r["code"])
        assert (r["wire_batches"] > 0) == (r["policy"] in routing.SHIPPED_POLICIES)
    model = by["model_fold_pinned"]["hit_ratio"]
    assert model > by["round_robin"]["hit_ratio"]
    assert model > by["model_dp0_only"]["hit_ratio"]
    assert model > by["model_instance_affinity"]["hit_ratio"]
    assert by["fold_pinned_dispatch"]["hit_ratio"] > by["instance_affinity"]["hit_ratio"]  # the dispatcher finds hits
    assert by["oracle"]["hit_ratio"] >= max(r["hit_ratio"] for r in results)
    assert by["fold_pinned_dispatch"]["rr_dispatch_policy"] == "instance_affinity"


def test_model_dp0_only_sees_only_rank_zero() -> None:
    cl = routing.Cluster(instances=2, ranks=4, capacity_pages=100, page_size=128, tokens_per_s=1000.0)
    req = routing.Request(arrival_s=0.0, isl=1024, keys=routing.page_keys([1, 2], 1024))
    cl.ranks[1 * 4 + 3].cache.insert(req.keys)  # instance 1, rank 3 holds the prompt
    cl.ranks[1 * 4 + 0].queued_tokens = 100  # instance 1 slightly busier
    router = routing.Router(2, 4)
    assert router.model_dp0_only(cl, req) // 4 == 0  # the hit is invisible: pure load ranking
    assert router.model_instance_affinity(cl, req) // 4 == 1  # the fold sees it
    assert routing.Router(2, 4).model_fold_pinned(cl, req) == 7  # pinned to the holding rank


def _served(cl: Any, req: Any, flat: int) -> None:
    """``req`` prefilled on ``flat``: its pages published when the prefill finishes."""
    cl.dispatch(req, flat)
    cl.advance(cl.now + 1e6)


def test_shipped_router_and_dispatcher_learn_from_the_published_events() -> None:
    records = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}]
    (req,), _ = routing.build_requests(records, 1000.0, load=0.5)
    feed = routing.ShippedFeed(2, 4, 128, router=True, dp0=True, dispatch=True)
    cl = routing.Cluster(instances=2, ranks=4, capacity_pages=100, page_size=128, tokens_per_s=1000.0)
    cl.feed = feed
    _served(cl, req, 1 * 4 + 3)  # instance 1, rank 3 served it: BlockStored through the wire codec
    assert feed.batches == 1
    router = routing.Router(2, 4, feed=feed)
    assert router.fold_pinned(cl, req) == 7  # KvAffinity.select pins the rank holding it
    assert router.instance_affinity(cl, req) // 4 == 1
    assert router.fold_pinned_dispatch(cl, req) == 7  # the instance's dispatcher finds it too
    assert router.dp0_only(cl, req) // 4 in (0, 1)  # rank 0 never published it: no hit, load only
    hits = feed.dp0.query(routing.request_tokens(req)) if feed.dp0 else None
    assert hits == {"instance-0": {}, "instance-1": {}}
    assert feed.router is not None
    found = feed.router.query(routing.request_tokens(req))["instance-1"]
    assert {rank: hit.npu_blocks for rank, hit in found.items()} == {3: 8}
    feed.close()


def test_evictions_reach_the_shipped_index_as_block_removed() -> None:
    first = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
    second = {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}
    (a, b), _ = routing.build_requests([first, second], 1000.0, load=0.5)
    feed = routing.ShippedFeed(1, 1, 128, router=True, dp0=False, dispatch=False)
    cl = routing.Cluster(instances=1, ranks=1, capacity_pages=8, page_size=128, tokens_per_s=1000.0)
    cl.feed = feed
    _served(cl, a, 0)
    _served(cl, b, 0)  # 8 pages of room: a's pages are evicted for b's
    assert feed.router is not None
    assert feed.router.query(routing.request_tokens(a)) == {"instance-0": {}}
    assert feed.router.query(routing.request_tokens(b))["instance-0"][0].npu_blocks == 8
    feed.close()


def test_hotspot_guard_overrides_the_hit_when_the_holder_is_too_busy() -> None:
    cl = routing.Cluster(instances=1, ranks=4, capacity_pages=100, page_size=128, tokens_per_s=1000.0)
    req = routing.Request(arrival_s=0.0, isl=1024, keys=routing.page_keys([1, 2], 1024))
    cl.ranks[2].cache.insert(req.keys)
    cl.ranks[2].queued_tokens = 500  # busy, but the full hit still wins on Motor's cost (0 + 500 < 1024)
    assert routing.Router(1, 4).model_fold_pinned(cl, req) == 2
    assert routing.Router(1, 4, hotspot_tokens=100).model_fold_pinned(cl, req) != 2  # guard: within 100 of the idlest


def test_percentile_is_nearest_rank() -> None:
    assert routing.percentile([4, 1, 3, 2], 50) == 2
    assert routing.percentile(list(range(1, 11)), 90) == 9
    assert routing.percentile([], 50) == 0.0


def test_cli_prints_one_json_line_per_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _synthetic_trace(tmp_path / "t.jsonl", n_groups=4, turns=3)
    rc = routing.main(
        [
            "--trace",
            str(trace),
            "--instances",
            "2",
            "--ranks",
            "2",
            "--policies",
            "round_robin,fold_pinned",
            "--out-dir",
            str(tmp_path),
            "--no-plot",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["policy"] for x in lines] == ["round_robin", "fold_pinned"]
    for x in lines:
        assert x["bench"] == "routing" and x["trace"] == "t.jsonl"
        assert {"hit_ratio", "prefill_tokens", "ttft_p50_s", "ttft_p90_s", "requests"} <= set(x)


def test_cli_missing_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert routing.main(["--trace", str(tmp_path / "nope.jsonl"), "--no-plot"]) == 2
    assert "trace not found" in capsys.readouterr().err


def test_plot_written_or_skipped_with_note(tmp_path: Path) -> None:
    results = [{"policy": "a", "hit_ratio": 0.1, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0}]
    note = routing.plot(results, "t", tmp_path / "p.png")
    if note is None:
        assert (tmp_path / "p.png").stat().st_size > 0
    else:
        assert "matplotlib" in note


# ------------------------------------------------------------------------------- the default path
def test_default_path_runs_the_adapter_and_the_dispatcher_and_is_compared_with_all() -> None:
    records = routing.agentic_records(seed=1, sessions=40)
    cfg = routing.SimConfig(instances=2, ranks=4, capacity_pages=400)
    reqs, _ = routing.build_requests(records, 2 * 4 * cfg.tokens_per_s, load=0.5)
    policies = ("default", "default_motor_b2", "instance_affinity", "fold_pinned_dispatch", "oracle")
    by = {r["policy"]: r for r in routing.run(reqs, cfg, policies, {"trace": routing.AGENTIC})}
    for name in ("default", "default_motor_b2"):
        r = by[name]
        assert r["code"] == "shipped" and r["load_reports"] > 0 and r["wire_batches"] > 0
        assert r["rank_agreement"] >= 0.9  # the dispatcher took the rank the adapter scored
        assert r["best_other_shipped"] in ("instance_affinity", "fold_pinned_dispatch")
        assert r["oracle_ttft_p50_s"] == by["oracle"]["ttft_p50_s"]
        assert r["hit_ratio"] > by["instance_affinity"]["hit_ratio"]
    checked = routing.with_targets(dict(by["default"]))
    assert len(checked["targets"]) == 4  # hit ratio vs oracle, vs every other shipped policy, TTFT p50, p90


def test_agentic_sessions_come_from_the_seed_and_grow_turn_by_turn() -> None:
    records = routing.agentic_records(seed=7, sessions=30)
    assert records == routing.agentic_records(seed=7, sessions=30)
    assert records != routing.agentic_records(seed=8, sessions=30)
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    systems = set()
    for r in records:
        assert r["input_length"] <= 32768 and len(r["hash_ids"]) * 512 >= r["input_length"]
        systems.add(r["hash_ids"][0])
    assert 1 < len(systems) <= 4  # a few shared system prompts
    # A later turn of a session extends the earlier prompt: its block ids start with the earlier ones.
    extended = sum(
        1
        for a in records
        for b in records
        if b["input_length"] > a["input_length"]
        and b["hash_ids"][: len(a["hash_ids"]) - 1] == a["hash_ids"][:-1]
        and len(a["hash_ids"]) > 16
    )
    assert extended > len(records) // 2


def test_cli_agentic_workload_prints_its_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--workload", "agentic", "--sessions", "20", "--ranks", "2", "--policies", "default,oracle"]
    assert routing.main([*args, "--out-dir", str(tmp_path), "--no-plot"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["trace"] for x in lines] == ["agentic_sessions"] * 2
    assert (tmp_path / "routing_agentic_sessions.jsonl").exists()


def test_motor_models_read_the_answer_as_each_motor_does() -> None:
    cfg = routing.KvAffinityConfig(block_size=128)
    answer = {"vllm-prefill-0": {"GPU": 0, "DP": {"0": -500}}, "vllm-prefill-1": {"GPU": 256, "DP": {"0": 256}}}
    candidates = [("vllm-prefill-0", 0.0), ("vllm-prefill-1", 100.0)]
    assert routing.motor_ascend_pick(answer, candidates, 1000, cfg) == "vllm-prefill-1"  # 744+100 < 1500+0
    assert routing.motor_b2_pick(answer, candidates, 1000, cfg) == "vllm-prefill-1"
    cold = {"vllm-prefill-0": {"GPU": 0, "DP": {"0": 0}}, "vllm-prefill-1": {"GPU": 0, "DP": {"0": 0}}}
    assert routing.motor_b2_pick(cold, candidates, 1000, cfg) == "vllm-prefill-1"  # the last of equals
    assert routing.motor_ascend_pick({}, candidates, 1000, cfg) == "vllm-prefill-0"  # nothing listed: least loaded
