"""A real ``sglang.launch_server`` (CPU, --dp-size 2) with ``--plugin sglang_kvpub``, on both tree cores.

Issue #16 point 3, checks (a)-(d), and issue #21 point 2 (cache-aware dispatch, the
default, lands a repeated prompt on the rank that holds it).  One server per tree core
(module-scoped, parametrized), shared by the checks below in file order; the kill -9 check
ends each server.  The instance stream is read by a plain SUB (tests/npu's StreamRecorder);
``motor-kv-adapter serve`` runs as a subprocess registered once for the instance endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import e2e_checks as checks
import pytest
from npu.npu_engine import StreamRecorder

from sglang_kvpub import wire

from .conftest import Adapter, sglang_server, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PAGE = 16
DP = 2
MODEL = "tiny-llama"
INSTANCE = "sglang-cpu-0"
LONG = 600  # tokens of the repeated long prompt: 37 full pages + 8


@dataclass
class Rig:
    core: str
    server: sglang_server.Server
    recorder: StreamRecorder
    adapter: Adapter
    log_dir: Path


@pytest.fixture(scope="module", params=["rust", "python"])
def rig(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    core = request.param
    log_dir = tmp_path_factory.mktemp(f"server-{core}")
    server = start_server(
        model_dir,
        log_dir,
        plugin=True,
        tree_core=core,
        page_size=PAGE,
        dp_size=DP,
        max_total_tokens=4096,
        kv_events_extra={"heartbeat_s": 0.2},
    )
    recorder = StreamRecorder(server.spec.stream_endpoint, sglang_server.TOPIC)
    adapter = None
    try:
        adapter = Adapter(log_dir / "adapter.log")
        registered = adapter.call(
            "/register",
            {
                "instance_id": INSTANCE,
                "dp_rank": 0,
                "medium_endpoints": {"npu": server.spec.stream_endpoint},
                "replay_endpoint": f"tcp://127.0.0.1:{server.spec.replay_port}",
                "type": "sglang",
                "modelname": MODEL,
                "block_size": PAGE,
                "fanned_in": True,
                "dp_size": DP,
            },
        )
        assert registered["status"], registered
        yield Rig(core, server, recorder, adapter, log_dir)
    finally:
        if adapter is not None:
            adapter.stop()
        recorder.close()
        server.stop()


def _select(rig: Rig, token_ids: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "block_size": PAGE, "candidates": [{"instance_id": INSTANCE, "load": 0}]}
    decision: dict[str, Any] = rig.adapter.call("/select", {**body, "token_ids": token_ids})
    return decision


def _until(check: Any, what: str, rig: Rig, timeout_s: float = 60.0) -> Any:
    """Re-runs ``check`` until it returns a truthy value (polling with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f} s\n{rig.server.log_tail(30)}"
        time.sleep(0.1)


def _quiet(rig: Rig) -> None:
    """Waits until two instance heartbeats followed the last request: the ranks' flushes
    (each request's events, then the idle flush) have passed the fan-in."""
    start = rig.recorder.last_seq()
    _until(
        lambda: sum(1 for seq, b in rig.recorder.snapshot() if seq > start and not b.events) >= 2,
        "two heartbeats",
        rig,
    )


def test_server_info_and_start_line_name_the_tree_core(rig: Rig) -> None:
    kv = rig.server.server_info()["kv_events"]
    assert kv["fanned_in"] is True and kv["endpoint_port"] == rig.server.spec.kv_port and kv["dp_size"] == DP
    assert kv["tree_core"]["core"] == rig.core
    assert kv["plugin_failures"] == dict.fromkeys(kv["plugin_failures"], 0)
    log = rig.server.log_text()
    assert log.count(f"sglang_kvpub: {rig.core} tree core") >= DP  # one line per scheduler
    if rig.core == "rust":
        assert kv["tree_core"]["limits"] and "reconcile" in kv["tree_core"]["limits"][1]
    else:
        assert kv["tree_core"]["limits"] == []
    assert "hook failed" not in log  # guard.py's line: no plugin feature was switched off


def test_a_one_instance_stream_carries_both_ranks_tagged(rig: Rig) -> None:
    pinned = {rank: sglang_server.prompt_ids(100 + rank, 5 * PAGE + 3) for rank in range(DP)}
    for rank, ids in pinned.items():
        assert rig.server.generate(ids, dp_rank=rank)["meta_info"]["dp_rank"] == rank

    def stored(stream: Any) -> None:
        checks.check_ranks_in_one_stream(stream, range(DP))
        checks.check_seq_increasing(stream)
        for rank, ids in pinned.items():
            assert checks.check_prompt_on_rank(stream, ids, rank, PAGE) == 5

    rig.recorder.wait_for(stored, timeout=60)
    assert rig.recorder.errors == 0
    stores = [e for _, b in rig.recorder.snapshot() for e in b.events if isinstance(e, wire.BlockStored)]
    assert stores and all(e.medium == wire.MEDIUM_GPU and e.block_size == PAGE for e in stores)

    def loads_of_both_ranks(_: Any) -> None:
        # The DP controller's rank-load message (issue 33): every rank, with what it computed.
        reports = list(rig.recorder.load_reports)
        assert reports, "no rank-load message on the instance stream"
        ranks = {r.dp_rank: r for r in reports[-1].loads.ranks}
        assert set(ranks) == set(range(DP)), ranks
        assert all(r.prefill_tokens_total > 0 for r in ranks.values()), ranks

    rig.recorder.wait_for(loads_of_both_ranks, timeout=60)


def test_repeated_long_prompt_lands_on_the_holding_rank_with_cached_tokens(rig: Rig) -> None:
    """Issue #21 point 2: cache-aware dispatch (the plugin's default) sends every repeat to
    the rank that holds the prompt; SGLang reports the cached tokens."""
    ids = sglang_server.prompt_ids(7, LONG)
    first = rig.server.generate(ids)["meta_info"]
    assert first["cached_tokens"] == 0
    for _ in range(3):
        # The rank's idle flush, and with it its idle load snapshot (SGLang publishes both in
        # one step), before the repeat: sent back to back, a repeat can reach the controller
        # while the last snapshot still counts the previous request's 600 tokens, and the
        # cost (8 + 600 vs 600 + 0) rightly sends it to the idle rank (docs/dispatch.md).
        _quiet(rig)
        again = rig.server.generate(ids)["meta_info"]
        assert again["dp_rank"] == first["dp_rank"], (first, again)
        assert again["cached_tokens"] == (LONG // PAGE) * PAGE, again
    assert "reason=no_hit matched=0" not in rig.server.log_text()


def test_b_adapter_reports_the_hit_on_the_serving_rank(rig: Rig) -> None:
    ids = sglang_server.prompt_ids(8, LONG)
    cold = _select(rig, ids)
    checks.check_cold_decision(cold)
    rank = rig.server.generate(ids)["meta_info"]["dp_rank"]
    decision = _until(
        lambda: (d := _select(rig, ids))["policy"] == checks.POLICY_AFFINITY and d, "the adapter's hit", rig
    )
    figures = checks.check_affinity_decision(decision, rank, min_hbm=LONG // PAGE)
    assert figures["matched"] == (LONG // PAGE) * PAGE
    workers = rig.adapter.call("/workers")["workers"]
    assert len(workers) == 1  # subscribed once, to the instance endpoint
    streams = [h for healths in workers[0]["health"].values() for h in healths]
    assert len(streams) == 1 and streams[0]["connected"], streams


def test_c_eviction_and_flush_remove_blocks_and_the_index_follows_the_tree(rig: Rig) -> None:
    _quiet(rig)
    before = rig.recorder.last_seq()
    prompts = [sglang_server.prompt_ids(200 + n, 32 * PAGE + 5) for n in range(10)]  # 10 x 517 > 4096
    for ids in prompts:
        rig.server.generate(ids, dp_rank=0)

    def evicted(stream: Any) -> int:
        removed = sum(
            len(e.block_hashes)
            for seq, b in stream
            if seq > before and b.dp_rank == 0
            for e in b.events
            if isinstance(e, wire.BlockRemoved) and e.medium == wire.MEDIUM_GPU
        )
        assert removed > 0, "no BlockRemoved(GPU) from rank 0 under eviction"
        return removed

    rig.recorder.wait_for(evicted, timeout=60)
    # The adapter's index equals the server's tree: for each prompt, newest first (sending
    # one re-inserts it and may evict older ones), the adapter's hit on rank 0 before the
    # request equals the prefix SGLang finds cached for it.
    for ids in reversed(prompts[-4:] + prompts[:2]):
        _quiet(rig)
        predicted = _select(rig, ids)
        matched = predicted["matched"] if predicted["dp_rank"] == 0 else 0
        served = rig.server.generate(ids, dp_rank=0)["meta_info"]["cached_tokens"]
        assert (matched or 0) == served, (predicted, served)
    _quiet(rig)
    flushed = rig.recorder.last_seq()
    rig.server.flush_cache()
    rig.recorder.wait_for(
        lambda s: checks.check_released_after(s, flushed, range(DP), require_block_removed=False), timeout=60
    )
    _until(lambda: _select(rig, prompts[-1])["policy"] == checks.POLICY_LOAD_BALANCE, "an empty index", rig)


def test_d_kill_9_marks_the_instance_dead_and_drops_its_blocks(rig: Rig) -> None:
    ids = sglang_server.prompt_ids(9, LONG)
    rig.server.generate(ids)
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_AFFINITY, "the adapter's hit", rig)
    rig.server.kill9()
    assert not rig.server.alive()

    def dead() -> bool:
        workers = rig.adapter.call("/workers")["workers"]
        healths = [h for w in workers for hs in w["health"].values() for h in hs]
        return bool(healths) and not any(h["connected"] for h in healths)

    _until(dead, "the instance marked dead", rig, timeout_s=30)
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_LOAD_BALANCE, "its blocks dropped", rig, 30)
    assert "marked dead, its blocks dropped" in (rig.log_dir / "adapter.log").read_text()
