"""A real ``sglang.launch_server`` (CPU, --dp-size 2) with ``--plugin sglang_kvpub``, on both tree cores.

The plugin's promises on a real server, checks (a)-(d), and cache-aware dispatch (the
default) landing a repeated prompt on the rank that holds it.  One server per tree core
(module-scoped, parametrized), shared by the checks below in file order; the kill -9 check
ends each server.  The instance stream is read by a plain SUB (tests/npu's StreamRecorder);
``motor-kv-adapter serve`` runs as a subprocess registered once for the instance endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e_checks as checks
import pytest

from sglang_kvpub import wire

from .conftest import PluginRig, plugin_rig, sglang_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PAGE = 16
DP = 2
MODEL = "tiny-llama"
INSTANCE = "sglang-cpu-0"
LONG = 600  # tokens of the repeated long prompt: 37 full pages + 8


@pytest.fixture(scope="module", params=["rust", "python"])
def rig(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PluginRig]:
    core = request.param
    log_dir = tmp_path_factory.mktemp(f"server-{core}")
    with plugin_rig(
        model_dir, log_dir, instance=INSTANCE, model_name=MODEL, page=PAGE, dp_size=DP, tree_core=core
    ) as made:
        yield made


def test_server_info_and_start_line_name_the_tree_core(rig: PluginRig) -> None:
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


def test_a_one_instance_stream_carries_both_ranks_tagged(rig: PluginRig) -> None:
    rig.one_stream_carries_every_rank(100, DP, timeout_s=60)
    stores = [e for _, b in rig.recorder.snapshot() for e in b.events if isinstance(e, wire.BlockStored)]
    assert stores and all(e.medium == wire.MEDIUM_GPU and e.block_size == PAGE for e in stores)

    def loads_of_both_ranks(_: Any) -> None:
        # The DP controller's rank-load message: every rank, with what it computed.
        reports = list(rig.recorder.load_reports)
        assert reports, "no rank-load message on the instance stream"
        ranks = {r.dp_rank: r for r in reports[-1].loads.ranks}
        assert set(ranks) == set(range(DP)), ranks
        assert all(r.prefill_tokens_total > 0 for r in ranks.values()), ranks

    rig.recorder.wait_for(loads_of_both_ranks, timeout=60)


def test_repeated_long_prompt_lands_on_the_holding_rank_with_cached_tokens(rig: PluginRig) -> None:
    """Cache-aware dispatch (the plugin's default) sends every repeat to
    the rank that holds the prompt; SGLang reports the cached tokens."""
    ids = sglang_server.prompt_ids(7, LONG)
    first = rig.server.generate(ids)["meta_info"]
    assert first["cached_tokens"] == 0
    for _ in range(3):
        # The rank's idle flush, and with it its idle load snapshot (SGLang publishes both in
        # one step), before the repeat: sent back to back, a repeat can reach the controller
        # while the last snapshot still counts the previous request's 600 tokens, and the
        # cost (8 + 600 vs 600 + 0) rightly sends it to the idle rank (docs/dispatch.md).
        rig.quiet()
        again = rig.server.generate(ids)["meta_info"]
        assert again["dp_rank"] == first["dp_rank"], (first, again)
        assert again["cached_tokens"] == (LONG // PAGE) * PAGE, again
    assert "reason=no_hit matched=0" not in rig.server.log_text()


def test_b_adapter_reports_the_hit_on_the_serving_rank(rig: PluginRig) -> None:
    ids = sglang_server.prompt_ids(8, LONG)
    cold = rig.select(ids)
    checks.check_cold_decision(cold)
    rank = rig.server.generate(ids)["meta_info"]["dp_rank"]
    decision = rig.until(lambda: (d := rig.select(ids))["policy"] == checks.POLICY_AFFINITY and d, "the adapter's hit")
    figures = checks.check_affinity_decision(decision, rank, min_hbm=LONG // PAGE)
    assert figures["matched"] == (LONG // PAGE) * PAGE
    workers = rig.adapter.call("/workers")["workers"]
    assert len(workers) == 1  # subscribed once, to the instance endpoint
    streams = [h for healths in workers[0]["health"].values() for h in healths]
    assert len(streams) == 1 and streams[0]["connected"], streams


def test_c_eviction_and_flush_remove_blocks_and_the_index_follows_the_tree(rig: PluginRig) -> None:
    rig.quiet()
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
        rig.quiet()
        predicted = rig.select(ids)
        matched = predicted["matched"] if predicted["dp_rank"] == 0 else 0
        served = rig.server.generate(ids, dp_rank=0)["meta_info"]["cached_tokens"]
        assert (matched or 0) == served, (predicted, served)
    rig.quiet()
    flushed = rig.recorder.last_seq()
    rig.server.flush_cache()
    rig.recorder.wait_for(
        lambda s: checks.check_released_after(s, flushed, range(DP), require_block_removed=False), timeout=60
    )
    rig.until(lambda: rig.select(prompts[-1])["policy"] == checks.POLICY_LOAD_BALANCE, "an empty index")


def test_d_kill_9_marks_the_instance_dead_and_drops_its_blocks(rig: PluginRig) -> None:
    ids = sglang_server.prompt_ids(9, LONG)
    rig.server.generate(ids)
    rig.kill9_seen_dead(ids, timeout_s=30)
