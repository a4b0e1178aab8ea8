"""The default /query answer scores the same in every released Motor (tests/fixtures/motor_versions.json).

Each reader below restates, in our words, how one Motor version reads the conductor's answer
(the fixture says where each rule was seen); the adapter's real answer for the fixture's hits
must give every reader the same instance, endpoint and matched tokens, and the per-rank dict
layout must trip exactly the versions that compare DP values as ints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from motor_adapter.scoring import KvAffinityConfig, conductor_response
from sglang_kvpub.core.index import TierHit

pytestmark = pytest.mark.unit

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "motor_versions.json").read_text())
BS = 128
ISL = 4000


def read_3_0_0b2(tenant: dict[str, Any]) -> tuple[str, str, int]:
    best, best_gpu, dp = None, 0, {}
    for name, data in tenant.items():
        gpu = data.get("GPU", 0)
        if gpu < best_gpu:
            continue
        best, best_gpu, dp = name, gpu, data.get("DP", {})
    endpoint, top = None, 0
    for ep in ("0",):
        value = dp.get(ep, 0)
        if value < top:
            continue
        endpoint, top = ep, value
    assert best is not None and endpoint is not None
    return best, endpoint, top


def read_ascend_head(tenant: dict[str, Any]) -> tuple[str, str, int]:
    scored = []
    for name, data in tenant.items():
        matched = min(data.get("DP", {}).get("0", 0), ISL)
        scored.append((ISL - matched, name, matched))
    _cost, name, matched = sorted(scored)[0]
    return name, "0", matched


def read_dict_fork(tenant: dict[str, Any]) -> tuple[str, str, int]:
    w = {"npu_blocks": 1.0, "cpu_blocks": 1.0, "disk_blocks": 0.0}
    scored = []
    for name, data in tenant.items():
        raw = data.get("DP", {}).get("0", 0)
        if isinstance(raw, dict):
            matched = round(sum(float(raw.get(k) or 0) * v for k, v in w.items()) * BS)
        else:
            matched = int(raw or 0)
        matched = min(matched, ISL)
        scored.append((ISL - matched, name, matched))
    _cost, name, matched = sorted(scored)[0]
    return name, "0", matched


READERS = {"mindie-motor 3.0.0b2": read_3_0_0b2, "Ascend": read_ascend_head, "dict-per-rank": read_dict_fork}


def _answer(shape: str) -> dict[str, Any]:
    hits = {"vllm-prefill-0": {0: TierHit(0, 0, 0), 1: TierHit(20, 0, 0)}, "vllm-prefill-1": {}}
    dps = {"vllm-prefill-0": [0], "vllm-prefill-1": [0]}
    return conductor_response(hits, dps, BS, cfg=KvAffinityConfig(block_size=BS), shape=shape)


def test_the_recorded_answer_is_what_the_adapter_sends() -> None:
    assert _answer("tokens") == FIXTURE["answer"]


@pytest.mark.parametrize("version", sorted(FIXTURE["versions"]))
def test_every_motor_scores_the_default_answer(version: str) -> None:
    reader = next(fn for key, fn in READERS.items() if version.startswith(key))
    want = FIXTURE["versions"][version]["scores_from_answer"]
    assert reader(_answer("tokens")["default"]) == (want["instance"], want["endpoint"], want["matched"])


def test_rank_dicts_serve_the_forks_and_trip_the_int_readers() -> None:
    tenant = _answer("rank_dicts")["default"]
    assert read_dict_fork(tenant) == ("vllm-prefill-0", "0", 2560)
    with pytest.raises(TypeError):
        read_3_0_0b2(tenant)
    with pytest.raises(TypeError):
        read_ascend_head(tenant)
