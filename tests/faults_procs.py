"""Process entry points for the fault and load tests (importable by multiprocessing's spawn).

* :func:`tree_events` - batch ``i`` of a rank whose cache behaves like a radix tree at
  capacity: each step prefills one 2-block request from the root; the request from
  ``WINDOW`` steps ago is evicted from HBM leaf first (every third one demoted to
  CPU_PINNED first), and demoted ones leave the host after another ``WINDOW`` steps.
  Resident sets stay prefix-closed per medium, as in SGLang's tree, and bounded.
* :func:`run_ctl_rank` - one rank publisher process that publishes ``tree_events`` for
  the index ranges the test commands, so the test knows the engine's truth exactly:
  the fold of what the rank published since it started.
* :func:`run_adapter` - the router side in its own process (a ``StreamSubscriber`` feeding a
  ``PrefixIndex``) that answers ``resident``/``health`` commands, so it can be killed -9.
* :func:`truth` - the engine's truth per (rank, medium) for published index ranges.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvpub_procs import BLOCK_SIZE, serve_commands

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, Event, EventBatch

MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
Truth = dict[tuple[int, str], set[int]]
WINDOW = 8  # requests resident in HBM per rank


def block_hash(rank: int, index: int, part: int) -> int:
    return (rank << 32) | ((index << 1 | part) + 1)


def _chain(rank: int, index: int, medium: str) -> BlockStored:
    hashes = [block_hash(rank, index, 0), block_hash(rank, index, 1)]
    tokens = [(rank * 1_000_003 + index * 2 * BLOCK_SIZE + t) % (1 << 31) for t in range(2 * BLOCK_SIZE)]
    return BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BLOCK_SIZE, medium=medium)


def tree_events(rank: int, index: int, window: int = WINDOW) -> list[Event]:
    events: list[Event] = [_chain(rank, index, MEDIUM_GPU)]
    old = index - window
    if old >= 0:
        if old % 3 == 0:
            events.append(_chain(rank, old, MEDIUM_CPU))  # write-back to host before leaving HBM
        events.append(
            BlockRemoved(block_hashes=[block_hash(rank, old, 1), block_hash(rank, old, 0)], medium=MEDIUM_GPU)
        )
    older = index - 2 * window
    if older >= 0 and older % 3 == 0:
        events.append(
            BlockRemoved(block_hashes=[block_hash(rank, older, 1), block_hash(rank, older, 0)], medium=MEDIUM_CPU)
        )
    return events


def truth(ranges: dict[int, list[tuple[int, int]]]) -> Truth:
    """Per (rank, medium) the blocks resident after applying ``batch_events`` over the ranges."""
    out: Truth = {}
    for rank, spans in ranges.items():
        residency = RankResidency()
        for start, stop in spans:
            for index in range(start, stop):
                residency.apply_all(tree_events(rank, index))
        for medium in MEDIA:
            out[(rank, medium)] = set(residency.hashes(medium))
    return out


def indexed(ranges: dict[int, list[tuple[int, int]]]) -> Truth:
    """What a router index holds after exactly these batches, applied directly (no transport).

    Equal to :func:`truth` while every chain is complete; a store whose parent block the
    index never saw is skipped (an orphan: no query can reach it), so a lost batch also
    hides the blocks chained after it.
    """
    from sglang_kvpub.core.index import PrefixIndex
    from sglang_kvpub.wire import enrich_batch

    index = PrefixIndex(BLOCK_SIZE)
    for rank, spans in ranges.items():
        for start, stop in spans:
            for i in range(start, stop):
                batch = enrich_batch(
                    EventBatch(ts=0.0, events=tree_events(rank, i)), dp_rank=rank, block_size=BLOCK_SIZE
                )
                index.apply_batch("inst", batch)
    return {(r, m): index.resident("inst", r, m) for r in ranges for m in MEDIA}


def run_ctl_rank(config: PluginConfig, rank: int, channel: str, commands: Any, answers: Any) -> None:
    """``("publish", start, stop, interval_s)`` publishes that range; ``"stats"``; ``"stop"``."""
    from sglang_kvpub.publish.rank_publisher import RankPublisher

    publisher = RankPublisher(config, rank, BLOCK_SIZE, channel)
    answers.put(("ready", rank))

    def handle(command: Any) -> None:
        if command == "stats":
            answers.put(("stats", rank, publisher.stats))
            return
        _, start, stop, interval_s = command
        for index in range(start, stop):
            publisher.publish(EventBatch(ts=time.time(), events=tree_events(rank, index)))
            if interval_s:
                time.sleep(interval_s)  # pacing a producer, not synchronisation
        answers.put(("published", rank, stop))

    try:
        serve_commands(commands, handle)
    finally:
        publisher.shutdown()


def run_adapter(endpoint: str, replay: str, ranks: int, commands: Any, answers: Any) -> None:
    """The router side alone: answers ``"resident"`` with ``(resident per (rank, medium), health)``."""
    from motor_adapter.stream import StreamOptions, StreamSubscriber
    from sglang_kvpub.core.index import PrefixIndex

    index = PrefixIndex(BLOCK_SIZE)
    options = StreamOptions(liveness_s=1.0, replay_timeout_s=0.5, backoff_max_s=0.5, poll_s=0.02)
    sub = StreamSubscriber("inst", endpoint, index, replay_endpoint=replay, options=options)
    sub.start()
    answers.put("ready")

    def handle(_command: Any) -> None:
        resident = {(r, m): index.resident("inst", r, m) for r in range(ranks) for m in MEDIA}
        answers.put((resident, dataclasses.asdict(sub.health())))

    try:
        serve_commands(commands, handle)
    finally:
        sub.stop()


# --------------------------------------------------------------------------- load


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def run_load_engine(
    config: PluginConfig, dp_size: int, rate_hz: float, duration_s: float, channel: str, answers: Any, stop: Any
) -> None:
    """One instance: the fan-in and ``dp_size`` rank publishers (threads), each rank publishing
    ``tree_events`` at ``rate_hz``; reports counts and the largest queue depths seen."""
    from sglang_kvpub.publish.fanin import FanIn
    from sglang_kvpub.publish.rank_publisher import RankPublisher

    fanin = FanIn(config, dp_size, channel_endpoint=channel)
    fanin.start()
    ranks = [RankPublisher(config, rank, BLOCK_SIZE, channel) for rank in range(dp_size)]
    answers.put("ready")
    start = time.monotonic()
    step = 1.0 / rate_hz
    index = 0
    peaks = {"rank_queue_depth": 0, "fanin_buffered": 0, "fanin_jobs": 0}
    while time.monotonic() - start < duration_s:
        for rank, publisher in enumerate(ranks):
            publisher.publish(EventBatch(ts=time.time(), events=tree_events(rank, index)))
        index += 1
        if index % 50 == 0:
            stats = fanin.stats()
            peaks["fanin_buffered"] = max(peaks["fanin_buffered"], stats["buffered"])
            peaks["fanin_jobs"] = max(peaks["fanin_jobs"], stats["jobs"])
            peaks["rank_queue_depth"] = max(peaks["rank_queue_depth"], *(p.stats["queue_depth"] for p in ranks))
        delay = start + index * step - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the producer
    for publisher in ranks:
        publisher.shutdown()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # until the fan-in saw every rank's last batch
        stats = fanin.stats()
        if all(stats["ranks"].get(r, {}).get("last_rank_seq", -1) >= p.stats["rank_seq"] for r, p in enumerate(ranks)):
            break
        time.sleep(0.05)
    rank_stats = [p.stats for p in ranks]
    answers.put({"batches_per_rank": index, "ranks": rank_stats, "fanin": fanin.stats(), "peaks": peaks})
    stop.wait(120.0)  # keep serving (heartbeats, snapshots) until the test is done
    fanin.stop()


def run_load_adapter(
    streams: list[tuple[str, str, str]], dp_size: int, query_threads: int, commands: Any, answers: Any
) -> None:
    """The router side under load: a KvAffinity on every stream, ``query_threads`` threads querying
    prefixes the engines hold, RSS sampled every 0.25 s; ``"report"`` answers everything."""
    import threading

    from motor_adapter.affinity import KvAffinity
    from motor_adapter.scoring import KvAffinityConfig

    affinity = KvAffinity(KvAffinityConfig(block_size=BLOCK_SIZE))
    for instance, endpoint, replay in streams:
        affinity.add_instance(instance, endpoint, replay)
    stop = threading.Event()
    samples: list[tuple[float, int]] = []
    counts = {"queries": 0, "hits": 0, "max_pending": 0}
    started = time.monotonic()

    def query() -> None:
        i = 0
        while not stop.is_set():
            rank = i % dp_size
            applied = affinity.health()[streams[i % len(streams)][0]][0].batches
            index = max(0, applied // dp_size - 3)  # a request that rank still holds in HBM
            found = affinity.query(_chain(rank, index, MEDIUM_GPU).token_ids)
            counts["queries"] += 1
            counts["hits"] += any(h.npu_blocks for per in found.values() for h in per.values())
            i += 1
            time.sleep(0.001)  # a query stream, not a busy loop

    def sample() -> None:
        while not stop.wait(0.25):
            samples.append((time.monotonic() - started, rss_bytes()))
            for entry in affinity._instances.values():
                for sub in entry.subscribers:
                    counts["max_pending"] = max(counts["max_pending"], len(getattr(sub, "_pending", ())))

    threads = [threading.Thread(target=query, daemon=True) for _ in range(query_threads)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for thread in threads:
        thread.start()
    answers.put("ready")
    try:
        while True:
            command = commands.get()
            if command == "stop":
                break
            health = {k: [dataclasses.asdict(h) for h in v] for k, v in affinity.health().items()}
            resident = {
                (inst, r, m): affinity.index.resident(inst, r, m)
                for inst, _, _ in streams
                for r in range(dp_size)
                for m in MEDIA
            }
            answers.put({"samples": list(samples), "counts": dict(counts), "health": health, "resident": resident})
    finally:
        stop.set()
        affinity.close()
