"""Decision cost of the cache-aware DP dispatcher (``sglang_kvpub.core.dispatch``).

Workload (default): 16 ranks, block size 128; every rank holds ``--prompts`` 6,144-token
prompts (48 blocks, stored as merged ``BlockStored`` events through ``observe``, the
fan-in's path) under one of 8 shared system prompts.  Queries are 6,144-token prompts
as SGLang's ``array("q")``: 80% start with a stored prompt (full or partial hit), 20%
are cold.  Loads are random token counts per decision.

Timed per decision: ``choose`` (hashing + index walk + cost over 16 ranks + guard), by
decision class - ``cold`` (no rank holds block 0), ``partial`` (a stored prompt cut short,
then new tokens), ``full_hit`` (a whole stored prompt: every block held, the most hashing a
decision does; 1,000 more of them after the mixed run) - as wall time (``decision_us_*``)
and this thread's CPU time (``decision_cpu_us_*``: what other processes on a busy machine
cannot inflate).  Target: p99 <= 50 us for every class, ``targets`` in the line.
The stored prompts are kept as arrays and the workload's garbage is collected before timing,
so a collection pause of the harness's own objects is not charged to a decision.  Each
query's array is copied just before its decision (untimed): SGLang's controller decides on
a request it has just unpickled, whose ids are still in the CPU cache; the index is as cold
as 153k keys make it.
``timer_stalls_*``: the floor of this machine, measured in the same run (``_timer_stalls``).
``hashing``: whether the C helpers ran (docs/native.md); ``KVPUB_NATIVE=0`` runs the Python
path for a side-by-side figure; ``npu_walk_table``: whether the index walked its flat C table.
Also: hashing alone (``hashing.sequence_keys`` on the array), the same on a list (the router's
path), and the round-robin baseline: SGLang 0.5.23's own selection cost, i.e. a counter
modulo the active ranks.  The routing-quality side is bench/routing.py
(``fold_pinned_dispatch``).

    python bench/dispatch.py [--ranks 16] [--block-size 128] [--tokens 6144] [--decisions 5000]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, percentile, with_targets  # noqa: E402
from sglang_kvpub.core import hashing  # noqa: E402
from sglang_kvpub.core.dispatch import CacheAwareDispatcher  # noqa: E402
from sglang_kvpub.core.hashing import sequence_keys  # noqa: E402
from sglang_kvpub.wire import BlockStored, EventBatch  # noqa: E402


def _populate(dispatcher: CacheAwareDispatcher, rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    block = args.block_size
    systems = [[rng.randrange(150_000) for _ in range(block * 8)] for _ in range(8)]
    stored: list[list[int]] = []
    engine_id = 1
    for rank in range(args.ranks):
        for _ in range(args.prompts):
            system = systems[rng.randrange(len(systems))]
            prompt = system + [rng.randrange(150_000) for _ in range(args.tokens - len(system))]
            blocks = len(prompt) // block
            hashes = list(range(engine_id, engine_id + blocks))
            engine_id += blocks
            event = BlockStored(hashes, None, prompt[: blocks * block], block, medium="GPU")
            dispatcher.observe(EventBatch(time.time(), [event], rank), rank)
            stored.append(prompt)
    return stored


def _queries(rng: random.Random, stored: list[array[int]], args: argparse.Namespace) -> list[tuple[array[int], str]]:
    """80% start with a stored prompt (partial: a random cut, full_hit when the cut is the
    whole prompt), 20% cold."""
    out: list[tuple[array[int], str]] = []
    for _ in range(args.decisions):
        if rng.random() < 0.8:
            base = stored[rng.randrange(len(stored))]
            keep = rng.randrange(args.block_size, len(base) + 1)
            tokens = base[:keep] + array("q", [rng.randrange(150_000) for _ in range(args.tokens - keep)])
            kind = "full_hit" if keep // args.block_size == len(base) // args.block_size else "partial"
            out.append((tokens, kind))
        else:
            out.append((array("q", [rng.randrange(150_000) for _ in range(args.tokens)]), "cold"))
    return out


def _round_robin_us(ranks: int, count: int) -> list[float]:
    # SGLang's round robin: next active slot by a counter (its socket send excluded, as ours).
    active = list(range(ranks))
    status = [True] * ranks
    counter = 0
    samples = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        slot = active[counter % len(active)]
        counter = (counter + 1) % len(active)
        ok = status[slot]
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
        assert ok
    return samples


def _timed(dispatcher: CacheAwareDispatcher, stored: array[int], load: list[float]) -> tuple[float, float]:
    """One decision on a just-received copy of ``stored``: (wall us, this thread's CPU us)."""
    tokens = array("q", stored)
    c, t = time.thread_time_ns(), time.perf_counter_ns()
    dispatcher.choose(tokens, load)
    t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
    return (t2 - t) / 1000.0, (c2 - c) / 1000.0


def _timer_stalls(seconds: float = 1.0, gap_us: float = 5.0) -> dict[str, float]:
    """The machine's own floor: a loop that only reads the clock, and the gaps over ``gap_us``
    it sees (timer interrupts, the hypervisor).  A decision of D us meets one with
    probability ~ D x stalls per second; once that passes 1 %, its p99 is a stalled one."""
    gaps: list[float] = []
    now = last = time.perf_counter_ns()
    end = now + int(seconds * 1e9)
    limit = int(gap_us * 1000)
    while now < end:
        now = time.perf_counter_ns()
        if now - last > limit:
            gaps.append((now - last) / 1000.0)
        last = now
    return {
        "timer_stalls_per_s": round(len(gaps) / seconds, 1),
        "timer_stall_us_p50": round(percentile(gaps, 50), 2),
        "timer_stall_us_p90": round(percentile(gaps, 90), 2),
    }


def _figures(name: str, samples: list[tuple[float, float]]) -> dict[str, float]:
    wall = [w for w, _ in samples]
    cpu = [c for _, c in samples]
    suffix = f"_{name}" if name else ""
    return {
        f"decision_us_p50{suffix}": round(percentile(wall, 50), 2),
        f"decision_us_p99{suffix}": round(percentile(wall, 99), 2),
        f"decision_cpu_us_p50{suffix}": round(percentile(cpu, 50), 2),
        f"decision_cpu_us_p99{suffix}": round(percentile(cpu, 99), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--prompts", type=int, default=200, help="stored prompts per rank")
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    dispatcher = CacheAwareDispatcher(args.ranks, args.block_size)
    t0 = time.perf_counter()
    stored = [array("q", prompt) for prompt in _populate(dispatcher, rng, args)]  # arrays: no GC traversal
    populate_s = time.perf_counter() - t0
    queries = _queries(rng, stored, args)
    loads = [[rng.uniform(0, 20_000) for _ in range(args.ranks)] for _ in range(64)]
    gc.collect()  # the workload's garbage, not the dispatcher's

    for tokens, _ in queries[:200]:  # warm-up
        dispatcher.choose(tokens, loads[0])
    mixed: list[tuple[float, float]] = []
    by_class: dict[str, list[tuple[float, float]]] = {"cold": [], "partial": [], "full_hit": []}
    for i, (tokens, kind) in enumerate(queries):
        sample = _timed(dispatcher, tokens, loads[i % len(loads)])
        mixed.append(sample)
        by_class[kind].append(sample)
    stats = dispatcher.stats()  # reasons of the mixed workload above
    for i in range(1000):  # whole stored prompts: every block held, the most hashing a decision does
        by_class["full_hit"].append(_timed(dispatcher, stored[i % len(stored)], loads[i % len(loads)]))
    hash_us = []
    router_hash_us = []
    for tokens, _ in queries[:1000]:
        t = time.perf_counter_ns()
        sequence_keys(tokens, args.block_size)
        hash_us.append((time.perf_counter_ns() - t) / 1000.0)
        as_list = tokens.tolist()
        t = time.perf_counter_ns()
        sequence_keys(as_list, args.block_size)
        router_hash_us.append((time.perf_counter_ns() - t) / 1000.0)
    rr_us = _round_robin_us(args.ranks, args.decisions)
    record: dict[str, Any] = {
        "bench": "dispatch",
        "ranks": args.ranks,
        "block_size": args.block_size,
        "prompt_tokens": args.tokens,
        "decisions": len(mixed),
        **_figures("", mixed),
    }
    for kind, samples in by_class.items():
        record.update(_figures(kind, samples))
        record[f"decisions_{kind}"] = len(samples)
    record.update(
        {
            "hash_us_p50": round(percentile(hash_us, 50), 2),
            "router_sequence_keys_us_p50": round(percentile(router_hash_us, 50), 2),
            "round_robin_us_p50": round(percentile(rr_us, 50), 3),
            "round_robin_us_p99": round(percentile(rr_us, 99), 3),
            "index_blocks": stats["index_blocks"],
            "populate_s": round(populate_s, 2),
            "reasons": {k: v for k, v in stats["decisions"].items() if v},
            "gc": "enabled (workload garbage collected before timing)",
            "hashing": "c helpers" if hashing.NATIVE is not None else "python (KVPUB_NATIVE=0 or not built)",
            "npu_walk_table": dispatcher.index.npu_walk_table,
            **_timer_stalls(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    )
    emit(with_targets(record))


if __name__ == "__main__":
    main()
