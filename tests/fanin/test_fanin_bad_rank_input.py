"""Bad input from a rank never stops the fan-in or a process's rank sender (review findings)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import wait_for

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher

pytestmark = pytest.mark.integration


def _stored(hashes: list[int], tokens: list[int], size: int) -> wire.BlockStored:
    return wire.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=size)


@pytest.mark.unit
def test_residency_skips_ids_beyond_64_bits_and_misaligned_stores() -> None:
    residency = RankResidency()
    residency.apply(_stored([1, 2], [1, 1 << 63], 1))  # u64 ids decode fine but fit no signed array
    residency.apply(_stored([3, 4], [1, 2, 3], 1))  # 3 tokens for 2 blocks
    residency.apply(_stored([5], [7, 8], 2))
    assert residency.invalid_tokens == 4
    assert residency.hashes("GPU") == [5]
    assert [e.block_hashes for e in residency.snapshot_events() if isinstance(e, wire.BlockStored)] == [[5]]


@pytest.mark.timeout(60)
def test_fanin_keeps_serving_after_bad_and_out_of_range_batches(ipc_dir: Path) -> None:
    config = PluginConfig(endpoint="tcp://127.0.0.1:1", bind=True, heartbeat_s=60.0)
    fanin = FanIn(config, 2, listen_channel=False)
    fanin.start()
    try:
        fanin.ingest(0, 1, 0, wire.EventBatch(ts=1.0, events=[_stored([1, 2], [5, 1 << 63], 1)]))
        fanin.ingest(7, 1, 0, wire.EventBatch(ts=1.0, events=[_stored([9], [1], 1)]))  # no rank 7 here
        fanin.ingest(1, 1, 0, wire.EventBatch(ts=1.0, events=[_stored([3], [4], 1)]))
        stats = fanin.stats()
        assert 7 not in stats["ranks"] and stats["malformed"] >= 1
        assert stats["ranks"][1]["resident"] == {"GPU": 1}
    finally:
        fanin.stop()


@pytest.mark.timeout(60)
def test_one_unencodable_batch_does_not_stop_the_process_sender(ipc_dir: Path) -> None:
    config = PluginConfig(endpoint="tcp://127.0.0.1:1", bind=True, heartbeat_s=60.0)
    channel = f"ipc://{ipc_dir}/channel"
    fanin = FanIn(config, 2, channel_endpoint=channel)
    fanin.start()
    ranks = [RankPublisher(config, rank, 1, channel) for rank in range(2)]
    try:
        ranks[0].publish(wire.EventBatch(ts=1.0, events=[_stored([1], [1 << 70], 1)]))  # msgspec cannot encode
        ranks[1].publish(wire.EventBatch(ts=1.0, events=[_stored([2], [3], 1)]))
        wait_for(lambda: fanin.stats()["ranks"].get(1, {}).get("batches", 0) >= 1, "rank 1's batch")
        assert ranks[0].stats["encode_errors"] == 1
    finally:
        for rank in ranks:
            rank.shutdown()
        fanin.stop()
