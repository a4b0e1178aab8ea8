"""Prefix index speed and size: ``sglang_kvpub.core.index`` against Dynamo's ``RadixTree``.

Workload (default): 32 instances x 16 ranks, stores until 1M (worker, block) entries are
indexed, block size 128.  Prompts are a popular system prompt (64 of them, 4-16 blocks,
skewed popularity, shared by many ranks) followed by a private user part (4-30 blocks).
Each prompt is stored by one random rank as ONE merged ``BlockStored`` (the whole prompt
from the root when the rank lacks the system prompt, else the user part under it), with
content-derived engine ids like SGLang's.  Queries are 6,000-token prompts (46 blocks):
80% start with a stored prompt, 20% are cold.

Timed: ours = ``apply_batch`` (local hashing and chaining included); query = token ids ->
``query`` (hashing included; tokenization excluded).  Baseline in the same run: Dynamo
``RadixTree`` (ai-dynamo-runtime 1.6.1), ingest = ``compute_block_hash_for_seq`` + JSON
event + ``apply_event``, query = ``compute_block_hash_for_seq`` + ``find_matches``.
``bytes_per_entry`` is measured with tracemalloc on a second, identical build.

    python bench/index.py [--blocks 1000000] [--queries 1000] [--no-baseline]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, percentile, with_targets  # noqa: E402
from sglang_kvpub.core.index import PrefixIndex  # noqa: E402
from sglang_kvpub.wire import BlockStored, EventBatch  # noqa: E402

BLOCK = 128
QUERY_TOKENS = 6000
CHUNK = 1000  # events generated (untimed) then applied (timed) at a time


@dataclass
class Store:
    instance: int
    rank: int
    event: BlockStored


class Workload:
    """Deterministic prompt stream; tokens come from a pool of random blocks."""

    def __init__(self, instances: int, ranks: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.instances = instances
        self.ranks = ranks
        self.pool = [[rng.randrange(150_000) for _ in range(BLOCK)] for _ in range(2048)]
        self.systems = [[rng.randrange(len(self.pool)) for _ in range(rng.randint(4, 16))] for _ in range(64)]
        # content-derived engine ids for system blocks: equal on every rank, as SGLang's are
        self.system_ids = [[rng.getrandbits(64) for _ in blocks] for blocks in self.systems]
        self.held: set[tuple[int, int, int]] = set()  # (instance, rank, system)
        self.prompts: list[tuple[int, list[int]]] = []  # (system, user pool indices)

    def tokens(self, blocks: list[int]) -> list[int]:
        out: list[int] = []
        for b in blocks:
            out.extend(self.pool[b])
        return out

    def stores(self, entries: int) -> Iterator[Store]:
        rng = self.rng
        indexed = 0
        while indexed < entries:
            system = min(int(len(self.systems) * rng.random() ** 2), len(self.systems) - 1)
            user = [rng.randrange(len(self.pool)) for _ in range(rng.randint(4, 30))]
            inst, rank = rng.randrange(self.instances), rng.randrange(self.ranks)
            self.prompts.append((system, user))
            user_ids = [rng.getrandbits(64) for _ in user]
            if (inst, rank, system) in self.held:
                event = BlockStored(
                    block_hashes=user_ids,
                    parent_block_hash=self.system_ids[system][-1],
                    token_ids=self.tokens(user),
                    block_size=BLOCK,
                    medium="GPU",
                )
            else:
                self.held.add((inst, rank, system))
                event = BlockStored(
                    block_hashes=self.system_ids[system] + user_ids,
                    parent_block_hash=None,
                    token_ids=self.tokens(self.systems[system] + user),
                    block_size=BLOCK,
                    medium="GPU",
                )
            indexed += len(event.block_hashes)
            yield Store(inst, rank, event)

    def queries(self, count: int) -> list[list[int]]:
        rng = random.Random(1)
        out = []
        for _ in range(count):
            if rng.random() < 0.8 and self.prompts:
                system, user = rng.choice(self.prompts)
                toks = self.tokens(self.systems[system] + user)
            else:
                toks = []
            toks += [rng.randrange(150_000) for _ in range(QUERY_TOKENS - len(toks))]
            out.append(toks[:QUERY_TOKENS])
        return out


def chunks(it: Iterator[Store]) -> Iterator[list[Store]]:
    chunk: list[Store] = []
    for item in it:
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ours_batches(chunk: list[Store]) -> list[tuple[str, EventBatch]]:
    return [(f"inst-{s.instance}", EventBatch(ts=0.0, events=[s.event], dp_rank=s.rank)) for s in chunk]


def _apply_ours(index: PrefixIndex, batches: list[tuple[str, EventBatch]]) -> None:
    for name, batch in batches:
        index.apply_batch(name, batch)


def _apply_dynamo(tree: Any, hasher: Any, chunk: list[Store], first_id: int) -> None:
    """Dynamo's ingest of the same stores: its block hashing, its JSON event, apply_event."""
    for event_id, s in enumerate(chunk, first_id):
        ev = s.event
        pairs = zip(ev.block_hashes, hasher(ev.token_ids, BLOCK), strict=True)
        payload = {
            "event_id": event_id,
            "data": {
                "stored": {
                    "parent_hash": ev.parent_block_hash,
                    "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in pairs],
                }
            },
            "dp_rank": s.rank,
        }
        tree.apply_event(s.instance, json.dumps(payload).encode())


def _timed(fn: Any) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - start_cpu


def ingest_ours(index: PrefixIndex, work: Workload, entries: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, blocks) spent in ``apply_batch``."""
    seconds = cpu = 0.0
    blocks = 0
    for chunk in chunks(work.stores(entries)):
        batches = _ours_batches(chunk)
        wall, used = _timed(lambda: _apply_ours(index, batches))  # noqa: B023 (called at once)
        seconds += wall
        cpu += used
        blocks += sum(len(s.event.block_hashes) for s in chunk)
    return seconds, cpu, blocks


def ingest_both(
    index: PrefixIndex, tree: Any, hasher: Any, args: argparse.Namespace
) -> tuple[Workload, dict[str, float], int]:
    """Both indexes fed the same stores, a chunk at a time, alternating which goes first, so
    other load on the machine hits both alike.  Returns the workload, wall/CPU seconds per
    side, and the blocks each ingested."""
    ours_work, their_work = Workload(args.instances, args.ranks), Workload(args.instances, args.ranks)
    spent = {"ours_s": 0.0, "ours_cpu_s": 0.0, "dynamo_s": 0.0, "dynamo_cpu_s": 0.0}
    blocks = event_id = 0
    pairs = zip(chunks(ours_work.stores(args.blocks)), chunks(their_work.stores(args.blocks)), strict=True)
    for n, (mine, theirs) in enumerate(pairs):
        batches = _ours_batches(mine)
        sides: list[tuple[str, Any]] = [
            ("ours", lambda: _apply_ours(index, batches)),  # noqa: B023 (called at once)
            ("dynamo", lambda: _apply_dynamo(tree, hasher, theirs, event_id + 1)),  # noqa: B023
        ]
        for name, fn in sides if n % 2 else reversed(sides):
            wall, used = _timed(fn)
            spent[f"{name}_s"] += wall
            spent[f"{name}_cpu_s"] += used
        event_id += len(theirs)
        blocks += sum(len(s.event.block_hashes) for s in mine)
    return ours_work, spent, blocks


def time_queries_paired(fns: list[Any], queries: list[list[int]]) -> list[tuple[list[float], list[float]]]:
    """Per function, per query: wall and this thread's CPU time in microseconds.  The
    functions take turns on every query (order alternating), so load from other processes
    lands on all of them alike; CPU time is immune to preemption."""
    for toks in queries[:20]:  # warm-up
        for fn in fns:
            fn(toks)
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in fns]
    for n, toks in enumerate(queries):
        order = range(len(fns)) if n % 2 else reversed(range(len(fns)))
        for i in order:
            start, start_cpu = time.perf_counter(), time.thread_time()
            fns[i](toks)
            out[i][1].append((time.thread_time() - start_cpu) * 1e6)
            out[i][0].append((time.perf_counter() - start) * 1e6)
    return out


def measure_bytes(args: argparse.Namespace) -> dict[str, float]:
    """Index bytes per entry, traced on a fresh identical build (events freed as it goes).

    tracemalloc counts requested bytes; pymalloc rounds each small object up to 16 bytes
    (a 64-bit int: 36 -> 48), which ``bytes_per_entry_estimate`` (``stats()``) includes.
    RSS is not used: the freed token lists of the generated events stay in it."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(BLOCK)
    ingest_ours(index, Workload(args.instances, args.ranks), args.blocks)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    entries = index.stats().blocks
    return {"bytes_per_entry": round(used / entries, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="indexed (worker, block) entries")
    parser.add_argument("--instances", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--no-baseline", action="store_true", help="skip Dynamo's RadixTree")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc build")
    args = parser.parse_args()

    index = PrefixIndex(BLOCK)
    dynamo = None if args.no_baseline else _dynamo()
    record: dict[str, Any] = {"bench": "index"}
    if isinstance(dynamo, str):
        record["baseline_error"] = dynamo
        dynamo = None
    if dynamo is None:
        work = Workload(args.instances, args.ranks)
        ingest_s, ingest_cpu, blocks = ingest_ours(index, work, args.blocks)
        spent = {"ours_s": ingest_s, "ours_cpu_s": ingest_cpu}
    else:
        tree, hasher = dynamo
        work, spent, blocks = ingest_both(index, tree, hasher, args)
    queries = work.queries(args.queries)
    fns: list[Any] = [index.query]
    if dynamo is not None:
        fns.append(lambda toks: tree.find_matches(hasher(toks, BLOCK)).scores)
    timings = time_queries_paired(fns, queries)
    lat, lat_cpu = timings[0]
    hits = [index.query(q) for q in queries[:200]]
    stats = index.stats()
    record.update(
        {
            "instances": args.instances,
            "ranks": args.ranks,
            "block_size": BLOCK,
            "indexed_blocks": stats.blocks,
            "distinct_keys": stats.keys,
            "query_blocks": QUERY_TOKENS // BLOCK,
            "ingest_blocks_per_s": round(blocks / spent["ours_s"]),
            "ingest_blocks_per_cpu_s": round(blocks / spent["ours_cpu_s"]),
            "query_p50_us": round(percentile(lat, 50), 1),
            "query_p99_us": round(percentile(lat, 99), 1),
            "query_max_us": round(max(lat), 1),
            "query_cpu_p50_us": round(percentile(lat_cpu, 50), 1),
            "query_cpu_p99_us": round(percentile(lat_cpu, 99), 1),
            "query_mean_ranks_hit": round(sum(sum(len(r) for r in h.values()) for h in hits) / len(hits), 1),
            "bytes_per_entry_estimate": round(stats.bytes_per_entry, 1),
        }
    )
    del hits
    if dynamo is not None:
        their_lat, their_cpu = timings[1]
        record.update(
            {
                "baseline": "dynamo RadixTree 1.6.1",
                "baseline_ingest_blocks_per_s": round(blocks / spent["dynamo_s"]),
                "baseline_ingest_blocks_per_cpu_s": round(blocks / spent["dynamo_cpu_s"]),
                "baseline_query_p50_us": round(percentile(their_lat, 50), 1),
                "baseline_query_p99_us": round(percentile(their_lat, 99), 1),
                "baseline_query_cpu_p50_us": round(percentile(their_cpu, 50), 1),
                "baseline_query_cpu_p99_us": round(percentile(their_cpu, 99), 1),
                "method": "same stores and queries; ingest chunks and queries alternate between the two, order "
                "alternating; CPU = process time (ingest) / thread time (query)",
            }
        )
        record["ingest_cpu_ratio_vs_baseline"] = round(
            record["ingest_blocks_per_cpu_s"] / record["baseline_ingest_blocks_per_cpu_s"], 3
        )
        del tree
    del index
    gc.collect()
    if not args.no_memory:
        record.update(measure_bytes(args))
    record["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other processes on this machine skew wall-clock figures
    emit(with_targets(record))
    return 0


def _dynamo() -> tuple[Any, Any] | str | None:
    """Dynamo's RadixTree and its block hasher, or why they are unavailable."""
    try:
        from dynamo._core import RadixTree, compute_block_hash_for_seq
    except ImportError as exc:
        return f"dynamo._core unavailable: {exc}"
    return RadixTree(), compute_block_hash_for_seq


if __name__ == "__main__":
    sys.exit(main())
