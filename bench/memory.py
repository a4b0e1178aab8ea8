"""Where the adapter's memory goes per indexed (worker, block) entry, on bench/scale.py's workload.

The workload is bench/scale.py's generator without the sockets: ``--instances`` dp-16
instances, each rank an LRU of ``--rank-blocks`` 128-token blocks; first every rank stores
the shared 8-page system prompt, then waves of one request per rank, each request ONE
``BlockRemoved`` of the pages it evicts and ONE ``BlockStored`` of ``--new-pages`` pages
under the system prompt (token ids drawn from a pool of 1,024 pages, engine hashes random).
Every batch goes through the shipped path of the serve process: ``enrich_batch`` +
``BatchEncoder`` (the fan-in's encode), then in a consumer thread ``BatchDecoder.decode``
built as ``motor_adapter.stream`` builds it and ``PrefixIndex.apply_batch``, the way a
stream subscriber takes them: every payload waiting is decoded first, then the decoded
batches are applied in order.  ``--threads`` consumer threads (the serve process today:
one per stream) take the instances round-robin, one decoder each; a wave (one batch per
rank) is in flight at a time, as in bench/scale.py's fill.

Each configuration runs in a FRESH subprocess (the RSS of one run must not hold another's
heap).  Measured there, as bench/scale.py measures the serve process:

- ``rss_bytes_per_entry``: RSS after the fill minus RSS before the first batch (threads
  started, decoders built), over the entries; ``steady_rss_bytes_per_entry`` the same after
  ``--steady-waves`` more waves at full ranks (evicting as many blocks as they store).
- ``index_bytes_per_entry``: the index's own account (``PrefixIndex.stats()``).
- ``traced_bytes_per_entry`` (``--trace``, a second fresh process): what tracemalloc
  sees allocated and still live after the fill (requested sizes, no allocator rounding).
- where the rest is: pymalloc's arenas (``sys._debugmallocstats``: bytes in used blocks,
  free blocks in used pools, empty pools) and glibc's heap (``mallinfo2``: in use, free),
  as growth over the same interval, per entry.

    python bench/memory.py [--instances 25] [--threads 25,1] [--trace]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import emit  # noqa: E402

BS = 128
RANKS = 16
SYSTEM_PAGES = 8
_U64 = (1 << 64) - 1


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _glibc() -> dict[str, int]:
    """glibc malloc's heap over all its arenas: in use, free inside the heap, mmapped chunks."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks, "malloc_mmapped": info.hblkhd}


_PYMALLOC_FIELDS = {
    "# arenas allocated current": "arenas",
    "# bytes in allocated blocks": "pymalloc_used",
    "# bytes in available blocks": "pymalloc_free_blocks",
    "# bytes lost to pool headers": "pymalloc_pool_headers",
    "# bytes lost to quantization": "pymalloc_quantization",
}


def _pymalloc() -> dict[str, int]:
    """pymalloc's totals from ``sys._debugmallocstats`` (written to fd 2: captured)."""
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(capture.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")
    out: dict[str, int] = {}
    for line in text.splitlines():
        label, _, value = line.rpartition("=")
        name = _PYMALLOC_FIELDS.get(label.strip())
        if name is not None:
            out[name] = int(re.sub(r"[^0-9]", "", value))
    empty = re.search(r"(\d+)\s+unused pools \*", text)
    if empty is not None:
        out["pymalloc_empty_pools"] = int(empty.group(1)) * 16384
    if "arenas" in out:
        out["pymalloc_arena_bytes"] = out.pop("arenas") * (1 << 20)
    return out


def memory_snapshot() -> dict[str, int]:
    """RSS, pymalloc's and glibc's totals of this process, after a full collection (also
    served by bench/scale.py's adapter)."""
    gc.collect()
    return {"rss": _rss_bytes(), **_pymalloc(), **_glibc()}


class _Rank:
    """One rank's HBM model: its resident requests as (first engine-hash number, pages), oldest
    first; engine hashes are derived from those numbers, so the model holds no int per block
    (it shares the process being measured)."""

    def __init__(self) -> None:
        self.resident: collections.deque[tuple[int, int]] = collections.deque()
        self.blocks = 0


def _engine_hashes(first: int, count: int) -> list[int]:
    """Random-looking 63-bit engine hashes, numbered ``first..first+count-1`` (splitmix64)."""
    out = []
    for n in range(first, first + count):
        z = (n * 0x9E3779B97F4A7C15) & _U64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        out.append((z ^ (z >> 31)) >> 1)
    return out


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import tracemalloc

    from sglang_kvpub.core import hashing

    token_ids_from_msgpack = getattr(hashing, "token_ids_from_msgpack", None)
    from sglang_kvpub.core.index import PrefixIndex
    from sglang_kvpub.wire import BatchDecoder, BatchEncoder, BlockRemoved, BlockStored, EventBatch, enrich_batch

    rng = random.Random(args.instances)
    pool = [[rng.randrange(1, 150_000) for _ in range(BS)] for _ in range(1024)]
    system_rng = random.Random(99)
    system_tokens = [system_rng.randrange(1, 150_000) for _ in range(SYSTEM_PAGES * BS)]
    system_hashes = _engine_hashes(0, SYSTEM_PAGES)
    numbered = [SYSTEM_PAGES]  # the next engine-hash number
    ranks = [[_Rank() for _ in range(RANKS)] for _ in range(args.instances)]
    encoder = BatchEncoder()
    index = PrefixIndex(BS)
    threads = max(1, min(int(args.threads), args.instances))
    inboxes: list[queue.SimpleQueue[tuple[str, int, bytes] | None]] = [queue.SimpleQueue() for _ in range(threads)]
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def consume(inbox: queue.SimpleQueue[tuple[str, int, bytes] | None]) -> None:
        """As a stream subscriber: every payload waiting is received and decoded, then the
        decoded batches are applied in order (``_read_live``, then ``_drain``)."""
        # as motor_adapter.stream builds it (a plain decoder before the compact ids existed)
        decoder = BatchDecoder(token_ids=token_ids_from_msgpack) if token_ids_from_msgpack else BatchDecoder()
        decoded: list[tuple[str, int, Any]] = []
        while True:
            item = inbox.get()
            try:
                if item is not None:
                    name, rank, payload = item
                    decoded.append((name, rank, decoder.decode(payload)))
                    continue
                for name, rank, batch in decoded:
                    index.apply_batch(name, batch, dp_rank=rank)
            except BaseException as exc:  # reported by the driver
                errors.append(exc)
                if item is not None:
                    continue
            decoded.clear()
            done.release()

    for inbox in inboxes:
        threading.Thread(target=consume, args=(inbox,), daemon=True).start()

    def payload(rank: int, events: list[Any]) -> bytes:
        batch = enrich_batch(EventBatch(ts=time.time(), events=events), dp_rank=rank, block_size=0)
        return encoder.encode(batch)

    def request(i: int, r: int) -> bytes:
        rank = ranks[i][r]
        tokens = [t for _ in range(args.new_pages) for t in pool[rng.randrange(len(pool))]]
        first = numbered[0]
        numbered[0] += args.new_pages
        hashes = _engine_hashes(first, args.new_pages)
        events: list[Any] = []
        evicted: list[int] = []
        while rank.blocks + len(hashes) > args.rank_blocks and rank.resident:
            old, pages = rank.resident.popleft()
            evicted += _engine_hashes(old, pages)
            rank.blocks -= pages
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
        events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=system_hashes[-1],
                token_ids=tokens,
                block_size=BS,
                medium="GPU",
            )
        )
        rank.resident.append((first, len(hashes)))
        rank.blocks += len(hashes)
        return payload(r, events)

    def wave(make: Any) -> None:
        """One batch per rank, each consumer thread fed its instances'; waits until applied."""
        for i in range(args.instances):
            for r in range(RANKS):
                inboxes[i % threads].put((f"prefill-{i}", r, make(i, r)))
        for inbox in inboxes:
            inbox.put(None)
        for _ in inboxes:
            done.acquire()

    def entries() -> int:
        return sum(SYSTEM_PAGES + rank.blocks for inst in ranks for rank in inst)

    def system(i: int, r: int) -> bytes:
        stored = BlockStored(block_hashes=system_hashes, token_ids=system_tokens, block_size=BS, medium="GPU")
        return payload(r, [stored])

    if args.trace:
        tracemalloc.start()
    before = memory_snapshot()
    traced_before = tracemalloc.get_traced_memory()[0] if args.trace else 0
    started = time.perf_counter()
    wave(system)
    for _ in range(args.rank_blocks // args.new_pages):
        wave(request)
    fill_s = time.perf_counter() - started
    full = memory_snapshot()
    count = entries()
    stats = index.stats()
    out: dict[str, Any] = {
        **_index_parts(index, count),
        "threads": threads,
        "native": hashing.NATIVE is not None,
        "entries": count,
        "index_entries": stats.blocks,
        "fill_s": round(fill_s, 1),
        "index_bytes_per_entry": round(stats.bytes_per_entry, 1),
    }
    if args.trace:
        out["traced_bytes_per_entry"] = round((tracemalloc.get_traced_memory()[0] - traced_before) / count, 1)
        tracemalloc.stop()
        return out
    for name, value in full.items():
        if name in before:
            out[f"{name}_bytes_per_entry" if name == "rss" else f"{name}_per_entry"] = round(
                (value - before[name]) / count, 1
            )
    for _ in range(args.steady_waves):
        wave(request)
    steady = memory_snapshot()
    out["steady_rss_bytes_per_entry"] = round((steady["rss"] - before["rss"]) / entries(), 1)
    out["steady_index_bytes_per_entry"] = round(index.stats().bytes_per_entry, 1)
    out.update({f"steady_{name}": value for name, value in _index_parts(index, entries()).items()})
    if errors:
        out["errors"] = repr(errors[:3])
    return out


def _index_parts(index: Any, entries: int) -> dict[str, float]:
    """The index's own account split by structure, per entry (its private tables: a bench
    may look): the tier dicts' tables, their key ints, the engine hash -> key maps."""
    tables = sum(sys.getsizeof(masks) for masks in index._masks)
    keys = sum(len(masks) for masks in index._masks)
    maps = sum(sys.getsizeof(m) for worker in index._workers.values() for m in worker.maps)
    return {
        "tier_dict_bytes_per_entry": round(tables / entries, 1),
        "tier_dict_slots": sum(_dict_slots(masks) for masks in index._masks),
        "key_int_bytes_per_entry": round(keys * 48 / entries, 1),
        "engine_map_bytes_per_entry": round(maps / entries, 1),
    }


def _dict_slots(table: dict[int, int]) -> int:
    """The size of a dict's hash table (a power of two), from its __sizeof__."""
    return 1 << max(0, (sys.getsizeof(table) // 28).bit_length() - 1) if table else 0


def _run_child(args: argparse.Namespace, threads: int, trace: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--instances", str(args.instances), "--threads", str(threads)]
    cmd += ["--rank-blocks", str(args.rank_blocks), "--new-pages", str(args.new_pages)]
    cmd += ["--steady-waves", str(args.steady_waves)]
    if trace:
        cmd.append("--trace")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=25)
    parser.add_argument("--threads", default="25,1", help="consumer threads per run, comma-separated (a run each)")
    parser.add_argument("--rank-blocks", type=int, default=1000)
    parser.add_argument("--new-pages", type=int, default=40)
    parser.add_argument("--steady-waves", type=int, default=25, help="waves at full ranks after the fill")
    parser.add_argument("--trace", action="store_true", help="also a tracemalloc run (one thread)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    runs = [(int(t), False) for t in args.threads.split(",")] + ([(1, True)] if args.trace else [])
    for threads, trace in runs:
        record = {
            "bench": "memory",
            "instances": args.instances,
            "rank_blocks": args.rank_blocks,
            **_run_child(args, threads, trace),
        }
        record["loadavg_1m"] = round(os.getloadavg()[0], 2)
        emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
