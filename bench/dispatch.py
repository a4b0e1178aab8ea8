"""Decision cost of the cache-aware DP dispatcher (``sglang_kvpub.dispatch``).

Workload (default): 16 ranks, block size 128; every rank holds ``--prompts`` 6,144-token
prompts (48 blocks, stored as merged ``BlockStored`` events through ``observe``, the
fan-in's path) under one of 8 shared system prompts.  Queries are 6,144-token prompts
as SGLang's ``array("q")``: 80% start with a stored prompt (full or partial hit), 20%
are cold.  Loads are random token counts per decision.

Timed per decision: ``choose`` (hashing + index walk + cost over 16 ranks + guard).
``decision_us_p50_full_hit``: 1,000 more decisions on whole stored prompts (every block
held: the most hashing a decision does).
Also: hashing alone (``hashing.sequence_keys`` on the array), the same on a list (the router's
path), and the round-robin baseline: SGLang 0.5.23's own selection cost, i.e. a counter
modulo the active ranks.  The routing-quality side is bench/routing.py
(``fold_pinned_dispatch``).

    python bench/dispatch.py [--ranks 16] [--block-size 128] [--tokens 6144] [--decisions 5000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, percentile  # noqa: E402
from sglang_kvpub.dispatch import CacheAwareDispatcher  # noqa: E402
from sglang_kvpub.hashing import sequence_keys  # noqa: E402
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


def _queries(rng: random.Random, stored: list[list[int]], args: argparse.Namespace) -> list[tuple[array[int], bool]]:
    out: list[tuple[array[int], bool]] = []
    for _ in range(args.decisions):
        if rng.random() < 0.8:
            base = stored[rng.randrange(len(stored))]
            keep = rng.randrange(args.block_size, len(base) + 1)  # partial or full hit
            tokens = base[:keep] + [rng.randrange(150_000) for _ in range(args.tokens - keep)]
            out.append((array("q", tokens), True))
        else:
            out.append((array("q", [rng.randrange(150_000) for _ in range(args.tokens)]), False))
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
    stored = _populate(dispatcher, rng, args)
    populate_s = time.perf_counter() - t0
    queries = _queries(rng, stored, args)
    loads = [[rng.uniform(0, 20_000) for _ in range(args.ranks)] for _ in range(64)]

    for tokens, _ in queries[:200]:  # warm-up
        dispatcher.choose(tokens, loads[0])
    decision_us: list[float] = []
    hit_us: list[float] = []
    cold_us: list[float] = []
    for i, (tokens, warm) in enumerate(queries):
        load = loads[i % len(loads)]
        t = time.perf_counter_ns()
        dispatcher.choose(tokens, load)
        us = (time.perf_counter_ns() - t) / 1000.0
        decision_us.append(us)
        (hit_us if warm else cold_us).append(us)
    stats = dispatcher.stats()  # reasons of the mixed workload above
    full_us: list[float] = []  # worst case for early-stopping hashing: a stored prompt, whole
    for i in range(1000):
        tokens = array("q", stored[i % len(stored)])
        t = time.perf_counter_ns()
        dispatcher.choose(tokens, loads[i % len(loads)])
        full_us.append((time.perf_counter_ns() - t) / 1000.0)
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
    emit(
        {
            "bench": "dispatch",
            "ranks": args.ranks,
            "block_size": args.block_size,
            "prompt_tokens": args.tokens,
            "decisions": len(decision_us),
            "decision_us_p50": round(percentile(decision_us, 50), 2),
            "decision_us_p99": round(percentile(decision_us, 99), 2),
            "decision_us_p50_hit": round(percentile(hit_us, 50), 2),
            "decision_us_p99_hit": round(percentile(hit_us, 99), 2),
            "decision_us_p50_cold": round(percentile(cold_us, 50), 2),
            "decision_us_p50_full_hit": round(percentile(full_us, 50), 2),
            "hash_us_p50": round(percentile(hash_us, 50), 2),
            "router_sequence_keys_us_p50": round(percentile(router_hash_us, 50), 2),
            "round_robin_us_p50": round(percentile(rr_us, 50), 3),
            "round_robin_us_p99": round(percentile(rr_us, 99), 3),
            "target_us": 50,
            "index_blocks": stats["index_blocks"],
            "populate_s": round(populate_s, 2),
            "reasons": {k: v for k, v in stats["decisions"].items() if v},
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    )


if __name__ == "__main__":
    main()
