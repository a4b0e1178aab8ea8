"""Motor's kv_cache_affinity cost, fold_engine_dps and the conductor view, with hand-computed numbers."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest

from motor_adapter.scoring import (
    POLICY_AFFINITY,
    POLICY_LOAD_BALANCE,
    Candidate,
    ConfigError,
    KvAffinityConfig,
    conductor_response,
    fold_engine_dps,
    matched_tokens,
    prefill_cost,
    select,
)
from sglang_kvpub.wire import MEDIUM_GPU, BlockStored, EventBatch

pytestmark = pytest.mark.unit

try:  # the real index when it is there; the scoring only needs the three tier counts
    _index_mod: Any = importlib.import_module("sglang_kvpub.core.index")
    TierHit: Any = _index_mod.TierHit
except ImportError:
    _index_mod = None

    @dataclasses.dataclass(frozen=True)
    class TierHit:  # type: ignore[no-redef]
        npu_blocks: int
        cpu_blocks: int = 0
        disk_blocks: int = 0

        @property
        def total_blocks(self) -> int:
            return self.npu_blocks + self.cpu_blocks + self.disk_blocks


needs_index = pytest.mark.skipif(_index_mod is None, reason="sglang_kvpub.core.index is not there yet")

BS = 128
CFG = KvAffinityConfig()


def hit(npu: int, cpu: int = 0, disk: int = 0) -> Any:
    return TierHit(npu_blocks=npu, cpu_blocks=cpu, disk_blocks=disk)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def stored(tokens: list[int], first_hash: int, parent: int | None) -> BlockStored:
    blocks = len(tokens) // BS
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + blocks)),
        parent_block_hash=parent,
        token_ids=tokens[: blocks * BS],
        block_size=BS,
        medium=MEDIUM_GPU,
    )


# --------------------------------------------------------------------------- configuration


def test_defaults_are_motors() -> None:
    cfg = KvAffinityConfig()
    assert (cfg.mode, cfg.load_weight, cfg.overlap_credit, cfg.prefill_load_scale) == ("unified", 1.0, 1.0, 1.0)
    assert (cfg.w_npu, cfg.w_cpu, cfg.w_disk, cfg.hit_rate_threshold, cfg.block_size) == (1.0, 1.0, 0.0, 0.0, 128)
    assert cfg.load_gate_topn == 0
    assert cfg.gate_topn == 2
    assert KvAffinityConfig(load_gate_topn=5).gate_topn == 5


def test_from_motor_reads_the_whole_user_config() -> None:
    user_config = {
        "motor_coordinator_config": {
            "scheduler_config": {
                "scheduler_type": "kv_cache_affinity",
                "kv_affinity": {"mode": "load_gated", "load_gate_topn": 3, "w_cpu": 0.5, "hit_rate_threshold": 0},
            }
        },
        "kv_conductor_config": {"block_size": 512, "http_server_port": 13333},
    }
    cfg = KvAffinityConfig.from_motor(user_config)
    assert (cfg.mode, cfg.gate_topn, cfg.w_cpu, cfg.block_size) == ("load_gated", 3, 0.5, 512)


def test_from_motor_flat_keys_with_nested_winning() -> None:
    scheduler_config = {
        "kv_affinity_mode": "load_gated",
        "kv_affinity_load_weight": 0.25,
        "kv_affinity_overlap_credit": 0.5,
        "kv_affinity": {"load_weight": 2.0},
        "kv_conductor_config": {"block_size": 64},
    }
    cfg = KvAffinityConfig.from_motor(scheduler_config)
    assert (cfg.mode, cfg.load_weight, cfg.overlap_credit, cfg.block_size) == ("load_gated", 2.0, 0.5, 64)


def test_from_motor_accepts_the_kv_affinity_dict_itself() -> None:
    cfg = KvAffinityConfig.from_motor({"mode": "Unified", "w_disk": 0.1, "block_size": 128.0})
    assert (cfg.mode, cfg.w_disk, cfg.block_size) == ("unified", 0.1, 128)
    assert isinstance(cfg.block_size, int)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"mode": "fast"}, ["kv_affinity.mode", '"unified" or "load_gated"']),
        ({"w_npu": "1.0"}, ["kv_affinity.w_npu", "without quotes"]),
        ({"load_weight": -1}, ["kv_affinity.load_weight", ">= 0"]),
        ({"load_gate_topn": 1.5}, ["kv_affinity.load_gate_topn", "whole number"]),
        ({"hit_rate_threshold": 2}, ["kv_affinity.hit_rate_threshold", "[0, 1]"]),
        ({"block_size": 0}, ["kv_affinity.block_size", "page size"]),
        ({"w_hbm": 1.0}, ["kv_affinity.w_hbm", "not a kv_affinity setting", "w_npu"]),
        ({"overlap_credit": True}, ["kv_affinity.overlap_credit"]),
    ],
)
def test_from_motor_errors_name_the_key_and_the_fix(settings: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        KvAffinityConfig.from_motor(settings)
    assert len(info.value.problems) == 1
    for text in expected:
        assert text in str(info.value)


def test_from_motor_reports_every_problem_with_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        KvAffinityConfig.from_motor({"scheduler_config": {"kv_affinity": {"mode": 3, "w_cpu": None}}})
    assert len(info.value.problems) == 2
    assert all(p.startswith("scheduler_config.kv_affinity.") for p in info.value.problems)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="w_disk"):
        KvAffinityConfig(w_disk=-0.5)


# --------------------------------------------------------------------------- formulas


def test_matched_is_weighted_rounded_and_capped() -> None:
    cfg = KvAffinityConfig(w_cpu=0.5, w_disk=0.25)
    # 10 + 5*0.5 + 4*0.25 = 13.5 blocks -> 1728 tokens
    assert matched_tokens(hit(10, 5, 4), cfg, 4000) == 1728
    assert matched_tokens(hit(10), CFG, 1000) == 1000  # 1280 capped at isl
    assert matched_tokens(None, CFG, 1000) == 0
    # Python's round, as Motor's: 2.5 -> 2, 1.5 -> 2
    assert matched_tokens(hit(0, 5), KvAffinityConfig(w_cpu=0.1, block_size=5), 100) == 2
    assert matched_tokens(hit(0, 1), KvAffinityConfig(w_cpu=0.3, block_size=5), 100) == 2
    assert matched_tokens(hit(0, 0, 7), CFG, 5000) == 0  # w_disk defaults to 0


def test_prefill_cost_uses_overlap_credit_and_never_goes_negative() -> None:
    assert prefill_cost(1728, CFG, 4000) == 2272
    assert prefill_cost(1728, KvAffinityConfig(overlap_credit=0.5), 4000) == 3136
    assert prefill_cost(1000, KvAffinityConfig(overlap_credit=2.0), 1000) == 0


def test_unified_score_formula() -> None:
    cfg = KvAffinityConfig(w_cpu=0.5, w_disk=0.25, overlap_credit=0.5, prefill_load_scale=2.0, load_weight=0.5)
    decision = select(cfg, [Candidate("a", 100.0)], {"a": {3: hit(10, 5, 4)}}, 4000)
    # matched 1728; prefill_cost 4000 - 864 = 3136; score 2*3136 + 0.5*100
    assert decision.matched == 1728
    assert decision.score == 6322.0
    assert (decision.hbm, decision.cpu, decision.disk) == (1280, 640, 512)
    assert decision.dp_rank == 3


def test_unified_trades_hit_against_load() -> None:
    cands = [Candidate("hot", 3000.0), Candidate("cold", 0.0)]
    hits = {"hot": {0: hit(20)}, "cold": {}}
    # hot: (5000-2560) + 3000 = 5440 ; cold: 5000 + 0
    decision = select(CFG, cands, hits, 5000)
    assert (decision.instance_id, decision.score, decision.policy) == ("cold", 5000.0, POLICY_AFFINITY)
    assert decision.dp_rank is None
    # with load_weight 0.5, hot: 2440 + 1500 = 3940 < 5000
    decision = select(KvAffinityConfig(load_weight=0.5), cands, hits, 5000)
    assert (decision.instance_id, decision.score, decision.dp_rank) == ("hot", 3940.0, 0)
    assert [c.instance_id for c in decision.candidates] == ["hot", "cold"]


def test_unified_ties_keep_candidate_order() -> None:
    decision = select(CFG, [Candidate("x", 5.0), Candidate("y", 5.0)], {"x": {}, "y": {}}, 1000)
    assert decision.instance_id == "x"


def test_load_gated_keeps_the_least_loaded_then_longest_match() -> None:
    cands = [Candidate("a", 10.0), Candidate("b", 1.0), Candidate("c", 2.0), Candidate("d", 3.0)]
    hits = {"a": {0: hit(30)}, "b": {1: hit(5)}, "c": {2: hit(10)}, "d": {}}
    gated = KvAffinityConfig(mode="load_gated")  # topn 0 -> 2: b and c
    decision = select(gated, cands, hits, 5000)
    assert (decision.instance_id, decision.dp_rank, decision.matched) == ("c", 2, 1280)
    assert [(c.instance_id, c.gated_out) for c in decision.candidates] == [
        ("c", False),
        ("b", False),
        ("d", True),
        ("a", True),
    ]
    assert select(dataclasses.replace(gated, load_gate_topn=3), cands, hits, 5000).instance_id == "c"
    assert select(dataclasses.replace(gated, load_gate_topn=4), cands, hits, 5000).instance_id == "a"


def test_load_gated_equal_match_goes_to_lower_load() -> None:
    cands = [Candidate("a", 2.0), Candidate("b", 1.0)]
    decision = select(KvAffinityConfig(mode="load_gated"), cands, {"a": {0: hit(4)}, "b": {5: hit(4)}}, 1000)
    assert (decision.instance_id, decision.dp_rank) == ("b", 5)


# --------------------------------------------------------------------------- the report's scenarios


def test_report_scenario_16_ranks_rank_7_holds_5000_tokens() -> None:
    hits = {"prefill-0": {7: hit(39)}, "prefill-1": {}}
    cands = [Candidate("prefill-0", 0.0), Candidate("prefill-1", 0.0)]
    decision = select(CFG, cands, hits, 5000)
    assert decision.policy == POLICY_AFFINITY
    assert (decision.instance_id, decision.dp_rank, decision.matched, decision.hbm) == ("prefill-0", 7, 4992, 4992)
    assert decision.score == 8.0  # 5000 - 4992


@needs_index
def test_report_scenario_through_the_real_index() -> None:
    tokens = prompt(5000)
    index = _index_mod.PrefixIndex(BS)
    for rank in range(16):  # every rank is busy with something else
        index.apply_batch(
            "prefill-0", EventBatch(ts=0.0, events=[stored(prompt(256, 90_000 + rank * 300), 1, None)], dp_rank=rank)
        )
    index.apply_batch("prefill-0", EventBatch(ts=1.0, events=[stored(tokens, 500, None)], dp_rank=7))
    found = index.query(tokens, instances=["prefill-0"])
    assert found["prefill-0"][7].npu_blocks == 39
    hits = {"prefill-0": found.get("prefill-0", {}), "prefill-1": {}}
    decision = select(CFG, [Candidate("prefill-1", 0.0), Candidate("prefill-0", 0.0)], hits, len(tokens))
    assert (decision.instance_id, decision.dp_rank, decision.matched, decision.policy) == (
        "prefill-0",
        7,
        4992,
        POLICY_AFFINITY,
    )


def test_report_logged_case_20_blocks() -> None:
    decision = select(CFG, [Candidate("vllm-prefill-0", 12.0)], {"vllm-prefill-0": {0: hit(20)}}, 5000)
    line = decision.log_line(role="prefill", req_id="r1")
    assert line.startswith("scheduled role=prefill req_id=r1 instance=vllm-prefill-0 ")
    assert "policy=kv_cache_affinity matched=2560 hbm=2560 cpu=0 disk=0 dp_rank=0 load=12.0 score=2452.0" in line
    assert "reason=" not in line


# --------------------------------------------------------------------------- fold_engine_dps


def test_fold_takes_the_best_single_rank_never_the_union() -> None:
    folded = fold_engine_dps({0: hit(10), 1: hit(8, 8)}, CFG)
    assert folded is not None
    assert (folded.dp_rank, folded.npu_blocks, folded.cpu_blocks, folded.total_blocks) == (1, 8, 8, 16)
    # with CPU worth nothing rank 0 wins
    folded = fold_engine_dps({0: hit(10), 1: hit(8, 8)}, KvAffinityConfig(w_cpu=0.0))
    assert folded is not None and folded.dp_rank == 0


def test_fold_ties_prefer_npu_then_lower_rank() -> None:
    folded = fold_engine_dps({1: hit(3, 2), 2: hit(5)}, CFG)
    assert folded is not None and folded.dp_rank == 2
    folded = fold_engine_dps({3: hit(5), 1: hit(5)}, CFG)
    assert folded is not None and folded.dp_rank == 1


def test_fold_of_nothing_is_none() -> None:
    assert fold_engine_dps({}, CFG) is None
    assert fold_engine_dps({0: hit(0)}, CFG) is None


def test_split_across_ranks_is_not_a_hit_fake_hits() -> None:
    # rank A holds blocks 0-9 of the prompt, rank B blocks 10-19: B's prefix match is empty.
    folded = fold_engine_dps({0: hit(10)}, CFG)
    assert folded is not None and folded.total_blocks == 10
    decision = select(CFG, [Candidate("p", 0.0)], {"p": {0: hit(10)}}, 20 * BS)
    assert decision.matched == 10 * BS


@needs_index
def test_split_across_ranks_is_not_a_hit_real_index() -> None:
    tokens = prompt(20 * BS)
    index = _index_mod.PrefixIndex(BS)
    first = stored(tokens[: 10 * BS], 1, None)
    second = stored(tokens[10 * BS :], 11, 10)
    index.apply_batch("p", EventBatch(ts=0.0, events=[first], dp_rank=0))
    index.apply_batch("p", EventBatch(ts=0.0, events=[second], dp_rank=1))
    found = index.query(tokens, instances=["p"]).get("p", {})
    folded = fold_engine_dps(found, CFG)
    assert folded is not None
    assert (folded.dp_rank, folded.total_blocks) == (0, 10)
    assert select(CFG, [Candidate("p", 0.0)], {"p": found}, len(tokens)).matched == 10 * BS


def test_disk_only_hit_with_zero_weight_pins_no_rank() -> None:
    decision = select(CFG, [Candidate("p", 0.0)], {"p": {4: hit(0, 0, 9)}}, 5000)
    assert (decision.policy, decision.matched, decision.dp_rank, decision.disk) == (POLICY_AFFINITY, 0, None, 9 * BS)


# --------------------------------------------------------------------------- fast path, threshold, fallbacks


def test_short_prompt_fast_path_ranks_by_load_without_the_index() -> None:
    cands = [Candidate("a", 7.0), Candidate("b", 3.0)]
    decision = select(CFG, cands, None, 100)  # no index data needed
    assert (decision.policy, decision.instance_id, decision.matched, decision.dp_rank) == (
        POLICY_AFFINITY,
        "b",
        0,
        None,
    )
    assert decision.fast_path
    assert decision.score == 103.0
    assert "fast_path=True" in decision.log_line()
    # hits are ignored on the fast path
    assert select(CFG, cands, {"a": {0: hit(1)}}, 127).instance_id == "b"


def test_hit_rate_threshold() -> None:
    cfg = KvAffinityConfig(hit_rate_threshold=0.5)
    cands = [Candidate("hot", 9.0), Candidate("cold", 1.0)]
    above = select(cfg, cands, {"hot": {2: hit(20)}, "cold": {}}, 5000)  # 2560/5000 = 0.512
    assert (above.policy, above.instance_id, above.dp_rank) == (POLICY_AFFINITY, "hot", 2)
    below = select(cfg, cands, {"hot": {2: hit(19)}, "cold": {}}, 5000)  # 2432/5000 = 0.4864
    assert (below.policy, below.instance_id, below.matched, below.dp_rank) == (POLICY_LOAD_BALANCE, "cold", None, None)
    assert below.reason is not None and "hit_rate_threshold" in below.reason
    # exactly at the threshold also balances load
    assert select(cfg, cands, {"hot": {0: hit(1)}}, 256).policy == POLICY_LOAD_BALANCE


@pytest.mark.parametrize(
    ("hits", "isl", "reason"),
    [
        ({"a": {0: hit(5)}}, 0, "no token ids"),
        (None, 1000, "no index data"),
        ({"other": {0: hit(5)}}, 1000, "no index data for any candidate"),
    ],
)
def test_fallbacks_pick_the_least_loaded_with_a_reason(hits: Any, isl: int, reason: str) -> None:
    cands = [Candidate("a", 4.0, "http://a"), Candidate("b", 2.0, "http://b"), Candidate("c", 2.0)]
    decision = select(CFG, cands, hits, isl)
    assert (decision.policy, decision.instance_id, decision.endpoint, decision.reason) == (
        POLICY_LOAD_BALANCE,
        "b",
        "http://b",
        reason,
    )
    line = decision.log_line()
    assert "policy=load_balance matched=None hbm=None" in line
    assert f'reason="{reason}"' in line


def test_all_zero_matches_do_not_fall_back() -> None:
    decision = select(CFG, [Candidate("a", 4.0), Candidate("b", 2.0)], {"a": {}, "b": {}}, 1000)
    assert (decision.policy, decision.instance_id, decision.matched, decision.reason) == (POLICY_AFFINITY, "b", 0, None)


def test_candidates_the_index_does_not_know_are_skipped() -> None:
    decision = select(CFG, [Candidate("unknown", 0.0), Candidate("known", 50.0)], {"known": {}}, 1000)
    assert decision.instance_id == "known"
    assert [c.instance_id for c in decision.candidates] == ["known"]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="candidate"):
        select(CFG, [], {}, 1000)


def test_decision_to_dict_round_trips_the_breakdown() -> None:
    decision = select(CFG, [Candidate("a", 1.0), Candidate("b", 0.0)], {"a": {1: hit(2)}, "b": {}}, 1000)
    data = decision.to_dict()
    assert data["instance_id"] == decision.instance_id and data["policy"] == POLICY_AFFINITY
    assert {c["instance_id"]: c["matched"] for c in data["candidates"]} == {"a": 256, "b": 0}
    assert data["candidates"][0]["prefill_cost"] == 744.0


# --------------------------------------------------------------------------- conductor view


def test_conductor_response_folds_engine_ranks_into_the_registered_dp() -> None:
    hits = {"vllm-prefill-0": {3: hit(2, 1), 7: hit(20)}}
    body = conductor_response(hits, {"vllm-prefill-0": [0], "vllm-prefill-1": [0]}, BS)
    warm = {"matched_tokens": 2560, "npu_blocks": 20, "cpu_blocks": 0, "disk_blocks": 0, "engine_dp_rank": 7}
    cold = {"matched_tokens": 0, "npu_blocks": 0, "cpu_blocks": 0, "disk_blocks": 0, "engine_dp_rank": None}
    assert body == {
        "default": {
            "vllm-prefill-0": {
                "longest_matched": 2560,
                "GPU": 2560,
                "CPU": 0,
                "DISK": 0,
                "DP": {"0": 2560},
                "dp_detail": {"0": warm},
            },
            "vllm-prefill-1": {
                "longest_matched": 0,
                "GPU": 0,
                "CPU": 0,
                "DISK": 0,
                "DP": {"0": 0},
                "dp_detail": {"0": cold},
            },
        }
    }
    dicts = conductor_response(hits, {"vllm-prefill-0": [0]}, BS, shape="rank_dicts")["default"]["vllm-prefill-0"]
    assert dicts == {"longest_matched": 2560, "GPU": 2560, "CPU": 0, "DISK": 0, "DP": {"0": warm}}


def test_conductor_response_tokens_are_motors_weighted_match() -> None:
    """``DP`` ints are what a dict-per-rank Motor computes from the dict: tiers x weights x block_size."""
    hits = {"p": {2: hit(3, 4, 5)}}
    cfg = KvAffinityConfig(w_npu=1.0, w_cpu=0.5, w_disk=0.25)
    entry = conductor_response(hits, {"p": [0]}, BS, cfg=cfg)["default"]["p"]
    assert entry["DP"] == {"0": round((3 + 4 * 0.5 + 5 * 0.25) * BS)}
    assert (entry["GPU"], entry["CPU"], entry["DISK"]) == (3 * BS, 4 * BS, 5 * BS)
    assert entry["longest_matched"] == entry["dp_detail"]["0"]["matched_tokens"] == 12 * BS
    with pytest.raises(ValueError, match="shape"):
        conductor_response(hits, {"p": [0]}, BS, shape="ints")


def test_conductor_response_fold_uses_motor_weights_but_reports_unweighted_tokens() -> None:
    hits = {"p": {0: hit(0, 0, 30), 1: hit(10)}}
    entry = conductor_response(hits, {"p": [0]}, BS)["default"]["p"]["dp_detail"]["0"]
    assert (entry["engine_dp_rank"], entry["matched_tokens"]) == (1, 1280)  # w_disk=0: disk-only rank loses
    cfg = KvAffinityConfig(w_disk=1.0)
    entry = conductor_response(hits, {"p": [0]}, BS, cfg=cfg)["default"]["p"]["dp_detail"]["0"]
    assert (entry["engine_dp_rank"], entry["disk_blocks"], entry["matched_tokens"]) == (0, 30, 3840)


def test_conductor_response_per_rank_registration_and_tenant() -> None:
    hits = {"p": {1: hit(3, 1), 2: hit(5)}}
    body = conductor_response(hits, {"p": [0, 1, 2, 3]}, BS, tenant="t1")
    dp = body["t1"]["p"]["dp_detail"]
    assert list(dp) == list(body["t1"]["p"]["DP"]) == ["0", "1", "2", "3"]
    assert (dp["1"]["matched_tokens"], dp["1"]["engine_dp_rank"], dp["0"]["matched_tokens"]) == (512, 1, 0)
    assert body["t1"]["p"]["DP"] == {"0": 0, "1": 512, "2": 640, "3": 0}
    assert body["t1"]["p"]["longest_matched"] == 640 and body["t1"]["p"]["GPU"] == 640
    # fold=False with a single registered dp reads that rank only
    assert conductor_response(hits, {"p": [2]}, BS, fold=False)["default"]["p"]["dp_detail"]["2"]["npu_blocks"] == 5


def test_conductor_response_without_registrations() -> None:
    hits = {"p": {1: hit(3), 2: hit(5)}}
    assert conductor_response(hits, None, BS)["default"]["p"]["dp_detail"]["0"]["engine_dp_rank"] == 2
    unfolded = conductor_response(hits, None, BS, fold=False)["default"]["p"]["DP"]
    assert sorted(unfolded) == ["1", "2"]
    assert conductor_response({}, None, BS) == {"default": {}}
