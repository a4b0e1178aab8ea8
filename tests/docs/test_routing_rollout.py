"""The generated RL-rollout workload of bench/routing.py (``--workload rollout``)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpub_bench_routing_rollout", BENCH / "routing.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvpub_bench_routing_rollout"] = mod
    spec.loader.exec_module(mod)
    return mod


routing = _load()


def test_rollout_is_steps_of_groups_of_identical_prompts_under_one_shared_prompt() -> None:
    records = routing.rollout_records(7)
    assert len(records) == 24 * 32 * 8
    steps = Counter(r["timestamp"] for r in records)
    assert len(steps) == 24 and set(steps.values()) == {256}  # each step sent at once
    groups = Counter((r["timestamp"], tuple(r["hash_ids"]), r["input_length"]) for r in records)
    assert set(groups.values()) == {8}  # GRPO groups: 8 identical prompts
    shared = records[0]["hash_ids"][:6]
    assert all(r["hash_ids"][:6] == shared for r in records)  # the 3k-token instruction prompt
    assert all(3072 + 500 <= r["input_length"] <= 3072 + 4500 for r in records)


def test_rollout_is_a_function_of_the_seed_and_sends_groups_interleaved() -> None:
    assert routing.rollout_records(3) == routing.rollout_records(3)
    assert routing.rollout_records(3) != routing.rollout_records(4)
    first = routing.rollout_records(3)[:8]
    assert len({tuple(r["hash_ids"]) for r in first}) > 1  # not one group after another


def test_rollout_runs_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "rollout", "--limit", "512", "--policies", "round_robin,oracle", "--no-plot", "--out-dir"]
    code = routing.main([*argv, str(tmp_path)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and '"trace": "rollout"' in lines[0]
    assert (tmp_path / "routing_rollout.jsonl").is_file()
