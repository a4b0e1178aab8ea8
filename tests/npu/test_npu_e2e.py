"""A real SGLang server with ``--plugin sglang_kvpub`` on 2 Ascend NPUs (or 2 CUDA GPUs).

``--dp-size 2 --enable-dp-attention --page-size 128``; the instance stream is recorded
while the scenario runs (tests/npu/npu_engine.py::run_scenario): the same long prompt
twice, one prompt pinned to each rank with ``routed_dp_rank``, eviction pressure on rank
0, then ``/flush_cache``.  Every assertion is a tests/e2e_checks.py function, the same
ones the CPU integration tier runs.  Skipped with the reason when the hardware, torch_npu,
sglang or ``$KVPUB_TEST_MODEL`` is missing (tests/npu/conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import e2e_checks as checks
import pytest
from conftest import free_tcp_port

from npu.npu_engine import EngineSpec, ScenarioResult, _evicted, _holds, run_scenario
from sglang_kvpub import wire

pytestmark = [pytest.mark.timeout(3600)]

DEVICES = [
    pytest.param("npu", marks=pytest.mark.npu, id="npu"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


@pytest.fixture(scope="module", params=DEVICES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScenarioResult]:
    spec = EngineSpec(
        device=request.param,
        model_path=os.environ["KVPUB_TEST_MODEL"],
        http_port=free_tcp_port(),
        kv_port=free_tcp_port(),
        replay_port=free_tcp_port(),
        max_total_tokens=int(os.environ.get("KVPUB_TEST_MAX_TOTAL_TOKENS", "16384")),
        extra_args=os.environ.get("KVPUB_TEST_SERVER_ARGS", "").split(),
    )
    log_dir: Path = tmp_path_factory.mktemp(f"engine-{request.param}")
    yield run_scenario(spec, log_dir, start_timeout=float(os.environ.get("KVPUB_TEST_START_TIMEOUT", "1200")))


def _ranks(run: ScenarioResult) -> list[int]:
    return list(range(run.spec.dp_size))


def test_one_stream_carries_both_ranks(run: ScenarioResult) -> None:
    checks.check_ranks_in_one_stream(run.stream, _ranks(run))
    checks.check_seq_increasing(run.stream)
    assert run.decode_errors == 0


def test_block_stored_gpu_medium_page_128(run: ScenarioResult) -> None:
    checks.check_stored_blocks(run.stream, medium=wire.MEDIUM_GPU, block_size=128, ranks=_ranks(run))


def test_pinned_prompts_land_on_their_rank(run: ScenarioResult) -> None:
    for rank, ids in run.pinned.items():
        assert checks.check_prompt_on_rank(run.stream, ids, rank, run.spec.page_size) == 2


def test_adapter_cold_then_kv_cache_affinity(run: ScenarioResult) -> None:
    checks.check_cold_decision(run.cold_decision)
    holders = [r for r in _ranks(run) if _holds(run.stream, run.long_prompt, r, run.spec.page_size)]
    assert holders, "no rank announced the long prompt"
    checks.check_affinity_decision(run.hot_decision, holders)


def test_block_removed_under_eviction_pressure(run: ScenarioResult) -> None:
    assert _evicted(run.stream, run.before_pressure_seq, run.before_flush_seq) > 0


def test_block_removed_after_flush_cache(run: ScenarioResult) -> None:
    checks.check_released_after(run.stream, run.before_flush_seq, _ranks(run))
