"""The originating report's path, whole and real, in one test tier.

Motor's real coordinator (``mindie-motor``, unmodified, configured from
``docs/examples/motor_user_config.json``) -> ``motor-kv-adapter serve`` as its kv-conductor ->
one real SGLang 0.5.23 CPU server with ``--dp-size 2 --plugin sglang_kvpub`` (its default
cache-aware dispatch).  The same long prompt twice through Motor's ``/v1/completions``:
Motor scores request 2 with kv_cache_affinity on a real hit, and SGLang serves it from the
cache of the rank that holds the prefix; a new prompt is a clean miss.  The checks read the
three processes' own log lines (bench/e2e_rig.py parses them), the lines an operator reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e_rig
import pytest
import sglang_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

PAGE = 128  # the example config's page-size / block-size
PROMPT_WORDS = 1000  # ~5k tokens with the test model's tokenizer: the report's long prefix


@pytest.fixture(scope="module", params=["rust", "python"])
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e_rig.Rig]:
    """The whole path once per radix tree core SGLang 0.5.23 ships (Rust is its default)."""
    work = tmp_path_factory.mktemp(f"e2e-{request.param}")
    model = sglang_server.make_model_dir(work / "model")
    rig = e2e_rig.Rig(e2e_rig.RigSpec(work_dir=work, model_dir=model, page_size=PAGE, tree_core=request.param))
    with rig:
        yield rig


@pytest.fixture(scope="module")
def tokenizer(rig: e2e_rig.Rig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(rig.spec.model_dir))  # the one Motor and SGLang load


def _token_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids: list[int] = tokenizer(prompt)["input_ids"]
    return ids


def test_the_example_motor_config_loads_and_registers_the_instance(rig: e2e_rig.Rig) -> None:
    example = json.loads(Path(e2e_rig.EXAMPLE_CONFIG).read_text(encoding="utf-8"))
    assert rig.model_name == example["motor_engine_prefill_config"]["model_config"]["model_name"]
    # Motor logs its registration once the adapter answered: after the adapter's own line.
    registered = f"Register success! {e2e_rig.INSTANCE}"
    rig.wait_for(lambda: registered in rig.coordinator.log(), registered, 30)
    motor_log = rig.coordinator.log()
    sent = [line for line in motor_log.splitlines() if "register_data" in line]
    assert sent and f"tcp://127.0.0.1:{rig.server.spec.kv_port}" in sent[-1] and f"'block_size': {PAGE}" in sent[-1]
    adapter_log = rig.adapter_text()
    assert f"registered {e2e_rig.INSTANCE} dp 0" in adapter_log
    assert "instance stream with dp_size 2" in adapter_log and "plain engine stream" not in adapter_log


def test_the_same_long_prompt_twice_is_scored_by_motor_and_served_from_the_holding_rank(
    rig: e2e_rig.Rig, tokenizer: Any
) -> None:
    prompt = e2e_rig.prompt_text(21, PROMPT_WORDS)
    ids = _token_ids(tokenizer, prompt)
    full = len(ids) // PAGE * PAGE
    assert full >= 10 * PAGE and len(ids) % PAGE, len(ids)  # a long prompt with a partial last page

    cold = rig.complete(prompt)
    assert cold.status == 200, cold.body
    assert [s.matched for s in cold.scores] == [0], cold.scores  # Motor scored it, a miss
    holder = cold.served_rank
    assert holder is not None and cold.cached_tokens == 0, cold.prefills
    rig.wait_for_hit(ids)  # the instance stream carried request 1's blocks to the adapter

    def scores_the_holder() -> dict[str, Any] | None:
        # The adapter scores the rank that would serve: the holder once the rank-load message
        # shows it idle again (it may still count request 1 for a report or two).
        entry = rig.adapter_hit(ids)
        return entry if entry and entry["dp_detail"]["0"]["engine_dp_rank"] == holder else None

    entry = rig.wait_for(scores_the_holder, "the adapter scoring the holding rank", 30.0)
    assert entry["dp_detail"]["0"].get("scored_rank") == holder, entry  # the rank-load message reached it

    hot = rig.complete(prompt)
    assert hot.status == 200, hot.body
    (score,) = hot.scores
    assert score.matched == full and score.engine_dp_rank == holder, score  # kv_cache_affinity on the hit
    assert hot.served_rank == holder, (holder, hot.prefills)  # SGLang put it on the rank that holds it
    assert hot.cached_tokens == full, hot.prefills  # ... and served it from that rank's cache
    assert [(d["dp_rank"], d["reason"], d["matched"]) for d in hot.dispatches] == [(holder, "cache_hit", full)]
    usage = hot.body["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens") == full, usage


def test_a_new_prompt_is_a_clean_miss(rig: e2e_rig.Rig, tokenizer: Any) -> None:
    prompt = e2e_rig.prompt_text(22, PROMPT_WORDS)
    ids = _token_ids(tokenizer, prompt)
    # Probed one block short: an answer to the whole prompt would claim it on a rank until the
    # next rank-load report, and Motor's query right after would read the claim (docs/dispatch.md).
    before = rig.adapter_hit(ids[: (len(ids) // rig.spec.page_size - 1) * rig.spec.page_size])
    assert before is not None and before["longest_matched"] == 0, before
    new = rig.complete(prompt)
    assert new.status == 200, new.body
    (score,) = new.scores
    assert score.matched == 0 and score.engine_dp_rank is None, score
    assert new.cached_tokens == 0 and new.served_rank is not None, new.prefills
    assert all(d["reason"] != "cache_hit" for d in new.dispatches), new.dispatches
    assert "Traceback" not in rig.coordinator.log() and "hook failed" not in rig.server.log_text()
