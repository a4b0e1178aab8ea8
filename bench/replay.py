"""The prefix index on a Mooncake trace replay, beside Dynamo's ``RadixTree`` in the same run.

The method of Dynamo's indexer benchmark (its ``mooncake_bench``), rebuilt here:

- the trace's requests are dealt at random (seeded) to ``--workers`` unique workers, and the
  whole set is replayed ``--duplicate`` times under other worker ids (Dynamo's ``-d``: 1,000
  workers x 7 = 7,000, the configuration of its published figures);
- each worker runs a model of an engine's prefix cache (``--gpu-blocks`` blocks, LRU,
  deepest blocks of a chain first), fed its requests in trace order: a request's first
  blocks that the worker holds are hits; its other blocks are stored as ONE
  ``BlockStored`` (parent = the last hit block), after a ``BlockRemoved`` of what the store
  evicts.  One block per trace ``hash_id``: ``--block-size`` tokens, each the ``hash_id``
  (Dynamo's mapping);
- the replay, in trace order: for each request and each copy of its worker, a
  find-matches of the request's blocks, then that worker's events.  Ops = find-matches +
  events (Dynamo's count); p99 = the find-matches latency.

Workers are dp ranks of dp-16 instances: worker ``w`` is rank ``w % 16`` of instance
``w // 16`` on both sides (Dynamo: ``worker_id``/``dp_rank``).

Per op, each side gets its input as its API takes it, prepared outside the timing (as
Dynamo's bench prepares the request hashes): Dynamo ``find_matches`` of the blocks' local
hashes and ``apply_event`` of its JSON event (with ``tokens_hash``); ours ``query_keys`` of
the chained keys and ``apply_batch`` of a wire ``BlockStored`` carrying the token ids, so
OUR ingest timing includes hashing every stored token (Dynamo's gets its hashes given).
The replay runs as fast as each side goes (Dynamo's throughput sweep at saturation), a
chunk of ``--chunk`` trace requests at a time, the two sides alternating which goes first,
so other load on the machine hits both alike.

    python bench/replay.py [--trace FILE] [--workers 1000] [--duplicate 7] [--limit N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import emit, percentile, with_targets  # noqa: E402
from bench.routing import DEFAULT_TRACE, load_trace  # noqa: E402 (the traces' one path helper)
from sglang_kvpub.core.hashing import BASE_SEED, chain_hashes, local_block_hash  # noqa: E402
from sglang_kvpub.core.index import PrefixIndex  # noqa: E402
from sglang_kvpub.wire import BlockRemoved, BlockStored, EventBatch  # noqa: E402

RANKS = 16  # workers are ranks of dp-16 instances
# Dynamo's published figures for this trace (its INDEXER_BENCH.md, its machine, -d 7): context only.
DYNAMO_PUBLISHED = "CRTC 8 threads: 18,046 ops/s p99 13.4 ms; branch-sharded 2x4: 30,411 ops/s p99 3.2 ms"


@dataclass
class WorkerCache:
    """One worker's prefix cache: block ids in LRU order (oldest first)."""

    capacity: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def serve(self, hash_ids: list[int]) -> tuple[int, list[int]]:
        """(hit blocks, evicted block ids) for one request; its blocks become the newest,
        deepest first, so a chain's tail is evicted before its head."""
        hit = 0
        for block in hash_ids:
            if block not in self.blocks:
                break
            hit += 1
        evicted: list[int] = []
        needed = len(self.blocks) + len(hash_ids) - hit - self.capacity
        if needed > 0:
            mine = set(hash_ids)
            for block in self.blocks:
                if block not in mine:
                    evicted.append(block)
                    if len(evicted) == needed:
                        break
            for block in evicted:
                del self.blocks[block]
        for block in reversed(hash_ids[: self.capacity]):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        return hit, evicted


@dataclass
class Op:
    """One replay op for both sides: a find-matches (``event is None``) or one event."""

    worker: int
    ours: Any  # chained keys, or (instance, EventBatch)
    theirs: Any  # local hashes, or JSON bytes


class Trace:
    """The trace dealt to workers, each worker's cache model, and the per-block hashes."""

    def __init__(self, records: list[dict[str, Any]], args: argparse.Namespace) -> None:
        from dynamo._core import compute_block_hash_for_seq

        self.records = records
        self.block_size = args.block_size
        self.duplicate = args.duplicate
        rng = random.Random(args.seed)
        self.owner = [rng.randrange(args.workers) for _ in records]
        self.caches = [WorkerCache(args.gpu_blocks) for _ in range(args.workers * args.duplicate)]
        self.workers = args.workers
        self._dynamo_hash = compute_block_hash_for_seq
        self._local: dict[int, int] = {}
        self.events = {"stored": 0, "removed": 0, "stored_blocks": 0, "removed_blocks": 0}
        self.event_id = 0

    def local(self, block: int) -> int:
        value = self._local.get(block)
        if value is None:
            value = self._local[block] = local_block_hash(self.tokens(block))
        return value

    def tokens(self, block: int) -> list[int]:
        return [block & 0xFFFFFFFF] * self.block_size

    def ops(self, start: int, end: int) -> Iterator[Op]:
        """The replay's ops for trace requests ``start..end-1``, in trace order."""
        for n in range(start, end):
            hash_ids = list(self.records[n]["hash_ids"])
            if not hash_ids:
                continue
            local = [self.local(b) for b in hash_ids]
            keys = chain_hashes(local, BASE_SEED)
            for copy in range(self.duplicate):
                worker = self.owner[n] + copy * self.workers
                yield Op(worker, keys, local)
                hit, evicted = self.caches[worker].serve(hash_ids)
                if evicted:
                    yield self._removed(worker, evicted)
                if hit < len(hash_ids):
                    yield self._stored(worker, hash_ids, hit, local)

    def _instance(self, worker: int) -> str:
        return f"inst-{worker // RANKS}"

    def _event(self, worker: int, data: dict[str, Any]) -> bytes:
        self.event_id += 1
        return json.dumps({"event_id": self.event_id, "data": data, "dp_rank": worker % RANKS}).encode()

    def _removed(self, worker: int, blocks: list[int]) -> Op:
        self.events["removed"] += 1
        self.events["removed_blocks"] += len(blocks)
        batch = EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=blocks, medium="GPU")], dp_rank=worker % RANKS)
        return Op(worker, (self._instance(worker), batch), self._event(worker, {"removed": {"block_hashes": blocks}}))

    def _stored(self, worker: int, hash_ids: list[int], hit: int, local: list[int]) -> Op:
        new = hash_ids[hit:]
        self.events["stored"] += 1
        self.events["stored_blocks"] += len(new)
        parent = hash_ids[hit - 1] if hit else None
        tokens: list[int] = []
        for block in new:
            tokens += self.tokens(block)
        stored = BlockStored(
            block_hashes=new, parent_block_hash=parent, token_ids=tokens, block_size=self.block_size, medium="GPU"
        )
        batch = EventBatch(ts=0.0, events=[stored], dp_rank=worker % RANKS)
        blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(new, local[hit:], strict=True)]
        data = {"stored": {"parent_hash": parent, "blocks": blocks}}
        return Op(worker, (self._instance(worker), batch), self._event(worker, data))


def replay_ours(index: PrefixIndex, ops: list[Op], latencies: list[float], cpu: list[float]) -> float:
    """Seconds to replay ``ops``; each find-matches latency and thread CPU time (us) appended."""
    clock, thread = time.perf_counter, time.thread_time
    query = index.query_keys
    apply = index.apply_batch
    started = clock()
    for op in ops:
        if isinstance(op.ours, list):
            t0, c0 = clock(), thread()
            query(op.ours)
            latencies.append((clock() - t0) * 1e6)
            cpu.append((thread() - c0) * 1e6)
        else:
            apply(*op.ours)
    return clock() - started


def replay_dynamo(tree: Any, ops: list[Op], latencies: list[float], cpu: list[float]) -> float:
    clock, thread = time.perf_counter, time.thread_time
    find = tree.find_matches
    apply = tree.apply_event
    started = clock()
    for op in ops:
        if isinstance(op.theirs, list):
            t0, c0 = clock(), thread()
            find(op.theirs).scores  # noqa: B018 (the scores are the answer: read them as a router does)
            latencies.append((clock() - t0) * 1e6)
            cpu.append((thread() - c0) * 1e6)
        else:
            apply(op.worker // RANKS, op.theirs)
    return clock() - started


def check_agreement(index: PrefixIndex, tree: Any, ops: list[Op]) -> int:
    """Queries of ``ops`` whose deepest hit differs between the two indexes (both must see the
    same cache state: 0 expected)."""
    differ = 0
    for op in ops:
        if not isinstance(op.ours, list):
            continue
        ours = max(
            (hit.npu_blocks for ranks in index.query_keys(op.ours).values() for hit in ranks.values()), default=0
        )
        theirs = max(tree.find_matches(op.theirs).scores.values(), default=0)
        differ += ours != theirs
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--workers", type=int, default=1000, help="unique workers the requests are dealt to")
    parser.add_argument("--duplicate", type=int, default=7, help="copies of every worker (Dynamo's -d)")
    parser.add_argument("--gpu-blocks", type=int, default=16384, help="blocks per worker's cache")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=200, help="trace requests per alternation")
    parser.add_argument("--limit", type=int, default=None, help="first N trace requests only")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    try:
        from dynamo._core import RadixTree
    except ImportError as exc:
        emit({"bench": "replay", "error": f"dynamo._core unavailable: {exc}"})
        return 1
    records = load_trace(args.trace, args.limit)
    trace = Trace(records, args)
    index = PrefixIndex(args.block_size)
    tree = RadixTree()
    ours_lat: list[float] = []
    theirs_lat: list[float] = []
    ours_cpu: list[float] = []
    theirs_cpu: list[float] = []
    ours_s = theirs_s = 0.0
    total_ops = queries = differ = 0
    gc.collect()
    gc.freeze()  # the prepared ops are garbage-free: keep the collector out of both sides' timings
    for n, start in enumerate(range(0, len(records), args.chunk)):
        ops = list(trace.ops(start, min(start + args.chunk, len(records))))
        total_ops += len(ops)
        queries += sum(isinstance(op.ours, list) for op in ops)
        if n % 2:
            ours_s += replay_ours(index, ops, ours_lat, ours_cpu)
            theirs_s += replay_dynamo(tree, ops, theirs_lat, theirs_cpu)
        else:
            theirs_s += replay_dynamo(tree, ops, theirs_lat, theirs_cpu)
            ours_s += replay_ours(index, ops, ours_lat, ours_cpu)
        if n % 10 == 0:
            differ += check_agreement(index, tree, ops[-50:])
    gc.unfreeze()
    stats = index.stats()
    record: dict[str, Any] = {
        "bench": "replay",
        "trace": args.trace.name,
        "requests": len(records),
        "workers": args.workers * args.duplicate,
        "duplicate": args.duplicate,
        "gpu_blocks": args.gpu_blocks,
        "block_size": args.block_size,
        "ops": total_ops,
        "find_matches": queries,
        "stored_events": trace.events["stored"],
        "removed_events": trace.events["removed"],
        "stored_blocks": trace.events["stored_blocks"],
        "removed_blocks": trace.events["removed_blocks"],
        "indexed_blocks": stats.blocks,
        "ops_per_s": round(total_ops / ours_s),
        "find_matches_p50_us": round(percentile(ours_lat, 50), 1),
        "find_matches_p99_us": round(percentile(ours_lat, 99), 1),
        "find_matches_cpu_p99_us": round(percentile(ours_cpu, 99), 1),
        "baseline": "dynamo RadixTree 1.6.1",
        "baseline_ops_per_s": round(total_ops / theirs_s),
        "baseline_find_matches_p50_us": round(percentile(theirs_lat, 50), 1),
        "baseline_find_matches_p99_us": round(percentile(theirs_lat, 99), 1),
        "baseline_find_matches_cpu_p99_us": round(percentile(theirs_cpu, 99), 1),
        "ops_ratio_vs_baseline": round(theirs_s / ours_s, 2),
        "deepest_hit_disagreements": differ,
        "dynamo_published": DYNAMO_PUBLISHED,
        "method": "same ops in trace order, chunks alternating which side goes first; ops/s = ops / time in "
        "the replay loop; p99 over every find-matches (wall; cpu = this thread's CPU time, immune to other processes)",
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    emit(with_targets(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
