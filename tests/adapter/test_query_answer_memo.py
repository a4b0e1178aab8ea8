"""Remembered rank-aware ``/query`` answers: a changed load, holding, worker or
commit must change the answer exactly as a fresh computation does."""

from __future__ import annotations

import random
import time

import pytest
from conftest import load_report, offline_adapter

from motor_adapter import rank_render
from motor_adapter.affinity import KvAffinity
from motor_adapter.answer import rank_answer
from motor_adapter.query import claimed_hits
from motor_adapter.query_cache import QueryCache, WalkEntry
from motor_adapter.rank_loads import RankLoadBook
from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from motor_adapter.state import AdapterState
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.rank_cost import spread_key

BS = 16
URLS = ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557", "tcp://127.0.0.3:5557")


def _state(instances: int = 2) -> tuple[AdapterState, KvAffinity]:
    config = ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BS))
    return offline_adapter(config, [(f"vllm-prefill-{i}", URLS[i]) for i in range(instances)], BS)


def _store(affinity: KvAffinity, url: str, rank: int, prompt: list[int], blocks: int, base: int) -> None:
    stored = wire.BlockStored(list(range(base, base + blocks)), None, prompt[: blocks * BS], BS, medium="GPU")
    affinity.index.apply_batch(url, wire.EventBatch(0.0, [stored], rank))


def _remove(affinity: KvAffinity, url: str, rank: int, hashes: list[int]) -> None:
    affinity.index.apply_batch(url, wire.EventBatch(0.0, [wire.BlockRemoved(hashes, medium="GPU")], rank))


def _ask(state: AdapterState, prompt: list[int]) -> dict:
    """The answer ``/query`` gives, checked against a fresh computation (no memo, no commit)
    over the same index, loads and claims, taken just before."""
    keys = sequence_keys(prompt, BS)
    spread = spread_key(prompt, BS)
    view = state._view("m", "default", BS)
    affinity = view.affinity
    assert affinity is not None
    now = time.monotonic()
    tokens, _ = affinity.loads.tokens(view.rank_streams, now)
    loads = [token is not None for token in tokens]
    assert any(loads)
    hits = claimed_hits(affinity.loads, affinity.hits_for_keys(keys), keys, now)
    fresh = rank_answer(
        view.tenant, view.plans, view.rank_plans, hits, affinity.loads, loads, now, len(prompt), spread, view.cfg,
        view.shape, state.metrics,
    ).answer.body  # fmt: skip
    got = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread).body
    assert got == fresh
    return got["default"]


@pytest.mark.unit
def test_a_changed_load_changes_a_remembered_answer() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 8 * BS))
    _store(affinity, URLS[0], 3, prompt, 8, 100)
    affinity.loads.apply(URLS[0], load_report([0.0] * 4))
    affinity.loads.apply(URLS[1], load_report([0.0] * 4))
    first = _ask(state, prompt)
    assert first["vllm-prefill-0"]["dp_detail"]["0"]["scored_rank"] == 3
    assert _ask(state, prompt) is not None  # remembered now
    if rank_render.NATIVE is not None:
        view = state._view("m", "default", BS)
        assert view.affinity is not None
        walk = view.affinity.best_for_keys(sequence_keys(prompt, BS))
        assert walk is not None and view.cache.entry(walk).table is not None, "the C renderer's table was not kept"
    affinity.loads.apply(URLS[0], load_report([0.0, 0.0, 0.0, 5000.0]))  # the holding rank gets busy
    busy = _ask(state, prompt)
    assert busy["vllm-prefill-0"]["dp_detail"]["0"]["scored_rank"] != 3
    assert busy["vllm-prefill-0"]["dp_detail"]["0"]["rank_cost"] == 8 * BS  # an idle cold rank: the whole prompt
    affinity.loads.apply(URLS[0], load_report([0.0] * 4))
    assert _ask(state, prompt)["vllm-prefill-0"]["dp_detail"]["0"]["scored_rank"] == 3


@pytest.mark.unit
def test_a_changed_holding_changes_a_remembered_answer() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 8 * BS))
    _store(affinity, URLS[0], 1, prompt, 2, 100)
    affinity.loads.apply(URLS[0], load_report([0.0] * 2))
    affinity.loads.apply(URLS[1], load_report([0.0] * 2))
    assert _ask(state, prompt)["vllm-prefill-0"]["dp_detail"]["0"]["matched_tokens"] == 2 * BS
    _ask(state, prompt)
    _store(affinity, URLS[1], 0, prompt, 6, 200)  # the other instance now holds more
    answer = _ask(state, prompt)
    assert answer["vllm-prefill-1"]["dp_detail"]["0"]["matched_tokens"] == 6 * BS
    assert answer["vllm-prefill-1"]["GPU"] > answer["vllm-prefill-0"]["GPU"]  # Motor's 3.0.0b2 picks it
    # That answer claimed the prompt on its rank (it will hold all of it): the instance's next
    # report ends the claim, and the rank's real holding counts again.
    affinity.loads.apply(URLS[1], load_report([0.0] * 2))
    _remove(affinity, URLS[1], 0, [203, 204, 205])
    assert _ask(state, prompt)["vllm-prefill-1"]["dp_detail"]["0"]["matched_tokens"] == 3 * BS


@pytest.mark.unit
def test_a_repeat_commits_once_and_a_new_prompt_moves_the_next_answer() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 4 * BS))
    affinity.loads.apply(URLS[0], load_report([0.0, 0.0]))
    affinity.loads.apply(URLS[1], load_report([0.0, 0.0]))
    first = _ask(state, prompt)
    tokens = {url: affinity.loads.token(url, time.monotonic()) for url in URLS[:2]}
    again = _ask(state, prompt)  # the same prompt again: committed once, the answer sees its own commit
    assert {url: affinity.loads.token(url, time.monotonic()) for url in URLS[:2]} == tokens
    assert again == _ask(state, prompt)
    picked = [name for name, entry in first.items() if entry["GPU"] == max(e["GPU"] for e in first.values())]
    assert len(picked) == 1
    other = list(range(1000, 1000 + 4 * BS))  # a new cold prompt commits its tokens too
    _ask(state, other)
    loads_after = {url: affinity.loads.token(url, time.monotonic()) for url in URLS[:2]}
    assert loads_after != tokens


@pytest.mark.unit
def test_load_tokens_change_with_every_report_commit_and_forget_and_go_stale() -> None:
    book = RankLoadBook(stale_after_s=5.0)
    assert book.token("a", 0.0) is None
    book.apply("a", load_report([1.0, 2.0]), now=10.0)
    first = book.token("a", 10.0)
    assert first is not None and book.token("a", 15.1) is None  # stale
    book.commit("a", 1, 100.0, prompt=7)
    second = book.token("a", 10.0)
    assert second != first
    book.commit("a", 1, 100.0, prompt=7)  # the same prompt again: no change
    assert book.token("a", 10.0) == second
    book.apply("a", load_report([1.0, 2.0]), now=11.0)  # the same figures in a new report: a new token
    assert book.token("a", 11.0) not in (first, second, None)
    book.forget("a")
    assert book.token("a", 11.0) is None


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_remembered_rank_answers_equal_fresh_ones_through_random_changes(seed: int) -> None:
    """Stores, removals, load reports (some stale, some instances without any) and queries of
    repeated and new prompts, in random order: every answer equals a fresh computation."""
    rng = random.Random(seed)
    state, affinity = _state(3)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 9) * BS + rng.randrange(3))] for _ in range(6)]
    stored: dict[tuple[str, int], list[int]] = {}
    base = 1_000
    for _ in range(300):
        op = rng.random()
        if op < 0.2:
            url, rank, prompt = rng.choice(URLS), rng.randrange(4), rng.choice(prompts)
            blocks = rng.randrange(1, len(prompt) // BS + 1)
            _store(affinity, url, rank, prompt, blocks, base)
            stored.setdefault((url, rank), []).extend(range(base, base + blocks))
            base += blocks
        elif op < 0.3 and stored:
            (url, rank), hashes = rng.choice(sorted(stored.items()))
            if hashes:
                _remove(affinity, url, rank, [hashes.pop(rng.randrange(len(hashes)))])
        elif op < 0.45:
            url = rng.choice(URLS[:2])  # the third instance never reports: scored by its longest hit
            affinity.loads.apply(url, load_report([float(rng.choice((0, 64, 500))) for _ in range(4)]))
        elif op < 0.47:
            affinity.loads.forget(rng.choice(URLS[:2]))
        elif affinity.loads.reports and any(affinity.loads.get(url) for url in URLS):
            if rng.random() < 0.3:
                prompt = [rng.randrange(50_000) for _ in range(rng.randrange(1, 6) * BS)]  # new each time
            else:
                prompt = rng.choice(prompts)
            _ask(state, prompt)


def _replay(seed: int) -> tuple[list[dict], list[str]]:
    """One random run of stores, reports and repeated/new prompts through ``answer_keys``:
    the answers, and the metrics' lines (timings aside; sorted: a series is listed where it
    was first added to, which the answers' metrics do when the counters are read)."""
    rng = random.Random(seed)
    state, affinity = _state(3)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 7) * BS)] for _ in range(5)]
    answers = []
    for step in range(200):
        if step % 9 == 0:
            prompt = rng.choice(prompts)
            _store(affinity, rng.choice(URLS), rng.randrange(4), prompt, rng.randrange(1, len(prompt) // BS + 1), step)
        if step % 13 == 0:
            affinity.loads.apply(rng.choice(URLS[:2]), load_report([float(rng.choice((0, 64, 500))) for _ in range(4)]))
        if not affinity.loads.reports:
            continue
        prompt = rng.choice(prompts) if rng.random() < 0.7 else [rng.randrange(50_000) for _ in range(3 * BS)]
        keys = sequence_keys(prompt, BS)
        answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread_key(prompt, BS))
        answers.append(answer.body)
    lines = sorted(line for line in state.render_metrics().splitlines() if "_seconds" not in line)
    return answers, lines


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(3))
def test_remembered_answers_count_the_metrics_and_commit_as_fresh_ones(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    remembered = _replay(seed)
    monkeypatch.setattr(QueryCache, "entry", lambda self, walk: WalkEntry(walk))  # nothing kept: all fresh
    fresh = _replay(seed)
    assert remembered[0] == fresh[0]  # commits included: a wrong one would move a later answer
    assert remembered[1] == fresh[1]
    assert any("scored_hit_tokens_total{" in line for line in fresh[1])


@pytest.mark.unit
def test_every_instance_hit_is_counted_for_every_remembered_answer() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 8 * BS))
    _store(affinity, URLS[0], 3, prompt, 8, 100)
    _store(affinity, URLS[1], 1, prompt, 5, 200)
    affinity.loads.apply(URLS[0], load_report([0.0] * 4))
    affinity.loads.apply(URLS[1], load_report([0.0] * 4))
    for _ in range(3):  # the first computed, the next two remembered
        _ask(state, prompt)
    text = state.render_metrics()
    assert 'instance_hit_blocks_total{dp="0",engine_dp_rank="3",instance="vllm-prefill-0",tier="npu"} 24' in text
    assert 'instance_hit_blocks_total{dp="0",engine_dp_rank="1",instance="vllm-prefill-1",tier="npu"} 15' in text
    assert 'motor_kv_adapter_query_hit_blocks_total{model="m"} 24' in text
    assert 'scored_hit_tokens_total{engine_dp_rank="1",instance="vllm-prefill-1"} 240' in text


@pytest.mark.unit
def test_loads_going_stale_end_the_rank_aware_answer_though_nothing_else_changed() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 4 * BS))
    _store(affinity, URLS[0], 1, prompt, 4, 100)
    affinity.loads.stale_after_s = 0.2
    affinity.loads.apply(URLS[0], load_report([0.0, 0.0]))
    keys = sequence_keys(prompt, BS)

    def detail() -> dict:
        answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread_key(prompt, BS))
        return answer.body["default"]["vllm-prefill-0"]["dp_detail"]["0"]

    assert "rank_cost" in detail() and "rank_cost" in detail()  # computed, then remembered
    time.sleep(0.25)  # the figures' age passes stale_after_s: a timer, not a synchronisation
    assert "rank_cost" not in detail()  # scored by the longest hit again, as without loads
    assert detail()["engine_dp_rank"] == 1
