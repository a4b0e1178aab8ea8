"""The report's dp 16 in a real CPU server: ``--dp-size 16 --plugin sglang_kvpub --sleep-on-idle``.

The report's setting, as a new user runs it (tiny model from bench/sglang_server.py, one
OpenMP core group per rank in ``SGLANG_CPU_OMP_THREADS_BIND``): one instance stream carries
every rank that served, a repeated prompt is dispatched to the rank holding it, a flush
empties the adapter's index, a ``kill -9`` of the server is seen by the adapter as the
instance dead.  Marked ``slow`` (16 schedulers take ~13 GB and minutes to start: the
README's ``-m "not slow"`` leaves it out, and ``.ci/run`` runs it as a step of its own);
run it alone on the host (~13 GB free):

    python -m pytest -m slow tests/server/test_server_dp16.py -q -s

``--mem-fraction-static 0.5``: on CPU the check is against the host's free memory, which 16
ranks loading at once (and anything else on the host) shrink while each rank measures it;
``--max-total-tokens`` still caps each rank's pool.  Start time and the memory of each rank's
process are printed (``-s``) and in
``bench/dp16.py``'s line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import e2e_checks as checks
import pytest

from .conftest import PluginRig, plugin_rig, sglang_server

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(3600)]

PAGE = 16
DP = 16
MODEL = "tiny-llama"
INSTANCE = "sglang-cpu-dp16"
LONG = 600  # tokens of the repeated prompt: 37 full pages + 8


@pytest.fixture(scope="module")
def rig(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginRig]:
    def report(server: sglang_server.Server) -> None:
        print(f"\ndp16 server ready in {server.started_s:.0f} s; {sglang_server.memory_report(server)}")

    log_dir = tmp_path_factory.mktemp("server-dp16")
    # --mem-fraction-static 0.5: see the module's docstring
    extra = ("--sleep-on-idle", "--mem-fraction-static", "0.5")
    # dispatch_log "info": the repeat test reads the controller's per-decision lines (debug by default)
    with plugin_rig(
        model_dir,
        log_dir,
        instance=INSTANCE,
        model_name=MODEL,
        page=PAGE,
        dp_size=DP,
        extra_args=extra,
        started=report,
        kv_events_extra={"dispatch_log": "info"},
    ) as made:
        yield made


def test_server_info_says_fanned_in_over_16_ranks(rig: PluginRig) -> None:
    kv = rig.server.server_info()["kv_events"]
    assert kv["fanned_in"] is True and kv["dp_size"] == DP and kv["endpoint_port"] == rig.server.spec.kv_port
    assert kv["plugin_failures"] == dict.fromkeys(kv["plugin_failures"], 0)
    assert "hook failed" not in rig.server.log_text()


def test_one_stream_carries_every_rank_that_served(rig: PluginRig) -> None:
    rig.one_stream_carries_every_rank(300, DP, timeout_s=120)


def test_repeats_are_dispatched_to_the_holding_rank(rig: PluginRig) -> None:
    ids = sglang_server.prompt_ids(17, LONG)
    first = rig.server.generate(ids)["meta_info"]
    assert first["cached_tokens"] == 0
    for _ in range(3):
        rig.quiet()  # the rank's idle flush and load snapshot first (see test_server_plugin.py)
        again = rig.server.generate(ids)["meta_info"]
        assert again["dp_rank"] == first["dp_rank"], (first, again)
        assert again["cached_tokens"] == (LONG // PAGE) * PAGE, again
    log = rig.server.log_text().splitlines()
    lines = [line for line in log if "dp_dispatch" in line and "cache_hit" in line]
    assert lines, "no dp_dispatch cache_hit line in the server log"
    # The repeat's scheduler line on the rank it went to: all but the last partial page cached.
    on_rank = re.compile(rf" DP{first['dp_rank']}\b[^\]]*\] Prefill batch")
    served = [line for line in log if on_rank.search(line)]
    print("\n" + "\n".join(lines[-3:] + served[-1:]))
    decision = rig.until(lambda: (d := rig.select(ids))["policy"] == checks.POLICY_AFFINITY and d, "the hit")
    checks.check_affinity_decision(decision, first["dp_rank"], min_hbm=LONG // PAGE)


def test_flush_empties_the_index(rig: PluginRig) -> None:
    ids = sglang_server.prompt_ids(18, LONG)
    rig.server.generate(ids)
    rig.until(lambda: rig.select(ids)["policy"] == checks.POLICY_AFFINITY, "the hit")
    rig.quiet()
    flushed = rig.recorder.last_seq()
    rig.server.flush_cache()
    rig.recorder.wait_for(
        lambda s: checks.check_released_after(s, flushed, range(DP), require_block_removed=False), timeout=120
    )
    rig.until(lambda: rig.select(ids)["policy"] == checks.POLICY_LOAD_BALANCE, "an empty index")


def test_kill_9_is_seen_as_the_instance_dead(rig: PluginRig) -> None:
    ids = sglang_server.prompt_ids(19, LONG)
    rig.server.generate(ids)
    rig.kill9_seen_dead(ids, timeout_s=60)
