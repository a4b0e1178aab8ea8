"""The report's dp 16 in a real CPU server: ``--dp-size 16 --plugin sglang_kvpub --sleep-on-idle``.

Issue #32 point 1, as a new user runs it (tiny model from bench/sglang_server.py, one
OpenMP core group per rank in ``SGLANG_CPU_OMP_THREADS_BIND``): one instance stream carries
every rank that served, a repeated prompt is dispatched to the rank holding it, a flush
empties the adapter's index, a ``kill -9`` of the server is seen by the adapter as the
instance dead.  Marked ``slow`` (16 schedulers take ~13 GB and minutes to start: CI's
``-m "not slow"`` leaves it out); run it under the shared lock:

    flock /work/tools/heavy.lock python -m pytest -m slow tests/server/test_server_dp16.py -q -s

``--mem-fraction-static 0.5``: on CPU the check is against the host's free memory, which 16
ranks loading at once (and anything else on the host) shrink while each rank measures it;
``--max-total-tokens`` still caps each rank's pool.  Start time and the memory of each rank's
process are printed (``-s``) and in
``bench/dp16.py``'s line.
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

from .conftest import Adapter, sglang_server, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(3600)]

PAGE = 16
DP = 16
MODEL = "tiny-llama"
INSTANCE = "sglang-cpu-dp16"
LONG = 600  # tokens of the repeated prompt: 37 full pages + 8


@dataclass
class Rig:
    server: sglang_server.Server
    recorder: StreamRecorder
    adapter: Adapter
    log_dir: Path


@pytest.fixture(scope="module")
def rig(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    log_dir = tmp_path_factory.mktemp("server-dp16")
    server = start_server(
        model_dir,
        log_dir,
        plugin=True,
        page_size=PAGE,
        dp_size=DP,
        max_total_tokens=4096,
        kv_events_extra={"heartbeat_s": 0.2},
        extra_args=("--sleep-on-idle", "--mem-fraction-static", "0.5"),
    )
    print(f"\ndp16 server ready in {server.started_s:.0f} s; {sglang_server.memory_report(server)}")
    recorder = StreamRecorder(server.spec.stream_endpoint, sglang_server.TOPIC)
    adapter = None
    try:
        adapter = Adapter(log_dir / "adapter.log")
        adapter.call(
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
        yield Rig(server, recorder, adapter, log_dir)
    finally:
        if adapter is not None:
            adapter.stop()
        recorder.close()
        server.stop()


def _select(rig: Rig, token_ids: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "block_size": PAGE, "candidates": [{"instance_id": INSTANCE, "load": 0}]}
    decision: dict[str, Any] = rig.adapter.call("/select", {**body, "token_ids": token_ids})
    return decision


def _until(check: Any, what: str, rig: Rig, timeout_s: float = 120.0) -> Any:
    """Re-runs ``check`` until it returns a truthy value (polling with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f} s\n{rig.server.log_tail(30)}"
        time.sleep(0.1)


def _quiet(rig: Rig) -> None:
    """Two instance heartbeats after the last request: every rank's flush has passed the fan-in."""
    start = rig.recorder.last_seq()
    _until(
        lambda: sum(1 for seq, b in rig.recorder.snapshot() if seq > start and not b.events) >= 2,
        "two heartbeats",
        rig,
    )


def test_server_info_says_fanned_in_over_16_ranks(rig: Rig) -> None:
    kv = rig.server.server_info()["kv_events"]
    assert kv["fanned_in"] is True and kv["dp_size"] == DP and kv["endpoint_port"] == rig.server.spec.kv_port
    assert kv["plugin_failures"] == dict.fromkeys(kv["plugin_failures"], 0)
    assert "hook failed" not in rig.server.log_text()


def test_one_stream_carries_every_rank_that_served(rig: Rig) -> None:
    pinned = {rank: sglang_server.prompt_ids(300 + rank, 5 * PAGE + 3) for rank in range(DP)}
    for rank, ids in pinned.items():
        assert rig.server.generate(ids, dp_rank=rank)["meta_info"]["dp_rank"] == rank

    def stored(stream: Any) -> None:
        checks.check_ranks_in_one_stream(stream, range(DP))
        checks.check_seq_increasing(stream)
        for rank, ids in pinned.items():
            assert checks.check_prompt_on_rank(stream, ids, rank, PAGE) == 5

    rig.recorder.wait_for(stored, timeout=120)
    assert rig.recorder.errors == 0


def test_repeats_are_dispatched_to_the_holding_rank(rig: Rig) -> None:
    ids = sglang_server.prompt_ids(17, LONG)
    first = rig.server.generate(ids)["meta_info"]
    assert first["cached_tokens"] == 0
    for _ in range(3):
        _quiet(rig)  # the rank's idle flush and load snapshot first (see test_server_plugin.py)
        again = rig.server.generate(ids)["meta_info"]
        assert again["dp_rank"] == first["dp_rank"], (first, again)
        assert again["cached_tokens"] == (LONG // PAGE) * PAGE, again
    lines = [line for line in rig.server.log_text().splitlines() if "dp_dispatch" in line and "cache_hit" in line]
    assert lines, "no dp_dispatch cache_hit line in the server log"
    print("\n" + "\n".join(lines[-3:]))
    decision = _until(lambda: (d := _select(rig, ids))["policy"] == checks.POLICY_AFFINITY and d, "the hit", rig)
    checks.check_affinity_decision(decision, first["dp_rank"], min_hbm=LONG // PAGE)


def test_flush_empties_the_index(rig: Rig) -> None:
    ids = sglang_server.prompt_ids(18, LONG)
    rig.server.generate(ids)
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_AFFINITY, "the hit", rig)
    _quiet(rig)
    flushed = rig.recorder.last_seq()
    rig.server.flush_cache()
    rig.recorder.wait_for(
        lambda s: checks.check_released_after(s, flushed, range(DP), require_block_removed=False), timeout=120
    )
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_LOAD_BALANCE, "an empty index", rig)


def test_kill_9_is_seen_as_the_instance_dead(rig: Rig) -> None:
    ids = sglang_server.prompt_ids(19, LONG)
    rig.server.generate(ids)
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_AFFINITY, "the hit", rig)
    rig.server.kill9()
    assert not rig.server.alive()

    def dead() -> bool:
        workers = rig.adapter.call("/workers")["workers"]
        healths = [h for w in workers for hs in w["health"].values() for h in hs]
        return bool(healths) and not any(h["connected"] for h in healths)

    _until(dead, "the instance marked dead", rig, timeout_s=60)
    _until(lambda: _select(rig, ids)["policy"] == checks.POLICY_LOAD_BALANCE, "its blocks dropped", rig, 60)
    assert "marked dead, its blocks dropped" in (rig.log_dir / "adapter.log").read_text()
