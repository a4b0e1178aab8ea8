"""Cache-aware DP dispatch: decisions, the fan-in feed, and the REAL SGLang
0.5.23 DataParallelController dispatch path (in a child process: it needs the full import)."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sglang_kvpub.core.dispatch import (
    REASON_CACHE_HIT,
    REASON_HOTSPOT,
    REASON_NO_CANDIDATES,
    REASON_NO_HIT,
    REASON_SHORT_PROMPT,
    CacheAwareDispatcher,
    InflightLoad,
)
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.core.rank_cost import spread_key, spread_start
from sglang_kvpub.engine.dispatch_hook import feed_from_fanin
from sglang_kvpub.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

TESTS = Path(__file__).resolve().parents[1]
RANKS = 16
BLOCK = 128


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 150_000 for i in range(n)]


def _store(d: CacheAwareDispatcher, rank: int, tokens: list[int], first_hash: int = 1, medium: str = "GPU") -> None:
    blocks = len(tokens) // d.block_size
    event = BlockStored(
        list(range(first_hash, first_hash + blocks)), None, tokens[: blocks * d.block_size], d.block_size
    )
    event.medium = medium
    d.observe(EventBatch(time.time(), [event], rank))


# --------------------------------------------------------------------------- decisions


@pytest.mark.unit
def test_report_scenario_lands_on_the_holding_rank_every_time() -> None:
    d = CacheAwareDispatcher(RANKS, BLOCK)
    prefix = _tokens(20 * BLOCK)  # 2560 tokens held by rank 7 only
    _store(d, 7, prefix)
    for n in range(50):
        prompt = array("q", prefix + _tokens(2500, salt=n + 1))
        loads = [1000.0 + (n * 37 + r * 11) % 200 for r in range(RANKS)]  # small, shifting noise
        decision = d.choose(prompt, loads)
        assert decision.rank == 7
        assert decision.reason == REASON_CACHE_HIT
        assert decision.matched_tokens == 2560
        assert decision.npu_blocks == 20
    assert d.stats()["decisions"][REASON_CACHE_HIT] == 50
    assert "policy=cache_aware dp_rank=7" in decision.log_line()


@pytest.mark.unit
def test_longest_prefix_wins_and_cpu_blocks_count_disk_not() -> None:
    d = CacheAwareDispatcher(4, BLOCK)
    prompt = _tokens(10 * BLOCK)
    _store(d, 1, prompt[: 4 * BLOCK])
    _store(d, 2, prompt[: 8 * BLOCK], first_hash=100, medium="CPU_PINNED")
    _store(d, 3, prompt, first_hash=200, medium="DISK")  # w_disk = 0 (Motor's default)
    decision = d.choose(prompt, [0.0] * 4)
    assert (decision.rank, decision.matched_tokens, decision.cpu_blocks) == (2, 8 * BLOCK, 8)


@pytest.mark.unit
def test_load_outweighs_a_small_hit() -> None:
    d = CacheAwareDispatcher(4, BLOCK)
    prompt = _tokens(10 * BLOCK)
    _store(d, 0, prompt[:BLOCK])
    decision = d.choose(prompt, [5000.0, 0.0, 100.0, 100.0])  # 128 cached tokens vs 5000 of load
    assert decision.rank == 1
    assert decision.reason == REASON_NO_HIT


@pytest.mark.unit
def test_hotspot_guard_spills_to_least_loaded_under_skew() -> None:
    d = CacheAwareDispatcher(RANKS, BLOCK, load_weight=0.05, hotspot_spread=16384, hotspot_relative=1.0)
    prefix = _tokens(20 * BLOCK)
    _store(d, 7, prefix)
    loads = [2000.0] * RANKS
    loads[2] = 0.0
    picks = []
    for step in range(8):
        loads[7] = step * 6000.0
        decision = d.choose(prefix + _tokens(100, salt=step + 1), loads)
        picks.append((decision.rank, decision.reason))
    # Spread over the least loaded: 0..12000 stays (<= 16384), 18000.. spills to rank 2.
    assert picks[:3] == [(7, REASON_CACHE_HIT)] * 3
    assert picks[3:] == [(2, REASON_HOTSPOT)] * 5
    assert d.stats()["decisions"][REASON_HOTSPOT] == 5


@pytest.mark.unit
def test_relative_guard_and_guard_off() -> None:
    prefix = _tokens(4 * BLOCK)
    loads = [100.0, 100.0, 100.0, 1000.0]
    guarded = CacheAwareDispatcher(4, BLOCK, load_weight=0.0, hotspot_spread=None, hotspot_relative=1.0)
    free = CacheAwareDispatcher(4, BLOCK, load_weight=0.0, hotspot_spread=None, hotspot_relative=None)
    for d in (guarded, free):
        _store(d, 3, prefix)
    # mean load 325: rank 3's spread 900 > 1.0 * 325 -> spill; without a guard it stays.
    assert guarded.choose(prefix, loads).reason == REASON_HOTSPOT
    assert free.choose(prefix, loads).rank == 3


@pytest.mark.unit
def test_short_prompts_go_to_the_least_loaded_and_no_candidates_use_the_default_policy() -> None:
    d = CacheAwareDispatcher(4, BLOCK)
    _store(d, 1, _tokens(2 * BLOCK))
    short = d.choose(_tokens(BLOCK - 1), [5.0, 0.0, 9.0, 3.0])
    assert (short.rank, short.reason, short.matched_tokens) == (1, REASON_SHORT_PROMPT, 0)
    prompt = _tokens(BLOCK - 1)
    even = d.choose(prompt, [0.0] * 4)  # equal loads: the prompt's own start, not always rank 0
    assert (even.rank, even.reason) == (spread_start(spread_key(prompt, BLOCK), 4), REASON_SHORT_PROMPT)
    none = d.choose(_tokens(2 * BLOCK), [0.0] * 4, candidates=[])
    assert (none.rank, none.reason) == (None, REASON_NO_CANDIDATES)
    assert d.choose(_tokens(2 * BLOCK), [0.0] * 4, candidates=[0, 2]).rank in (0, 2)


@pytest.mark.unit
def test_cold_prompts_spread_over_equally_loaded_ranks() -> None:
    """Equal (zero) loads: each cold prompt goes where its own tie-break key starts the scan, so
    distinct prompts spread over every rank (a real server once sent them all to rank 1), and a
    prompt goes to the same rank every time (the adapter computes the same start)."""
    d = CacheAwareDispatcher(RANKS, BLOCK)
    prompts = [_tokens(3 * BLOCK, salt=n) for n in range(16 * RANKS)]
    chosen = [d.choose(p, [0.0] * RANKS).rank for p in prompts]
    counts = collections.Counter(chosen)
    assert set(counts) == set(range(RANKS))
    assert max(counts.values()) <= 4 * len(prompts) // RANKS  # no rank takes a pile
    assert chosen == [d.choose(p, [0.0] * RANKS).rank for p in prompts]
    assert chosen == [spread_start(spread_key(p, BLOCK), RANKS) for p in prompts]


@pytest.mark.unit
def test_large_merged_store_is_applied_in_chunks_and_still_chains() -> None:
    d = CacheAwareDispatcher(2, 16, observe_chunk_blocks=8)
    prompt = _tokens(100 * 16)
    applied = []
    original = d.index.apply_batch

    def spy(instance: str, batch: EventBatch, dp_rank: int | None = None) -> Any:
        applied.append(sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored)))
        return original(instance, batch, dp_rank)

    d.index.apply_batch = spy  # type: ignore[method-assign]
    _store(d, 1, prompt)
    assert max(applied) <= 8 and sum(applied) == 100
    assert d.choose(prompt, [0.0, 0.0]).matched_tokens == 100 * 16
    d.observe(EventBatch(time.time(), [BlockRemoved([50])], 1))  # cut the chain at block 50
    assert d.choose(prompt, [0.0, 0.0]).matched_tokens == 49 * 16
    d.observe(EventBatch(time.time(), [AllBlocksCleared()], 1))
    assert d.choose(prompt, [0.0, 0.0]).reason == REASON_NO_HIT


@pytest.mark.unit
def test_shared_index_is_queried_for_this_instance_only() -> None:
    index = PrefixIndex(BLOCK)
    prompt = _tokens(4 * BLOCK)
    other = EventBatch(time.time(), [BlockStored([1, 2, 3, 4], None, prompt, BLOCK, medium="GPU")], 5)
    index.apply_batch("other-instance", other)
    d = CacheAwareDispatcher(8, BLOCK, index=index, instance="me")
    assert d.choose(prompt, [0.0] * 8).reason == REASON_NO_HIT
    _store(d, 6, prompt)
    assert d.choose(prompt, [0.0] * 8).rank == 6
    with pytest.raises(ValueError):
        CacheAwareDispatcher(8, 64, index=index)


@pytest.mark.unit
def test_inflight_load_decays() -> None:
    load = InflightLoad(2, half_life_s=1.0)
    load.add(1, 1000.0, now=10.0)
    assert load.values(now=10.0) == [0.0, 1000.0]
    assert load.values(now=11.0)[1] == pytest.approx(500.0)


def _reference(d: CacheAwareDispatcher, tokens: list[int], loads: list[float], candidates: list[int] | None,
               lora: str | None, start: int) -> tuple[Any, ...]:  # fmt: skip
    """The decision rule spelled out on the index's general query (rank order rotated by ``start``)."""
    isl = len(tokens)
    ranks = [r for r in (range(d.dp_size) if candidates is None else candidates) if 0 <= r < len(loads)]
    order = ranks[start:] + ranks[:start]
    hits = d.index.query(tokens, lora_name=lora, instances=[d.instance]).get(d.instance, {})

    def matched(rank: int) -> int:
        hit = hits.get(rank)
        if hit is None:
            return 0
        weighted = hit.npu_blocks * d.weights[0] + hit.cpu_blocks * d.weights[1] + hit.disk_blocks * d.weights[2]
        return min(round(weighted * d.block_size), isl)

    def cost(rank: int) -> float:
        return d.prefill_load_scale * max(0.0, isl - d.overlap_credit * matched(rank)) + d.load_weight * loads[rank]

    best = min(order, key=cost)  # first among equals
    reason = REASON_CACHE_HIT if matched(best) > 0 else REASON_NO_HIT
    least = min(order, key=loads.__getitem__)
    limit = max(d.hotspot_spread or 0.0, (d.hotspot_relative or 0.0) * sum(loads[r] for r in order) / len(order))
    if loads[best] - loads[least] > limit:
        best, reason = least, REASON_HOTSPOT
    hit = hits.get(best)
    tiers = (hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks) if hit else (0, 0, 0)
    return (best, reason, matched(best), *tiers, float(loads[best]), cost(best))


@pytest.mark.unit
def test_decisions_equal_the_rule_on_the_general_query_on_random_data() -> None:
    rng = random.Random(11)
    d = CacheAwareDispatcher(8, 16, hotspot_spread=100.0, hotspot_relative=0.5, w_disk=0.5, load_weight=0.1)
    heads = [[rng.randrange(100) for _ in range(3 * 16)] for _ in range(3)]
    prompts = [rng.choice(heads) + [rng.randrange(100) for _ in range(rng.randrange(0, 8) * 16)] for _ in range(20)]
    engine_id = 1
    for step in range(400):
        toks, rank = rng.choice(prompts), rng.randrange(8)
        blocks = len(toks) // 16
        if rng.random() < 0.8:
            count = rng.randrange(1, blocks + 1)
            medium = rng.choice(["GPU", "GPU", "CPU_PINNED", "DISK"])
            lora = rng.choice([None, None, "adapter"])
            event = BlockStored(list(range(engine_id, engine_id + count)), None, toks[: count * 16], 16, medium=medium,
                                lora_name=lora)  # fmt: skip
            engine_id += count
            d.observe(EventBatch(0.0, [event], rank))
        else:
            d.observe(EventBatch(0.0, [BlockRemoved([rng.randrange(engine_id)])], rank))
        query = rng.choice(prompts)[: rng.randrange(1, 12) * 16 + rng.randrange(16)] + [rng.randrange(100)] * 40
        loads = [float(rng.choice([0, 50, 100, 400, 900])) for _ in range(8)]
        candidates = rng.choice([None, list(range(8)), [1, 3, 5, 6], [7, 2, 9]])
        lora = rng.choice([None, "adapter"])
        prompt = array("q", query) if step % 2 else query
        expected_ranks = [r for r in (range(8) if candidates is None else candidates) if 0 <= r < 8]
        start = spread_start(spread_key(query, 16), len(expected_ranks))
        expected = _reference(d, query, loads, candidates, lora, start)
        got = d.choose(prompt, loads, candidates=candidates, lora_name=lora)
        assert (got.rank, got.reason, got.matched_tokens, got.npu_blocks, got.cpu_blocks, got.disk_blocks,
                got.load, got.cost) == expected  # fmt: skip


@pytest.mark.unit
def test_cold_prompt_hashes_only_its_first_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang_kvpub.core.hashing as hashing_module
    import sglang_kvpub.core.index as index_module

    monkeypatch.setattr(hashing_module, "NATIVE", None)  # the Python walk (the C one: tests/index/test_native.py)
    d = CacheAwareDispatcher(4, BLOCK)
    held = _tokens(6 * BLOCK)
    _store(d, 2, held[: 2 * BLOCK])
    calls: list[int] = []
    real = index_module._xxh3

    def counting(data: Any, seed: int = 0) -> int:
        calls.append(1)
        return real(data, seed)

    monkeypatch.setattr(index_module, "_xxh3", counting)  # the walk hashes (local + chain) per block it reaches
    assert d.choose(_tokens(48 * BLOCK, salt=9), [0.0] * 4).reason == REASON_NO_HIT
    assert len(calls) == 2  # block 0 held by no rank: nothing more hashed
    calls.clear()
    decision = d.choose(held + _tokens(42 * BLOCK, salt=9), [0.0] * 4)
    assert (decision.rank, decision.matched_tokens) == (2, 2 * BLOCK)
    assert len(calls) == 2 * 3  # blocks 0, 1 held; block 2 held by no rank: the walk stopped there


# --------------------------------------------------------------------------- fan-in feed


@pytest.mark.integration
def test_feed_through_the_fanin_ingest_path_decodes_and_clears_on_restart() -> None:
    """The sidecar's path (``FanIn.ingest``) goes through the same per-message step as the
    live channel (tests/engine/test_dispatch_feed.py): payloads indexed, heartbeats and garbage
    skipped, a new rank epoch clears the rank."""
    from conftest import free_tcp_endpoint

    from sglang_kvpub.config import PluginConfig
    from sglang_kvpub.publish.fanin import FanIn

    fanin = FanIn(PluginConfig(endpoint=free_tcp_endpoint(), bind=True), 4, listen_channel=False)
    fanin.start()
    try:
        d = CacheAwareDispatcher(4, BLOCK)
        assert feed_from_fanin(fanin, d) == "observer"
        prompt = _tokens(3 * BLOCK)
        stored = BlockStored([1, 2, 3], None, prompt, BLOCK, medium="GPU")
        payload = msgspec.msgpack.encode(EventBatch(1.0, [stored], 2))
        fanin.ingest(2, 111, 0, payload)
        fanin.ingest(2, 111, 1, b"")  # rank heartbeat
        fanin.ingest(2, 111, 2, b"\xc1garbage")  # malformed: counted by the fan-in, not raised
        assert d.choose(prompt, [0.0] * 4).rank == 2
        fanin.ingest(3, 5, 0, EventBatch(1.0, [BlockStored([9], None, _tokens(BLOCK, salt=5), BLOCK, medium="GPU")], 3))
        assert d.index.stats().blocks == 4
        fanin.ingest(2, 222, 0, b"")  # new rank epoch: the rank's cache is gone
        assert d.choose(prompt, [0.0] * 4).reason == REASON_NO_HIT
        assert fanin.stats()["malformed"] == 1
    finally:
        fanin.stop()


# --------------------------------------------------------------------------- real SGLang


@pytest.fixture(scope="module")
def sglang_run() -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    import sglang_real

    reason = sglang_real._skip_reason(sglang_real.MANAGER_DEPS, "DataParallelController")
    if reason and os.environ.get("KVPUB_REQUIRE_SGLANG") != "1":
        pytest.skip(reason)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "dispatch_sglang_child.py")],
        capture_output=True,
        text=True,
        timeout=280,
        env=sglang_real.child_env("full"),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


METHODS = ("round_robin", "total_requests", "total_tokens")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_real_controller_hooks_are_applied_and_inert_without_a_dispatcher(sglang_run: dict[str, Any]) -> None:
    assert sglang_run["patched"] is True
    assert sglang_run["inert"] == [0, 1, 2, 3]  # SGLang's own round robin


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_real_controller_sends_the_hot_prefix_to_rank_7_every_time(sglang_run: dict[str, Any], method: str) -> None:
    run = sglang_run[method]
    assert run["hot"] == [7] * 32
    # BatchTokenizedGenerateReqInput goes through the same hook (one load refresh per batch,
    # speculative commits in between: a burst of 2 still fits on rank 7)
    assert run["batch"] == [7, 7]
    assert run["stats"]["cache_hit"] == 34


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_real_controller_respects_explicit_ranks(sglang_run: dict[str, Any], method: str) -> None:
    assert sglang_run[method]["explicit"] == [3, 7, 12]
    assert sglang_run[method]["stats"]["explicit"] == 3


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_real_controller_short_prompts_go_to_the_least_loaded_rank(sglang_run: dict[str, Any]) -> None:
    # Equal loads (every request sees a new snapshot, which covers the commits): the same short
    # prompt goes where its own key starts the scan, every time.
    expected = spread_start(spread_key(list(range(BLOCK - 1)), BLOCK), RANKS)
    for method in METHODS:
        assert sglang_run[method]["short"] == [expected] * 4
        assert sglang_run[method]["stats"]["short_prompt"] == 4


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_real_controller_guard_spills_under_skew(sglang_run: dict[str, Any], method: str) -> None:
    skew = sglang_run[method]["skew"]
    assert [s["rank"] for s in skew] == [7, 7, 7, 2, 2, 2, 2, 2]
    assert sglang_run[method]["skew_stats"]["hotspot"] == 5
