"""Process entry points for the fan-in tests (importable by multiprocessing's spawn).

Batches are deterministic in (rank, index), so the test process can check every event:
batch i of rank r stores block ``hash_of(r, i)`` (parent: the previous block of that
rank, tokens derived from both), and every 5th batch also removes the block from 3 batches
earlier; every 7th stores a CPU_PINNED copy with medium set by the engine.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.wire import MEDIUM_CPU, BlockRemoved, BlockStored, Event, EventBatch

BLOCK_SIZE = 4


def hash_of(rank: int, index: int) -> int:
    return (rank << 32) | (index + 1)


def batch_events(rank: int, index: int) -> list[Event]:
    tokens = [rank * 1000 + index * BLOCK_SIZE + j for j in range(BLOCK_SIZE)]
    parent = hash_of(rank, index - 1) if index else None
    events: list[Event] = [BlockStored(block_hashes=[hash_of(rank, index)], parent_block_hash=parent, token_ids=tokens)]
    if index % 5 == 4:
        events.append(BlockRemoved(block_hashes=[hash_of(rank, index - 3)]))
    if index % 7 == 6:
        events.append(
            BlockStored(
                block_hashes=[hash_of(rank, index)],
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BLOCK_SIZE,
                medium=MEDIUM_CPU,
            )
        )
    return events


def run_fanin(config: PluginConfig, dp_size: int, channel: str, ready: Any, commands: Any, answers: Any) -> None:
    """The fan-in in its own process; answers ``"stats"`` commands until ``"stop"``."""
    from sglang_kvpub.publish.fanin import FanIn

    fanin = FanIn(config, dp_size, channel_endpoint=channel)
    fanin.start()
    ready.set()
    try:
        serve_commands(commands, lambda _command: answers.put(fanin.stats()))
    finally:
        fanin.stop()


def serve_commands(commands: Any, handle: Callable[[Any], None]) -> None:
    """``handle(command)`` for each command from the queue until ``"stop"``."""
    while True:
        try:
            command = commands.get(timeout=10.0)
        except queue.Empty:
            continue
        if command == "stop":
            return
        handle(command)


def run_rank(
    config: PluginConfig,
    rank: int,
    channel: str,
    count: int,
    go: Any,
    done: Any,
    interval_s: float = 0.0,
    start_index: int = 0,
) -> None:
    """Publishes ``count`` batches (forever when count < 0) through a RankPublisher."""
    from sglang_kvpub.publish.rank_publisher import RankPublisher

    publisher = RankPublisher(config, rank, BLOCK_SIZE, channel)
    go.wait(30.0)
    index = start_index
    while count < 0 or index < start_index + count:
        publisher.publish(EventBatch(ts=time.time(), events=batch_events(rank, index)))
        index += 1
        if interval_s:
            time.sleep(interval_s)  # pacing a producer, not synchronisation
    publisher.shutdown()
    done.put((rank, publisher.stats))


def spawn_context() -> Any:
    return mp.get_context("spawn")


def run_prompt_rank(config: PluginConfig, rank: int, channel: str, token_ids: list[int], block_size: int) -> None:
    """One rank publisher process announcing ``token_ids`` as stored blocks, then heartbeats
    until killed (the fan-in sees a live rank)."""
    from sglang_kvpub.publish.rank_publisher import RankPublisher

    publisher = RankPublisher(config, rank, block_size, channel)
    blocks = len(token_ids) // block_size
    hashes = [(rank << 40) | (index + 1) for index in range(blocks)]
    publisher.publish(
        EventBatch(
            ts=time.time(),
            events=[
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=list(token_ids[: blocks * block_size]),
                    block_size=block_size,
                )
            ],
        )
    )
    while True:
        time.sleep(0.2)  # stay alive: the parent kills this process
