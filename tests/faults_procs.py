"""Process entry points for the fault and load tests (importable by multiprocessing's spawn).

* :func:`run_ctl_rank` - one rank publisher process that publishes ``batch_events(rank, i)``
  (tests/kvpub_procs.py) for the index ranges the test commands, so the test knows the
  engine's truth exactly: the fold of what the rank published since it started.
* :func:`run_adapter` - the router side in its own process (a ``StreamSubscriber`` feeding a
  ``PrefixIndex``) that answers ``resident``/``health`` commands, so it can be killed -9.
* :func:`truth` - the engine's truth per (rank, medium) for published index ranges.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any

from kvpub_procs import BLOCK_SIZE, batch_events

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.residency import RankResidency
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU, BlockStored, EventBatch

MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
Truth = dict[tuple[int, str], set[int]]


def truth(ranges: dict[int, list[tuple[int, int]]]) -> Truth:
    """Per (rank, medium) the blocks resident after applying ``batch_events`` over the ranges."""
    out: Truth = {}
    for rank, spans in ranges.items():
        residency = RankResidency()
        for start, stop in spans:
            for index in range(start, stop):
                residency.apply_all(batch_events(rank, index))
        for medium in MEDIA:
            out[(rank, medium)] = set(residency.hashes(medium))
    return out


def indexed(ranges: dict[int, list[tuple[int, int]]]) -> Truth:
    """What a router index holds after exactly these batches, applied directly (no transport).

    Equal to :func:`truth` while every chain is complete; a store whose parent block the
    index never saw is skipped (an orphan: no query can reach it), so a lost batch also
    hides the blocks chained after it.
    """
    from sglang_kvpub.index import PrefixIndex
    from sglang_kvpub.wire import enrich_batch

    index = PrefixIndex(BLOCK_SIZE)
    for rank, spans in ranges.items():
        for start, stop in spans:
            for i in range(start, stop):
                batch = enrich_batch(
                    EventBatch(ts=0.0, events=batch_events(rank, i)), dp_rank=rank, block_size=BLOCK_SIZE
                )
                index.apply_batch("inst", batch)
    return {(r, m): index.resident("inst", r, m) for r in ranges for m in MEDIA}


def run_ctl_rank(config: PluginConfig, rank: int, channel: str, commands: Any, answers: Any) -> None:
    """``("publish", start, stop, interval_s)`` publishes that range; ``"stats"``; ``"stop"``."""
    from sglang_kvpub.rank_publisher import RankPublisher

    publisher = RankPublisher(config, rank, BLOCK_SIZE, channel)
    answers.put(("ready", rank))
    try:
        while True:
            try:
                command = commands.get(timeout=10.0)
            except queue.Empty:
                continue
            if command == "stop":
                break
            if command == "stats":
                answers.put(("stats", rank, publisher.stats))
                continue
            if command[0] == "root":  # a new prefix from the tree root: stored with no parent
                _, first, blocks = command
                hashes = [(rank << 32) | (first + k) for k in range(blocks)]
                tokens = [7_000_000 + h % 1_000_000 + j for h in hashes for j in range(BLOCK_SIZE)]
                stored = BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BLOCK_SIZE)
                publisher.publish(EventBatch(ts=time.time(), events=[stored]))
                answers.put(("published", rank, first))
                continue
            _, start, stop, interval_s = command
            for index in range(start, stop):
                publisher.publish(EventBatch(ts=time.time(), events=batch_events(rank, index)))
                if interval_s:
                    time.sleep(interval_s)  # pacing a producer, not synchronisation
            answers.put(("published", rank, stop))
    finally:
        publisher.shutdown()


def run_adapter(endpoint: str, replay: str, ranks: int, commands: Any, answers: Any) -> None:
    """The router side alone: answers ``"resident"`` with ``(resident per (rank, medium), health)``."""
    from motor_adapter.stream import StreamOptions, StreamSubscriber
    from sglang_kvpub.index import PrefixIndex

    index = PrefixIndex(BLOCK_SIZE)
    options = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, backoff_max_s=0.5, poll_s=0.02)
    sub = StreamSubscriber("inst", endpoint, index, replay_endpoint=replay, options=options)
    sub.start()
    answers.put("ready")
    try:
        while True:
            try:
                command = commands.get(timeout=10.0)
            except queue.Empty:
                continue
            if command == "stop":
                break
            resident = {(r, m): index.resident("inst", r, m) for r in range(ranks) for m in MEDIA}
            answers.put((resident, dataclasses.asdict(sub.health())))
    finally:
        sub.stop()
