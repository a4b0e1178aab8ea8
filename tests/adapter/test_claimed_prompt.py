"""An answer's commit claims its whole prompt on the rank it names (``RankLoadBook.claim``):
the same prompt asked again before that instance's next report - a GRPO group's next member -
is answered with that rank holding all of it, in C and in the reference alike."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import load_report, offline_adapter

from motor_adapter import query as query_module
from motor_adapter import rank_loads as rank_loads_module
from motor_adapter import rank_render
from motor_adapter.affinity import KvAffinity
from motor_adapter.answer import rank_answer
from motor_adapter.explain import explain
from motor_adapter.rank_loads import RankLoadBook
from motor_adapter.scoring import Candidate, KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from motor_adapter.state import AdapterState
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.rank_cost import spread_key

BS = 16
URLS = ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557")
NAMES = ("a", "b")


@pytest.fixture(params=["native", "reference"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs rendered in C (when built) and with the reference alone."""
    if request.param == "native" and rank_render.NATIVE is None:
        pytest.skip("the C renderer is not built (or KVPUB_NATIVE=0)")
    if request.param == "reference":
        monkeypatch.setattr(rank_render, "NATIVE", None)
    return request.param == "native"


def _cluster() -> tuple[AdapterState, KvAffinity]:
    """Instances "a" (one idle rank) and "b" (one rank, 10 tokens queued), nothing cached."""
    config = ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BS))
    state, affinity = offline_adapter(config, list(zip(NAMES, URLS, strict=True)), BS)
    affinity.loads.apply(URLS[0], load_report([0.0]))
    affinity.loads.apply(URLS[1], load_report([10.0]))
    return state, affinity


def _ask(state: AdapterState, prompt: list[int]) -> dict[str, Any]:
    keys = sequence_keys(prompt, BS)
    answer = state.answer_keys("m", "default", BS, keys, len(keys), 0.0, len(prompt), spread_key(prompt, BS))
    return answer.body["default"]


def _picked(body: dict[str, Any]) -> str:
    """The instance Motor's Ascend cost takes from the answer: the largest ``DP`` (the best's
    is its real hit, every other's is held below it)."""
    return max(body, key=lambda name: body[name]["DP"]["0"])


@pytest.mark.unit
def test_the_next_identical_prompt_stays_on_the_claimed_rank(native: bool) -> None:
    """Without the claim, the first member's commit (its whole prompt queued on "a") makes "b"
    the cheaper instance for the second; with it, "a"'s rank holds the prompt once that
    prefill is done, the wait already in its load: the second member stays there."""
    state, affinity = _cluster()
    prompt = list(range(1, 1 + 6 * BS))
    first = _ask(state, prompt)
    assert _picked(first) == "a" and first["a"]["dp_detail"]["0"]["matched_tokens"] == 0
    held = affinity.loads.claim(sequence_keys(prompt, BS)[-1], time.monotonic())
    assert held is not None and (held.instance, held.rank) == (URLS[0], 0)
    changes = affinity.loads.changes

    second = _ask(state, prompt)
    assert _picked(second) == "a"
    assert second["a"]["DP"]["0"] == len(prompt)  # the whole prompt, as Motor's log will show
    assert second["a"]["dp_detail"]["0"]["rank_load"] == len(prompt)  # the first member's prefill
    assert affinity.loads.changes == changes  # committed once

    state2, affinity2 = _cluster()  # the same, the claim not counted: the group splits
    _ask(state2, prompt)
    affinity2.loads.claims.clear()
    assert _picked(_ask(state2, prompt)) == "b"


@pytest.mark.unit
def test_explain_and_select_look_without_claiming(native: bool) -> None:
    """A tool that looks at a prompt before sending it asks ``/explain`` (or ``/select``): the
    prompt is neither committed nor claimed, so Motor's later ``/query`` of it is a clean miss."""
    state, affinity = _cluster()
    prompt = list(range(1, 1 + 6 * BS))
    changes = affinity.loads.changes
    report = explain(state, "m", "default", BS, prompt)
    assert report["verdict"] == "miss"
    state.select("m", "default", BS, [Candidate(name, 0.0) for name in NAMES], prompt)
    assert affinity.loads.claim(sequence_keys(prompt, BS)[-1], time.monotonic()) is None
    assert affinity.loads.changes == changes
    assert _ask(state, prompt)["a"]["dp_detail"]["0"]["matched_tokens"] == 0


@pytest.mark.unit
def test_the_claimed_instance_s_next_report_ends_the_claim(native: bool) -> None:
    state, affinity = _cluster()
    prompt = list(range(1, 1 + 6 * BS))
    key = sequence_keys(prompt, BS)[-1]
    _ask(state, prompt)
    assert affinity.loads.claim(key, time.monotonic()) is not None
    affinity.loads.apply(URLS[1], load_report([10.0]))  # another instance's report: the claim holds
    assert affinity.loads.claim(key, time.monotonic()) is not None
    assert _ask(state, prompt)["a"]["DP"]["0"] == len(prompt)
    affinity.loads.apply(URLS[0], load_report([len(prompt)]))  # "a"'s report: it counts the prefill itself
    assert affinity.loads.claim(key, time.monotonic()) is None
    again = _ask(state, prompt)
    assert again["a"]["dp_detail"]["0"]["matched_tokens"] == 0 and _picked(again) == "b"


@pytest.mark.unit
def test_a_claim_ends_with_its_loads_going_stale_or_forgotten(native: bool) -> None:
    book = RankLoadBook(stale_after_s=5.0)
    book.apply("a", load_report([0.0, 0.0]), now=10.0)
    book.commit("a", 1, 32.0, prompt=7)
    claim = book.claim(7, 10.0)
    assert claim is not None and (claim.instance, claim.rank) == ("a", 1)
    assert book.claim(7, 15.1) is None  # stale
    assert book.claim(8, 10.0) is None
    book.forget("a")
    assert book.claim(7, 10.0) is None
    book.apply("a", load_report([0.0, 0.0]), now=20.0)
    book.commit("a", 9, 32.0, prompt=7)  # a rank the report does not list: nothing committed
    assert book.claim(7, 20.0) is None and book.token("a", 20.0) == (book.live()["a"].version, 0)


@pytest.mark.unit
def test_claims_are_bounded(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_loads_module, "_CLAIMS_MAX", 4)
    book = RankLoadBook()
    book.apply("a", load_report([0.0]), now=1.0)
    for prompt in range(10):
        book.commit("a", 0, 16.0, prompt)
        assert len(book.claims) <= 4 and book.claim(prompt, 1.0) is not None
    # Per walk result too: cold prompts share one walk result, each claimed prompt its slot.
    monkeypatch.setattr(query_module, "_CLAIMED_MAX", 2)
    state, affinity = _cluster()
    prompts = [list(range(1000 * i, 1000 * i + 3 * BS)) for i in range(1, 6)]
    for prompt in prompts:
        _ask(state, prompt)
        _ask(state, prompt)  # claimed
    view = state._view("m", "default", BS)
    walk = affinity.best_for_keys(sequence_keys(prompts[0], BS))
    assert walk is not None
    slots = view.cache.entry(walk).claimed
    assert slots is not None and 1 <= len(slots) <= 2


@pytest.mark.unit
def test_a_distinct_prompt_is_answered_as_without_claims(native: bool) -> None:
    """A prompt sharing all but its last block with a claimed one is not claimed: its answer
    is the reference's over the index's hits alone."""
    state, affinity = _cluster()
    prompt = list(range(1, 1 + 6 * BS))
    _ask(state, prompt)
    other = [*prompt[: 5 * BS], *range(500, 500 + BS)]
    keys = sequence_keys(other, BS)
    assert affinity.loads.claims and affinity.loads.claim(keys[-1], time.monotonic()) is None
    view = state._view("m", "default", BS)
    now = time.monotonic()
    fresh = [token is not None for token in affinity.loads.tokens(view.rank_streams, now)[0]]
    reference = rank_answer(
        view.tenant, view.plans, view.rank_plans, affinity.hits_for_keys(keys), affinity.loads, fresh, now,
        len(other), spread_key(other, BS), view.cfg, view.shape, state.metrics,
    ).answer.body["default"]  # fmt: skip
    got = _ask(state, other)
    assert got == reference and got["a"]["dp_detail"]["0"]["matched_tokens"] == 0


@pytest.mark.unit
def test_a_claimed_prompt_asked_again_is_rendered_once_and_committed_once(native_renders: list[int]) -> None:
    renders = native_renders
    state, affinity = _cluster()
    prompt = list(range(1, 1 + 6 * BS))
    _ask(state, prompt)  # rendered, committed: claimed
    changes = affinity.loads.changes
    answers = [_ask(state, prompt) for _ in range(5)]  # the group's other members
    assert len(renders) == 2  # the first under the claim rendered, the next given again
    assert affinity.loads.changes == changes and all(a == answers[0] for a in answers)
    text = state.render_metrics()
    assert f'scored_hit_tokens_total{{engine_dp_rank="0",instance="a"}} {5 * len(prompt)}' in text
    affinity.loads.apply(URLS[1], load_report([10.0]))  # another instance's report: rendered again, same claim
    assert _ask(state, prompt) == answers[0] and len(renders) == 3
