"""The built-in rank simulator (unit) and ``sglang-kvpub demo`` end to end (integration)."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.demo import Demo, Request
from sglang_kvpub.tools.simulator import Dispatch, PrefillResult, SimulatedInstance, SimulatedRank, engine_block_hashes
from sglang_kvpub.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, split_stored
from tests import e2e_checks
from tests.conftest import free_tcp_endpoint

PAGE = 4
ROOT = Path(__file__).resolve().parents[2]


def _sglang_hash(pages: list[list[int]]) -> list[int]:
    """SGLang 0.5.23's documented scheme, spelled the way its code does it: hex digests, then
    ``hash_str_to_int64`` (first 16 hex chars, big-endian, as signed int64)."""
    out: list[int] = []
    prev = b""
    for page in pages:
        digest = hashlib.sha256(prev + b"".join(t.to_bytes(4, "little") for t in page))
        value = int(digest.hexdigest()[:16], 16)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
        prev = digest.digest()
    return out


def _replay(events: list[Any], state: set[int]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            state.update(h for h, _ in split_stored(event))
        elif isinstance(event, BlockRemoved):
            state.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            state.clear()


# --------------------------------------------------------------------------- simulator (unit)


@pytest.mark.unit
def test_block_hashes_follow_sglang_chained_sha256() -> None:
    tokens = [1, 2, 3, 4, 70000, 6, 7, 8, 9]
    assert engine_block_hashes(tokens, PAGE) == _sglang_hash([[1, 2, 3, 4], [70000, 6, 7, 8]])
    # chained: the same page after another prefix hashes differently
    assert engine_block_hashes([9, 9, 9, 9, 70000, 6, 7, 8], PAGE)[1] != engine_block_hashes(tokens, PAGE)[1]
    with pytest.raises(ValueError):
        engine_block_hashes([1 << 32, 0, 0, 0], PAGE)


@pytest.mark.unit
def test_prefill_emits_one_merged_store_then_hits() -> None:
    published: list[EventBatch] = []
    rank = SimulatedRank(3, capacity_pages=16, page_size=PAGE, publish=published.append)
    prompt = list(range(10, 20))  # 2 full pages + 2 tokens
    first = rank.prefill(prompt)
    assert (first.cached_tokens, first.stored_pages, first.evicted_pages) == (0, 2, 0)
    assert len(published) == 1 and published[0].dp_rank is None  # the publisher stamps the rank
    (stored,) = published[0].events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == engine_block_hashes(prompt, PAGE) and stored.parent_block_hash is None
    assert stored.token_ids == prompt[:8] and stored.block_size == PAGE and stored.medium == "GPU"

    again = rank.prefill(prompt)
    assert again.cached_tokens == 8 and again.batch is None and len(published) == 1

    longer = rank.prefill([*prompt[:8], 5, 5, 5, 5])
    assert longer.cached_tokens == 8
    (ext,) = published[-1].events
    assert isinstance(ext, BlockStored)
    assert ext.parent_block_hash == stored.block_hashes[-1] and ext.token_ids == [5, 5, 5, 5]
    assert rank.cached_tokens(prompt) == 8 and rank.hit_tokens == 16


@pytest.mark.unit
def test_eviction_and_flush_events_rebuild_the_cache_exactly() -> None:
    published: list[EventBatch] = []
    rank = SimulatedRank(0, capacity_pages=5, page_size=PAGE, publish=published.append)
    state: set[int] = set()
    for seed in range(6):
        rank.prefill([seed * 100 + i for i in range(3 * PAGE)])
        _replay(published[-1].events, state)
        assert state == set(rank.resident_hashes())
    removed = [e for b in published for e in b.events if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "GPU" for e in removed)
    assert rank.evicted_pages == sum(len(e.block_hashes) for e in removed)
    resident = rank.resident_pages()
    cleared = rank.flush()
    assert isinstance(cleared.events[0], AllBlocksCleared) and rank.resident_pages() == 0
    assert rank.cleared_pages == resident


# --------------------------------------------------------------------------- acceptance check (unit)


class _Rank:
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank


class _Instance:
    ranks = [_Rank(0), _Rank(1)]


def _req(req_id: str, policy: str, matched: int | None, dp_rank: int | None, engine_rank: int, cached: int) -> Request:
    decision = {"policy": policy, "matched": matched, "hbm": matched, "dp_rank": dp_rank, "reason": None}
    result = PrefillResult(engine_rank, 3000, cached, 0, 0, None)
    return Request(
        req_id, "repeat", 3000, decision, "vllm-prefill-0", Dispatch(engine_rank, dp_rank is not None, result), 0.0
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("hot", "ok", "words"),
    [
        (_req("r2", "kv_cache_affinity", 2944, 1, 1, 2944), True, "holds the prefix"),
        (_req("r2", "load_balance", None, None, 0, 0), False, "policy=load_balance"),
        (_req("r2", "kv_cache_affinity", 2944, 0, 0, 0), False, "prefix is on vllm-prefill-0 dp_rank=1"),
        (_req("r2", "kv_cache_affinity", 1280, 1, 1, 1280), False, "matched=1280"),
    ],
)
def test_hot_request_check_names_the_failure(hot: Request, ok: bool, words: str) -> None:
    demo = Demo(argparse.Namespace(page_size=128), sys.stdout)
    demo.instances = {"vllm-prefill-0": _Instance()}  # type: ignore[dict-item]
    cold = _req("r1", "load_balance", None, None, 1, 0)
    passed, reason = demo._check_hot(cold, hot)
    assert passed is ok and words in reason


# --------------------------------------------------------------------------- simulated instance (integration)


class _Tap:
    """A plain SUB on the instance stream recording ``(seq, EventBatch)`` as a router sees them."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.stream: list[tuple[int, EventBatch]] = []
        self._decoder = wire.BatchDecoder()

    def read_until(self, seq: int, timeout_s: float = 10.0) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not self.stream or self.stream[-1][0] < seq:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"stream stopped at {self.stream[-1][0] if self.stream else None}, wanted {seq}"
            if poller.poll(left_ms):
                _, got, payload = wire.parse_live_frames(self.sock.recv_multipart())
                self.stream.append((got, self._decoder.decode(payload)))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_simulated_instance_stream_passes_the_shared_e2e_checks() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    config = PluginConfig(
        endpoint=free_tcp_endpoint(), replay_endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.05
    )
    instance = SimulatedInstance(config, dp_size=3, capacity_pages=6, page_size=128, context=ctx)
    tap = _Tap(ctx, config.endpoint)
    try:
        tap.read_until(0)  # connected: a heartbeat arrived (PUB drops what a SUB missed before)
        joined = tap.stream[-1][0]
        prompt = [(7 * i) % 50_000 for i in range(640)]  # 5 pages
        for _ in range(3):
            instance.dispatch(prompt)  # round-robin: ranks 0, 1, 2
        pressure = instance.dispatch([3] * 512, routed_dp_rank=0)  # 4 more pages on a 6-page rank
        assert pressure.result.evicted_pages == 3

        def caught_up() -> int:
            deadline = time.monotonic() + 10
            while not instance.delivered():
                assert time.monotonic() < deadline
                time.sleep(0.002)
            return instance.stream_seq()

        tap.read_until(caught_up())
        live = [item for item in tap.stream if item[0] > joined]
        e2e_checks.check_seq_increasing(live)
        e2e_checks.check_ranks_in_one_stream(live, [0, 1, 2])
        e2e_checks.check_stored_blocks(live, block_size=128, ranks=[0, 1, 2])
        for dp_rank in (1, 2):
            assert e2e_checks.check_prompt_on_rank(live, prompt, dp_rank) == 5
        resident = e2e_checks.resident_blocks(live)
        for rank in instance.ranks:
            assert resident[rank.dp_rank] == {wire.to_u64(h) for h in rank.resident_hashes()}

        before_flush = tap.stream[-1][0]
        instance.flush_cache()
        tap.read_until(caught_up())
        e2e_checks.check_released_after(tap.stream, before_flush, [0, 1, 2], require_block_removed=False)
    finally:
        tap.sock.close()
        instance.close()
        ctx.term()


# --------------------------------------------------------------------------- the demo (integration)


def _run_demo(*extra: str) -> tuple[int, dict[str, Any], str]:
    cmd = [
        sys.executable,
        "-m",
        "sglang_kvpub.cli",
        "demo",
        "--ranks",
        "2",
        "--prompt-tokens",
        "3000",
        "--json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_demo_second_identical_request_hits_the_rank_holding_the_prefix() -> None:
    code, summary, log = _run_demo()
    assert code == 0, log
    assert summary["ok"] is True
    requests = {r["req_id"]: r for r in summary["requests"]}
    cold, hot = requests["r1"], requests["r2"]
    e2e_checks.check_cold_decision(cold)
    e2e_checks.check_affinity_decision(hot, cold["engine_dp_rank"], min_hbm=2560)
    assert "policy=load_balance matched=None" in log
    assert hot["policy"] == "kv_cache_affinity"
    assert hot["matched"] >= 2560 and hot["hbm"] >= 2560
    assert hot["instance"] == cold["instance"] and hot["dp_rank"] == cold["engine_dp_rank"]
    assert hot["engine_dp_rank"] == hot["dp_rank"] and hot["pinned"] and hot["cached_tokens"] == hot["matched"]
    assert (
        f"policy=kv_cache_affinity matched={hot['matched']} hbm={hot['hbm']} cpu=0 disk=0 dp_rank={hot['dp_rank']}"
        in log
    )
    assert any('"npu_blocks": 23' in line for line in summary["conductor_query_responses"])
    # the spread prompts: cold ones load-balanced, their repeats pinned to their ranks
    spread = [r for r in summary["requests"] if r["phase"] == "spread"]
    repeats = [r for r in summary["requests"] if r["phase"] == "spread-repeat"]
    assert spread and all(r["policy"] == "load_balance" for r in spread)
    for first, again in zip(spread, repeats, strict=True):
        assert again["policy"] == "kv_cache_affinity"
        assert (again["instance"], again["dp_rank"]) == (first["instance"], first["engine_dp_rank"])
        assert again["cached_tokens"] == again["matched"] > 0
    assert {r["engine_dp_rank"] for r in spread} == {0, 1}  # round-robin reached every rank
    for stream in summary["streams"].values():
        assert stream["adapter_gaps"] == 0 and stream["adapter_decode_errors"] == 0
        assert stream["adapter_last_seq"] >= 0
    for row in summary["ranks_detail"]:
        assert row["channel_gaps"] == 0 and row["resident_pages"] == row["stream_resident_pages"]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_demo_refuses_an_hbm_too_small_for_the_prompt() -> None:
    code, summary, log = _run_demo("--hbm-pages", "4")
    assert code == 1 and not summary
    assert "cannot hold one 3000-token prompt" in log


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_with_sglang_own_event_structs() -> None:
    pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="sglang 0.5.23 not importable here")
    code, summary, log = _run_demo("--engine", "sglang", "--instances", "1")
    assert code == 0, log
    assert "SGLang's own structs" in summary["event_classes"]
    hot = {r["req_id"]: r for r in summary["requests"]}["r2"]
    e2e_checks.check_affinity_decision(hot, hot["engine_dp_rank"], min_hbm=2560)
