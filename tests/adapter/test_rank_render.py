"""The rank-aware ``/query`` answer rendered in C (``motor_adapter._answer``) against its
reference, ``answer.rank_answer`` in Python: the same JSON bytes, the same commits,
the same metrics, through random indexes, loads, weights and prompts (some asked several
times in a row, as a GRPO group is: answered under their claims)."""

from __future__ import annotations

import os
import random
import time
from array import array
from typing import Any

import msgspec
import pytest
from conftest import load_report, offline_adapter

from motor_adapter import query as query_module
from motor_adapter import rank_render
from motor_adapter import state as state_module
from motor_adapter.affinity import KvAffinity
from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from motor_adapter.state import JSON_TYPE, AdapterState
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.rank_cost import spread_key

BS = 16
needs_native = pytest.mark.skipif(rank_render.NATIVE is None, reason="the C renderer is not built (or KVPUB_NATIVE=0)")


def _url(i: int) -> str:
    return f"tcp://127.0.0.{i + 1}:5557"


def _state(instances: int, cfg: KvAffinityConfig, names: list[str]) -> tuple[AdapterState, KvAffinity]:
    return offline_adapter(ServiceConfig(kv_affinity=cfg), [(names[i], _url(i)) for i in range(instances)], BS)


def _scenario(seed: int, native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[str], int]:
    """One random run through ``answer_keys``: each answer's JSON bytes (the C renderer's own,
    or msgspec's of the reference's body), the metrics' lines (timings aside) and how many
    answers were asked under a claim."""
    monkeypatch.setattr(rank_render, "NATIVE", rank_render.NATIVE if native else None)
    rng = random.Random(seed)
    weights = rng.choice(
        [(1.0, 1.0, 0.0, 1.0, 1.0, 1.0), (0.5, 1.0, 0.0, 2.0, 0.75, 0.3), (1.0, 0.0, 0.0, 0.0, 1.0, 1.0)]
    )
    weights = weights if rng.random() < 0.7 else tuple(rng.choice((0.0, 0.25, 1.0, 3.5)) for _ in range(6))
    w_npu, w_cpu, w_disk, scale, credit, load_weight = weights
    cfg = KvAffinityConfig(
        block_size=BS,
        w_npu=w_npu,
        w_cpu=w_cpu,
        w_disk=w_disk,
        prefill_load_scale=scale,
        overlap_credit=credit,
        load_weight=load_weight,
    )
    count = rng.randrange(1, 7)
    names = [rng.choice(("vllm-prefill-", 'odd "name" \\ é-', "p")) + str(i) for i in range(count)]
    state, affinity = _state(count, cfg, names)
    state.metrics.answer_tally.max_waiting = rng.choice((1, 3, 1024))  # counts added mid-run too
    sizes = [rng.choice((0, 1, 2, 4, 16)) for _ in range(count)]
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 9) * BS + rng.randrange(3))] for _ in range(6)]
    answers: list[Any] = []
    claimed = 0
    base = 1_000
    for step in range(160):
        op = rng.random()
        if op < 0.2:
            i, prompt = rng.randrange(count), rng.choice(prompts)
            blocks = rng.randrange(1, len(prompt) // BS + 1)
            rank = rng.randrange(max(sizes[i], 1) + 2)  # some ranks past the reported ones
            stored = wire.BlockStored(list(range(base, base + blocks)), None, prompt[: blocks * BS], BS, medium="GPU")
            affinity.index.apply_batch(_url(i), wire.EventBatch(0.0, [stored], rank))
            base += blocks
        elif op < 0.35:
            i = rng.randrange(count)
            if sizes[i]:
                # figures across decimal carries and digit counts (the C renderer prints digits in
                # pairs), exact ties of the tenths (rounded to even), and a subnormal
                edges = (9.96, 99.96, 1_000.0, 9_999_999.97, 10_000_000.0, 1e14 + 0.1)
                edges += (0.25, 0.75, 2.25, 0.125, 0.375, 1e14 + 0.25, 5e-324)
                choices = (0.0, 0.0, 64.0, 500.0, rng.uniform(0, 1e5), 1e13 + 0.05, rng.choice(edges))
                loads = [rng.choice(choices) for _ in range(sizes[i])]
                affinity.loads.apply(_url(i), load_report(loads), now=rng.choice((None, 0.0)))  # 0.0: stale at once
        elif op < 0.37:
            affinity.loads.forget(_url(rng.randrange(count)))
        else:
            if rng.random() < 0.4:
                prompt = [rng.randrange(50_000) for _ in range(rng.randrange(0, 6) * BS + rng.randrange(2))]
            else:
                prompt = rng.choice(prompts)
            keys = sequence_keys(prompt, BS)
            spread = spread_key(prompt, BS) if rng.random() < 0.8 else rng.getrandbits(64)
            for _ in range(rng.choice((1, 1, 2, 4))):  # a group's members, one after another
                claimed += bool(keys) and affinity.loads.claim(keys[-1], time.monotonic()) is not None
                answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread)
                encoded = answer.encoded.get(JSON_TYPE) or msgspec.json.encode(answer.body)
                answers.append((step, encoded))
                assert msgspec.json.decode(encoded) == answer.body
    # Sorted: a series is listed where it was first added to, and the C path's answers add to
    # theirs when the counters are read (rank_render.AnswerTally); the values are what is compared.
    lines = sorted(line for line in state.render_metrics().splitlines() if "_seconds" not in line)
    return answers, lines, claimed


@needs_native
@pytest.mark.unit
@pytest.mark.parametrize("seed", range(40))
def test_the_c_renderer_answers_commits_and_counts_as_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = _scenario(seed, True, monkeypatch)
    reference = _scenario(seed, False, monkeypatch)
    assert [a for a in rendered[0]] == [a for a in reference[0]]  # byte for byte; commits move later answers
    assert rendered[1] == reference[1]
    assert rendered[2] == reference[2]


@pytest.mark.unit
def test_the_fuzz_asks_claimed_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenarios above answer prompts under their claims, not only new ones."""
    claimed = [_scenario(seed, False, monkeypatch)[2] for seed in range(10)]
    assert sum(1 for c in claimed if c) >= 5, claimed


def _loads_answered(values: list[float], native: bool, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The JSON of one answer per load in ``values`` (a new report each), by the C renderer or
    by the reference."""
    monkeypatch.setattr(rank_render, "NATIVE", rank_render.NATIVE if native else None)
    state, affinity = _state(1, KvAffinityConfig(block_size=BS), ["a"])
    prompt = list(range(1, 1 + 2 * BS))
    keys = sequence_keys(prompt, BS)
    out = []
    for value in values:
        affinity.loads.apply(_url(0), load_report([value]))
        answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), 3)
        out.append(answer.encoded.get(JSON_TYPE) or msgspec.json.encode(answer.body))
    return out


@needs_native
@pytest.mark.unit
def test_a_figure_printed_again_reads_as_printed_first_whatever_came_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loads over many reports - 400 distinct values, each printed again after the others and
    right after itself - read byte for byte as the reference prints them."""
    rng = random.Random(5)
    values = [rng.uniform(0, 1e6) for _ in range(300)] + [rng.randrange(10**6) + 0.05 for _ in range(100)]
    sequence = values + values[::-1] + [v for v in values for _ in range(2)]
    rendered = _loads_answered(sequence, True, monkeypatch)
    assert rendered == _loads_answered(sequence, False, monkeypatch)
    assert b'"rank_load":%s' % str(round(values[0], 1)).encode() in rendered[0]


def _b_holds_the_prompt_on_its_busy_rank() -> tuple[AdapterState, KvAffinity, list[int]]:
    """Instances "a" (two idle ranks) and "b" (rank 1 holds a 4-block prompt, load 30)."""
    state, affinity = _state(2, KvAffinityConfig(block_size=BS), ["a", "b"])
    prompt = list(range(1, 1 + 4 * BS))
    stored = wire.BlockStored(list(range(100, 104)), None, prompt, BS, medium="GPU")
    affinity.index.apply_batch(_url(1), wire.EventBatch(0.0, [stored], 1))
    affinity.loads.apply(_url(0), load_report([0.0, 0.0]))
    affinity.loads.apply(_url(1), load_report([0.0, 30.0]))
    return state, affinity, prompt


@needs_native
@pytest.mark.unit
def test_the_c_renderer_renders_the_rank_aware_answers() -> None:
    """The renderer is what answers when loads are fresh (not the reference on every query)."""
    state, _, prompt = _b_holds_the_prompt_on_its_busy_rank()
    keys = sequence_keys(prompt, BS)
    answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread_key(prompt, BS))
    assert JSON_TYPE in answer.encoded and answer._body is None  # rendered in C, decoded only when asked
    detail = answer.body["default"]["b"]["dp_detail"]["0"]
    assert (detail["scored_rank"], detail["engine_dp_rank"], detail["rank_load"]) == (1, 1, 30.0)
    view = state._view("m", "default", BS)
    assert view.affinity is not None
    walk = view.affinity.best_for_keys(keys)
    assert walk is not None and view.cache.entry(walk).table is not None


@needs_native
@pytest.mark.unit
def test_a_float_it_cannot_render_exactly_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    state, affinity = _state(1, KvAffinityConfig(block_size=BS), ["a"])
    # The chosen rank's load is past what "%.1f" renders as msgspec does.
    affinity.loads.apply(_url(0), load_report([2e15, 3e15]))
    prompt = list(range(1, 1 + 2 * BS))
    keys = sequence_keys(prompt, BS)
    called = []
    reference = query_module.rank_answer

    def spy(*args: Any) -> Any:
        called.append(1)
        return reference(*args)

    monkeypatch.setattr(query_module, "rank_answer", spy)
    answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), 3)
    assert called and answer.body["default"]["a"]["dp_detail"]["0"]["scored_rank"] == 0


@pytest.mark.unit
def test_an_answer_needs_its_body_or_its_json() -> None:
    with pytest.raises(ValueError, match="body or its JSON"):
        state_module.Answer(None, {})
    assert state_module.Answer(None, {JSON_TYPE: b'{"t":{}}'}).body == {"t": {}}


@pytest.mark.unit
def test_the_c_renderer_is_built_where_ci_requires_it() -> None:
    if os.environ.get("KVPUB_REQUIRE_NATIVE") == "1":
        assert rank_render.NATIVE is not None, "KVPUB_REQUIRE_NATIVE=1 but motor_adapter._answer did not build"


@pytest.mark.unit
def test_an_answer_given_again_counts_again_and_a_new_prompt_commits(native_renders: list[int]) -> None:
    """A prompt asked again is answered under its claim: rendered once (its rank holding the
    whole prompt), then given again without rendering (same walk result, length and
    tie-break key, no change in the book) and still counted; a new prompt of the same walk
    ends is rendered and commits (then the book has changed)."""
    renders = native_renders
    state, affinity, prompt = _b_holds_the_prompt_on_its_busy_rank()
    # Two prompts whose fifth block no one holds: the same walk result, length and key.
    first = sequence_keys([*prompt, *range(900, 900 + BS)], BS)
    second = sequence_keys([*prompt, *range(950, 950 + BS)], BS)

    def scored() -> float:
        return state.metrics.scored_tokens.value(engine_dp_rank="1", instance="b")

    def ask(asked: list[int]) -> None:
        state.answer_keys("m", "default", BS, asked, len(asked), 0.0, 5 * BS, 5)

    ask(first)  # rendered; commits its uncached block to b's rank 1 and claims the prompt there
    assert len(renders) == 1 and scored() == 4 * BS
    changes = affinity.loads.changes
    committed = affinity.loads.token(_url(1), time.monotonic())
    ask(first)  # under its claim: rendered, rank 1 holding all five blocks; committed once already
    assert len(renders) == 2 and scored() == 9 * BS
    ask(first)  # given again: no render, no commit, counted
    assert len(renders) == 2 and scored() == 14 * BS and affinity.loads.changes == changes
    ask(second)  # a new prompt: rendered (the first's commit changed the book), its commit made
    assert len(renders) == 3 and scored() == 18 * BS and affinity.loads.changes == changes + 1
    assert affinity.loads.token(_url(1), time.monotonic()) != committed


@needs_native
@pytest.mark.unit
def test_the_renderer_reads_live_loads_through_their_attributes_only() -> None:
    """The C reads a LiveLoads' ``received``, ``total`` and ``loads`` (a buffer of doubles):
    anything else there is refused with the reason, never read as raw memory."""
    state, affinity, prompt = _b_holds_the_prompt_on_its_busy_rank()
    keys = sequence_keys([*prompt, *range(900, 900 + BS)], BS)
    state.answer_keys("m", "default", BS, keys, len(keys), 0.0, 5 * BS, 5)
    view = state._view("m", "default", BS)
    assert view.affinity is not None
    walk = view.affinity.best_for_keys(keys)
    assert walk is not None
    table = view.cache.entry(walk).table
    assert table is not None
    static = view.rank_static
    live = affinity.loads.live()[_url(1)]

    class Loads:
        received, total = live.received, live.total

    for loads, error in ((array("q", [1, 2]), "buffer of doubles"), ([1.0, 2.0], "bytes-like")):
        odd = Loads()
        odd.loads = loads  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match=error):
            rank_render.NATIVE.rank_answer(
                table.board, static.streams, {_url(1): odd}, time.monotonic(), 5.0, 5 * BS, 5
            )
    del Loads.total
    with pytest.raises(AttributeError):
        rank_render.NATIVE.rank_answer(
            table.board, static.streams, {_url(1): Loads()}, time.monotonic(), 5.0, 5 * BS, 5
        )
