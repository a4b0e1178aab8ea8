"""The cache-aware dispatcher is fed by the fan-in's own per-message step.

Real rank publisher processes send their stores over the real internal channel (Unix
SEQPACKET, the default, and ZMQ ipc) to a real FanIn; the dispatcher is attached exactly as
the plugin's DataParallelController hook attaches it.  ``FanIn.ingest`` is the dispatcher's
only feed, so a live channel drain that skipped it would leave its index empty and every
decision ``no_hit``.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_tcp_endpoint
from kvpub_procs import run_prompt_rank, spawn_context

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.dispatch import REASON_CACHE_HIT
from sglang_kvpub.engine import guard
from sglang_kvpub.engine.dispatch_hook import attach_dispatcher
from sglang_kvpub.publish.fanin import FanIn

pytestmark = pytest.mark.integration

BLOCK = 16


def _prompt(rank: int) -> list[int]:
    return [(rank + 1) * 10_000 + i for i in range(6 * BLOCK)]


@pytest.fixture
def ranks() -> Iterator[list[Any]]:
    procs: list[Any] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.join(5.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("channel_kind", ["unixpkt", "ipc"])
def test_live_channel_feeds_the_dispatcher(channel_kind: str, tmp_path: Path, ranks: list[Any]) -> None:
    guard.reset()
    config = PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2)
    channel = f"{channel_kind}://{tmp_path}/ch.sock"
    fanin = FanIn(config, 2, channel_endpoint=channel)
    fanin.start()
    controller = types.SimpleNamespace(workers=[object(), object()])
    try:
        dispatcher = attach_dispatcher(controller, block_size=BLOCK, fanin=fanin)
        mp = spawn_context()
        for rank in (0, 1):
            proc = mp.Process(target=run_prompt_rank, args=(config, rank, channel, _prompt(rank), BLOCK), daemon=True)
            proc.start()
            ranks.append(proc)
        deadline = time.monotonic() + 30.0
        while dispatcher.index.stats().blocks < 12:
            assert time.monotonic() < deadline, f"dispatcher index never filled: {dispatcher.stats()}"
            time.sleep(0.02)  # polling a condition with a deadline
        for rank in (0, 1):
            decision = dispatcher.choose(_prompt(rank), [0.0, 0.0])
            assert (decision.rank, decision.reason, decision.matched_tokens) == (rank, REASON_CACHE_HIT, 6 * BLOCK)
        assert fanin.stats()["observer_errors"] == 0
    finally:
        fanin.stop()
