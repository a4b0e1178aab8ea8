"""Residency bench: release-hook overhead per scheduler step, reconciliation, snapshot size/time.

One JSON line:
{"bench": "residency", "step_overhead_us_median", "step_overhead_us_p99", "reconcile_slice_ms_max",
 "reconcile_1m_pages_s", "snapshot_1m_blocks_s", "snapshot_1m_blocks_bytes", ...notes}

- Step overhead: the same SGLang steps (insert a 1k-token request on a shared prefix,
  match_prefix, evict 2 pages, take_events) on SGLang 0.5.23's real UnifiedRadixCache
  (Python UnifiedTreeCore, page 128, CPU torch), alternating with/without the release
  hooks in the same run; overhead = per-pair difference of step times.
- Reconcile: a real legacy RadixCache (page 4) holding 1M device pages in ~15.6k nodes,
  one forced full walk in 1 ms slices (max slice and whole-walk time).
- Snapshot: sglang_kvpub.residency.RankResidency with 1M resident blocks (16 tokens each,
  chains of 64), snapshot_events + wire.BatchEncoder("map") encoding.
Run: python bench/residency.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _toggle(enabled: bool) -> None:
    import pkgutil

    from sglang_kvpub.release_hooks import hook_targets

    for target, _hook in hook_targets():
        owner, method = target.rsplit(".", 1)
        cls = pkgutil.resolve_name(owner)
        current = cls.__dict__.get(method)
        stash = f"_kvpub_hooked_{method}"
        if enabled and stash in cls.__dict__:
            setattr(cls, method, cls.__dict__[stash])
            delattr(cls, stash)
        elif not enabled and current is not None and hasattr(current, "__wrapped__"):
            setattr(cls, stash, current)
            setattr(cls, method, current.__wrapped__)


def step_overhead(ns: Any, steps: int) -> tuple[float, float]:
    import rh_trees as rt

    page = 128
    trees = {flag: rt.unified_tree(ns, page) for flag in (True, False)}
    prefix = list(range(1_000_000, 1_000_000 + 4 * page))
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps):
        tokens = prefix + [i * 10_000 + j for j in range(8 * page)]
        for flag in (False, True):
            _toggle(flag)
            tree = trees[flag]
            start = time.perf_counter()
            rt.insert(ns, tree, tokens)
            tree.match_prefix(ns.base.MatchPrefixParams(key=rt.key(ns, tokens)))
            if i >= 8:
                tree.evict(ns.base.EvictParams(num_tokens=2 * page))
            tree.take_events()
            times[flag].append(time.perf_counter() - start)
    _toggle(True)
    diffs = sorted((a - b) * 1e6 for a, b in zip(times[True], times[False], strict=True))
    return statistics.median(diffs), diffs[min(len(diffs) - 1, int(len(diffs) * 0.99))]


def reconcile(ns: Any, pages: int) -> tuple[float, float]:
    import rh_trees as rt

    from sglang_kvpub.reconcile import Reconciler

    page = 4
    tree = rt.legacy_tree(ns, page)
    per_node = 64
    for n in range(pages // per_node):
        rt.insert(ns, tree, [n // 64] * page + [n * 1000 + j for j in range(per_node * page - page)])
        if n % 256 == 0:
            tree.take_events()
    tree.take_events()
    # Scheduler CPU time (thread_time): this 2-core machine is shared, wall slices include preemption.
    rec = Reconciler(tree, budget_s=0.001, clock=time.thread_time)
    start = time.perf_counter()
    rec.run()
    while rec._garbage:  # the walk's containers are freed in later idle slices
        rec.step()
    total = time.perf_counter() - start
    return rec.max_slice_s * 1e3, total


def snapshot(blocks: int) -> tuple[float, int]:
    from sglang_kvpub.residency import RankResidency
    from sglang_kvpub.wire import BatchEncoder, BlockStored, EventBatch

    res = RankResidency()
    chain, size = 64, 16
    block = 1
    for _c in range(blocks // chain):
        parent = None
        hashes = list(range(block, block + chain))
        res.apply(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=list(range(chain * size)),
                block_size=size,
                lora_id=None,
                medium="GPU",
            )
        )
        block += chain
    encoder = BatchEncoder("map")
    start = time.perf_counter()
    events = res.snapshot_events()
    total = 0
    for i in range(0, len(events), 256):
        total += len(encoder.encode(EventBatch(ts=0.0, events=events[i : i + 256], dp_rank=0)))
    return time.perf_counter() - start, total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes (extrapolated)")
    args = parser.parse_args()
    import rh_trees as rt

    ns = rt.setup()
    steps = 100 if args.quick else 400
    pages = 1 << 17 if args.quick else 1 << 20
    blocks = 1 << 17 if args.quick else 1 << 20
    median, p99 = step_overhead(ns, steps)
    slice_ms, walk_s = reconcile(ns, pages)
    snap_s, snap_bytes = snapshot(blocks)
    scale = (1 << 20) / pages
    print(
        json.dumps(
            {
                "bench": "residency",
                "step_overhead_us_median": round(median, 2),
                "step_overhead_us_p99": round(p99, 2),
                "reconcile_slice_ms_max": round(slice_ms, 3),
                "reconcile_1m_pages_s": round(walk_s * scale, 3),
                "snapshot_1m_blocks_s": round(snap_s * (1 << 20) / blocks, 3),
                "snapshot_1m_blocks_bytes": int(snap_bytes * (1 << 20) / blocks),
                "tree": "UnifiedRadixCache(python core, page 128) / RadixCache(page 4, 64 pages/node)",
                "snapshot_block_tokens": 16,
                "reconcile_clock": "thread_time",
                "extrapolated": bool(args.quick),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
