"""The report's PD deployment in small, every part real.

Motor's real coordinator (``mindie-motor`` 3.0.0b2, ``deploy_mode: pd_dual_dispatch``,
``kv_cache_affinity``, configured from ``docs/examples/motor_user_config.json`` and
``motor_env_config.json``) -> ``motor-kv-adapter serve`` -> two SGLang 0.5.23 PD prefills (``--dp-size 2``, the
plugin enabled by ``SGLANG_KVPUB_ENABLED=1`` as Motor's env config sets it, the load-balance
method left at SGLang's default) and one decode, KV over Mooncake's transfer engine on TCP.
One rig for the module (bench/pd_rig.py); the checks run in file order against it and read
the processes' own log lines (Motor's ``select_endpoint``, the plugin's ``dp_dispatch``,
SGLang's ``[DPr] Prefill batch ... #cached-token``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import e2e_rig
import pd_rig
import pytest
import sglang_server
from npu.npu_engine import StreamRecorder

from sglang_kvpub import wire

pytestmark = [pytest.mark.pd, pytest.mark.timeout(1800)]

PAGE = 128  # Motor's default block size: the documented PD config sets no block-size
WORDS = 300  # ~1.5k tokens: 12 full pages with this model's tokenizer
EVICTING_PROMPTS = 12  # x ~1.5k tokens onto 4 ranks of 4096 tokens each: one at least gets 3 and evicts
DP = 2


@dataclass
class Rig:
    pd: pd_rig.PdRig
    recorders: list[StreamRecorder]
    tokenizer: Any
    holder: dict[str, tuple[int, int]]  # prompt -> (instance, rank) that served it cold


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("pd")
    model = sglang_server.make_model_dir(work / "model")
    pd = pd_rig.PdRig(pd_rig.PdRigSpec(work_dir=work, model_dir=model, page_size=PAGE))
    with pd:
        from transformers import AutoTokenizer

        recorders = [StreamRecorder(s.spec.stream_endpoint, "kv-events") for s in pd.prefills]
        try:
            yield Rig(pd, recorders, AutoTokenizer.from_pretrained(str(model)), {})
        finally:
            for recorder in recorders:
                recorder.close()


def _ids(rig: Rig, prompt: str) -> list[int]:
    ids: list[int] = rig.tokenizer(prompt)["input_ids"]
    return ids


def _quiet(rig: Rig) -> None:
    """Waits until every instance stream sent two heartbeats after what it last carried: the
    ranks' flushes of the last request (its events, then the idle flush) passed the fan-in."""
    starts = [r.last_seq() for r in rig.recorders]
    rig.pd.wait_for(
        lambda: all(
            sum(1 for seq, b in r.snapshot() if seq > start and not b.events) >= 2
            for r, start in zip(rig.recorders, starts, strict=True)
        ),
        "two heartbeats on every instance stream",
        60,
    )


def _complete(rig: Rig, prompt: str) -> pd_rig.PdCompletion:
    _quiet(rig)
    done = rig.pd.complete(prompt)
    assert done.status == 200 and done.completion_tokens > 0, (done.status, done.body, rig.pd.tails())
    return done


def _full(rig: Rig, prompt: str) -> int:
    return len(_ids(rig, prompt)) // PAGE * PAGE


def test_motor_registers_both_prefills_and_each_dispatches_by_cache(rig: Rig) -> None:
    adapter = rig.pd.adapter_text()
    for n, server in enumerate(rig.pd.prefills):
        assert f"registered vllm-prefill-{n} dp 0" in adapter
        info = server.server_info()
        assert info["load_balance_method"] == "round_robin", info["load_balance_method"]  # not follow_bootstrap_room
        dispatch = info["kv_events"]["dp_dispatch"]
        assert dispatch["on"] is True and "auto resolved to round_robin" in dispatch["reason"], dispatch
        log = server.log_text()
        # Said at start by the launcher and the DP controller, never "off".
        assert log.count("sglang_kvpub: cache-aware DP dispatch on (--load-balance-method round_robin)") >= 2
        assert "cache-aware DP dispatch off" not in log
    assert adapter.count(f"instance stream with dp_size {DP}") >= 2
    # Motor logs its registration once the adapter answered: after the adapter's own line.
    for n in range(len(rig.pd.prefills)):
        registered = f"Register success! vllm-prefill-{n}"
        rig.pd.wait_for(lambda registered=registered: registered in rig.pd.coordinator.log(), registered, 30)


def test_each_repeat_goes_to_the_holding_instance_and_rank_and_is_served_from_its_cache(rig: Rig) -> None:
    prompt = e2e_rig.prompt_text(31, WORDS)
    full = _full(rig, prompt)
    assert full >= 8 * PAGE, full

    cold = _complete(rig, prompt)
    assert [s.matched for s in cold.scores] == [0], cold.scores  # Motor scored it: a miss
    holder = cold.served
    assert holder is not None and cold.cached_tokens == 0, cold.prefills
    assert cold.scores[0].instance == holder[0]
    rig.holder[prompt] = holder
    _wait_for_hit(rig, prompt, holder)

    for _ in range(3):
        hot = _complete(rig, prompt)
        score = hot.scores[0]
        assert (score.instance, score.matched) == (holder[0], full), hot.scores  # Motor: the holding instance
        assert score.engine_dp_rank(holder[0]) == holder[1], score.answer
        assert hot.served == holder, hot.prefills  # the plugin: the holding rank
        assert hot.cached_tokens == full, hot.prefills  # SGLang: #cached-token on that rank
        line = hot.dispatches[holder[0]][-1]
        assert (line["dp_rank"], line["reason"], line["matched"]) == (holder[1], "cache_hit", full), line


def test_a_prompt_held_by_the_other_instance_goes_there(rig: Rig) -> None:
    held = next(iter(rig.holder.values()))
    other = 1 - held[0]
    prompt = e2e_rig.prompt_text(32, WORDS)
    _quiet(rig)
    # Motor's 3.0.0b2 breaks a tie of zero hits toward the same instance, so the prompt is
    # put on the other one the way pd_dual_dispatch sends a request (bootstrap fields).
    assert rig.pd.seed(prompt, other) == [200, 200]
    entry = _wait_for_hit(rig, prompt, None, instance=other)
    rank = entry["dp_detail"]["0"]["engine_dp_rank"]
    hot = _complete(rig, prompt)
    assert (hot.scores[0].instance, hot.scores[0].matched) == (other, _full(rig, prompt)), hot.scores
    assert hot.served == (other, rank) and hot.cached_tokens == _full(rig, prompt), hot.prefills
    rig.holder[prompt] = (other, rank)


def test_after_eviction_the_adapters_view_of_each_rank_equals_its_tree(rig: Rig) -> None:
    before = [r.last_seq() for r in rig.recorders]
    prompts = [e2e_rig.prompt_text(400 + n, WORDS) for n in range(EVICTING_PROMPTS)]
    for prompt in prompts:
        done = _complete(rig, prompt)
        assert done.served is not None, done.prefills
        rig.holder[prompt] = done.served
    # Pages left HBM after their transfers: announced removed (GPU) on the instance streams, by
    # every rank these prompts overfilled (Motor and the dispatchers decide which ranks those are).
    served: dict[tuple[int, int], int] = {}
    for prompt in prompts:
        holder = rig.holder[prompt]
        served[holder] = served.get(holder, 0) + len(_ids(rig, prompt))
    overfilled = [holder for holder, tokens in served.items() if tokens > rig.pd.spec.max_total_tokens]
    assert overfilled, f"no rank served more than its pool: {served}"
    _quiet(rig)
    for instance, rank in overfilled:
        removed = _removed(rig.recorders[instance], before[instance], rank)
        assert removed > 0, f"no BlockRemoved(GPU) from instance {instance} rank {rank} under eviction ({served})"
    # The adapter's view equals each rank's tree: for every prompt, newest first (serving one
    # re-inserts it and may evict older ones), the hit Motor is given before the request
    # equals the prefix SGLang finds cached on the rank that serves it.
    probes = list(reversed(prompts)) + [p for p in rig.holder if p not in prompts]
    misses = 0
    for prompt in probes:
        done = _complete(rig, prompt)
        score = done.scores[0]
        served = done.served
        assert served is not None and score.instance == served[0], (done.scores, done.prefills)
        assert score.matched == done.cached_tokens, (prompt[:30], score.answer, done.prefills, done.dispatches)
        if score.matched:
            assert score.engine_dp_rank(served[0]) == served[1], (score.answer, done.prefills)
        misses += score.matched == 0
    assert misses >= 1, "no probe found its prompt evicted"
    assert "Traceback" not in rig.pd.coordinator.log()
    for server in rig.pd.prefills:
        log = server.log_text()
        assert "hook failed" not in log and "follow_bootstrap_room conflict" not in log


def _removed(recorder: StreamRecorder, after: int, rank: int) -> int:
    return sum(
        len(e.block_hashes)
        for seq, b in recorder.snapshot()
        if seq > after and b.dp_rank == rank
        for e in b.events
        if isinstance(e, wire.BlockRemoved) and e.medium == wire.MEDIUM_GPU
    )


def _wait_for_hit(
    rig: Rig, prompt: str, holder: tuple[int, int] | None, *, instance: int | None = None
) -> dict[str, Any]:
    """Polls the adapter until the instance holds every full page of ``prompt`` (on ``holder``'s rank)."""
    ids = _ids(rig, prompt)
    target = holder[0] if holder is not None else instance
    assert target is not None

    def covered() -> dict[str, Any] | None:
        return rig.pd.held_on(ids, target, holder[1] if holder is not None else None)

    entry: dict[str, Any] = rig.pd.wait_for(covered, "the adapter's hit on the whole prompt", 60)
    return entry
