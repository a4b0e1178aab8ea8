"""What a rank is prefilling travels in the rank-load message (wire.RankLoad.pending) and the
adapter's answer counts it: Motor's unchanged cost then picks the instance whose rank will hold
the prefix (motor_adapter/pending_hits.py, rank_loads.py, engine/load_report.py)."""

from __future__ import annotations

import time

import msgspec
import pytest

from motor_adapter.affinity import KvAffinity, NoSubscriber
from motor_adapter.registration import parse_registration
from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from motor_adapter.state import AdapterState
from sglang_kvpub import wire
from sglang_kvpub.core.dispatch import CacheAwareDispatcher
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.engine.load_report import ControllerLoads

pytestmark = pytest.mark.unit

BLOCK = 16
STREAMS = ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557")


class OldRankLoad(msgspec.Struct, array_like=True):
    """The five-element rank entry adapters read before ``pending`` existed."""

    dp_rank: int
    load_tokens: float
    requests: int = 0
    cached_tokens_total: int = 0
    prefill_tokens_total: int = 0


class OldRankLoads(msgspec.Struct, tag="RankLoads"):
    ranks: list[OldRankLoad]


def _report(pending: dict[int, list[int]], ranks: int = 4, load: float = 0.0) -> wire.LoadReport:
    figures = wire.RankLoads([wire.RankLoad(r, load, pending=pending.get(r, [])) for r in range(ranks)], {}, 0.1)
    codec = wire.LoadReportCodec()
    report = codec.decode(codec.encode(1.0, figures))
    assert report is not None
    return report


def test_pending_keys_round_trip_and_readers_that_predate_them_skip_them() -> None:
    report = _report({2: [7, 8, 9]})
    assert [r.pending for r in report.loads.ranks] == [[], [], [7, 8, 9], []]
    payload = wire.LoadReportCodec().encode(1.0, report.loads)

    old = msgspec.msgpack.decode(payload, type=tuple[float, list[int], None, OldRankLoads])
    assert [r.dp_rank for r in old[3].ranks] == [0, 1, 2, 3]
    batch = wire.BatchDecoder().decode(payload)  # every consumer that does not know the message: a heartbeat
    assert (batch.events, batch.dp_rank) == ([], None)
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    assert list(msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload).events) == []


def test_a_report_naming_too_many_pending_keys_is_refused() -> None:
    figures = wire.RankLoads([wire.RankLoad(0, 0.0, pending=list(range(wire.MAX_PENDING_KEYS + 1)))], {}, 0.1)
    codec = wire.LoadReportCodec()
    with pytest.raises(wire.WireError):
        codec.decode(codec.encode(1.0, figures))


def test_the_controller_reports_each_ranks_pending_keys_and_its_riders_off_the_load() -> None:
    dispatcher = CacheAwareDispatcher(2, BLOCK, capacity_blocks=None, pending=True)
    prompt = list(range(1, 1 + 6 * BLOCK))
    first = dispatcher.choose(prompt, [0.0, 0.0], rid="a")
    assert first.rank is not None
    other = 1 - first.rank
    loads = [0.0, 0.0]
    loads[first.rank], loads[other] = len(prompt), 2 * len(prompt)
    rider = dispatcher.choose(prompt, loads, rid="b")
    assert rider.rank == first.rank and rider.pending_tokens == len(prompt)

    class Snap:
        def __init__(self, rank: int, total: int) -> None:
            self.dp_rank, self.timestamp, self.num_total_tokens = rank, time.time() + 60.0, total
            self.num_running_reqs = self.num_waiting_reqs = 0
            self.total_prefill_uncached_tokens, self.cache_hit_rate = 0, 0.0

    totals = {first.rank: 2 * len(prompt), other: 0}  # the engine counts both members in full
    figures = ControllerLoads(lambda: [Snap(r, totals[r]) for r in (0, 1)], dispatcher, 0.1)()
    assert figures is not None
    by_rank = {r.dp_rank: r for r in figures.ranks}
    assert by_rank[first.rank].pending == sequence_keys(prompt, BLOCK)
    assert by_rank[first.rank].load_tokens == len(prompt)  # the rider waits, it is not work
    assert by_rank[other].pending == []


def _state() -> tuple[AdapterState, KvAffinity]:
    state = AdapterState(
        ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BLOCK)),
        affinity_factory=lambda c, cap: KvAffinity(c, cap, subscriber_factory=NoSubscriber),
    )
    for i, stream in enumerate(STREAMS):
        body = {"instance_id": f"vllm-prefill-{i}", "endpoint": stream, "type": "vLLM"}
        state.register(parse_registration({**body, "modelname": "m", "block_size": BLOCK, "dp_rank": 0}))
    affinity = state.affinity("m", "default", BLOCK)
    assert affinity is not None
    return state, affinity


def test_the_answer_scores_the_instance_whose_rank_is_prefilling_the_prompt() -> None:
    state, affinity = _state()
    prompt = list(range(1, 1 + 8 * BLOCK))
    keys = sequence_keys(prompt, BLOCK)
    affinity.loads.apply(STREAMS[0], _report({}, load=100.0))
    affinity.loads.apply(STREAMS[1], _report({2: keys}, load=100.0))  # rank 2 of instance 1 has it queued
    answer = state.query("m", "default", BLOCK, prompt)["default"]
    busy, idle = answer["vllm-prefill-1"], answer["vllm-prefill-0"]
    assert busy["dp_detail"]["0"]["scored_rank"] == 2 and busy["DP"]["0"] == len(prompt)
    assert idle["DP"]["0"] < busy["DP"]["0"]  # Motor's cost picks instance 1
    affinity.loads.apply(STREAMS[1], _report({}, load=100.0))  # its prefill ended without a store: gone
    answer = state.query("m", "default", BLOCK, prompt)["default"]
    assert answer["vllm-prefill-1"]["DP"]["0"] <= answer["vllm-prefill-0"]["DP"]["0"] + 1
