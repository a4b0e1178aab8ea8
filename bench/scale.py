"""Many dp-16 instances into ONE ``motor-kv-adapter serve`` process, raised until it saturates.

Per ``N`` in ``--instances`` (a fresh adapter and fresh engines each time):

- **The adapter**: ``motor-kv-adapter serve --registry memory`` in a subprocess (its CLI
  entry, its arguments) with one bench-only route added to its app, ``POST /noop`` (reads
  the body, answers ``{}``: the same aiohttp stack and middleware), the baseline.
- **The engines**: ``N`` real fan-ins (:class:`sglang_kvpub.publish.fanin.FanIn`: the
  instance stream's PUB, seq, heartbeats, replay and snapshot ROUTER) in one generator
  process, each fed 16 ranks' batches through :meth:`FanIn.ingest` (the sidecar's path)
  by a model of each rank's HBM: ``--rank-blocks`` blocks of 128 tokens, LRU.  Each
  request of a rank (``--rps-per-rank`` requests/s, ~5k-token prompts: a shared 8-page
  system prompt the rank already holds, then ``--new-pages`` pages of its own) is ONE
  ``BlockStored`` of the new pages, after ONE ``BlockRemoved`` of the pages it evicts: at
  2 requests/s and 40 pages that is ~2.6k block events/s per instance, the report's rate.
  Before measuring, each rank is filled to its capacity as fast as the wire goes.
- **Registered as Motor registers them**: one ``POST /register`` per instance
  (``fanned_in: true``, ``dp_size: 16``, its stream and replay endpoints).

Measured while it ingests, from this (driver) process:

- ``lag`` (in a window of its own after the phases): a probe page is published on a
  random rank of a random instance (its publish time taken just before the fan-in sends
  it), and ``/query`` is asked for it every
  ``--probe-poll-ms`` until the instance's answer holds it; lag = seen - published
  (CLOCK_MONOTONIC, shared by the processes).  One probe every ``--probe-every-ms``.
- ``/query`` and ``/noop``: ``--clients`` concurrent clients, phases interleaved
  (``--rounds`` x ``--seconds`` each), ``/query`` of one ~5k-token prompt (the system
  prompt every rank holds and 32 pages nobody holds); p99 of each.  CPU per request: the
  adapter's event-loop thread's CPU time (``/proc/PID/task/PID/stat``) over each phase,
  per request - the stream threads' ingest CPU is not in it.
- RSS of the adapter after the fill, minus its RSS once every instance was registered and
  synced (empty index), against the index's own account of its bytes (``PrefixIndex.stats()``
  in the adapter, read through a bench-only route), and per entry against the design's
  budget of 144 B (entries: (worker, block) pairs held, counted by the generator's model of
  each rank).  Beside it, the same growth split by allocator (bench/memory.py's fields).
  ``steady_*``: the same figures again after the measurement's churn (every rank's LRU
  turned over many times), the state an adapter runs in.
- ``ingest_cpu_pct``: the adapter's whole CPU over the measurement (all threads), and the
  generator's achieved batch rate against the offered one (``generator_keeps_up``).
- Capacity, each side from its own CPU per batch: ``adapter_capacity_batches_per_s`` (one
  core of ingest at ``ingest_cpu_us_per_batch``) and ``adapter_capacity_instances`` beside
  ``generator_capacity_batches_per_s``.  A row whose generator fell behind carries
  ``not_measured`` (the reason) and its targets neither met nor failed: the generator, not
  the adapter, set its pace.

    python bench/scale.py [--instances 25,50,100,150,200] [--rank-blocks 1000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import emit, percentile, with_targets  # noqa: E402
from sglang_kvpub.tools.ports import free_port  # noqa: E402

BS = 128
RANKS = 16
MODEL = "scale-model"
SYSTEM_PAGES = 8
BUDGET_BYTES = 144  # the design budget per (worker, block) entry; the estimate is the index's own account
CLK_TCK = os.sysconf("SC_CLK_TCK")
GENERATOR_BUSY_PCT = 85.0  # of one core: past it the generator's own loop delays what it sends

# The adapter: `motor-kv-adapter serve`'s own entry point, its app given a /noop route first,
# and /bench-memory: its RSS, allocators (bench/memory.py) and the indexes' own account.
_ADAPTER = """
import sys
from aiohttp import web
import motor_adapter.service as service
from bench.memory import memory_snapshot

_build = service.build_app

def build_app(state, registry=None):
    app = _build(state, registry)

    async def noop(request):
        await request.read()
        return web.json_response({})

    async def memory(request):
        stats = [entry.affinity.index.stats() for entry in list(state._indexes.values())]
        index = {
            "index_entries": sum(s.blocks for s in stats),
            "index_bytes": sum(s.bytes_per_entry * s.blocks for s in stats),
        }
        return web.json_response({**memory_snapshot(), **index})

    app.router.add_post("/noop", noop)
    app.router.add_get("/bench-memory", memory)
    return app

service.build_app = build_app
from motor_adapter.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


# --------------------------------------------------------------------------- the engines


def _page(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(BS)]


class _Rank:
    """One rank's HBM: resident requests' (engine hashes) oldest first, within ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: list[list[int]] = []
        self.blocks = 0
        self.seq = 0


def _generator_main(args: dict[str, Any], conn: Any) -> None:
    """N fan-ins and their ranks' traffic; answers the driver's commands over ``conn``."""
    from sglang_kvpub.config import PluginConfig
    from sglang_kvpub.publish.fanin import FanIn
    from sglang_kvpub.wire import BlockRemoved, BlockStored, EventBatch

    rng = random.Random(args["seed"])
    # Prompts are two random runs of pages of one long token list: two C-speed slices, not a
    # 5k-token Python loop per request (the generator shares the box's cores with the adapter);
    # 4,096 pages give ~16M distinct prompts, so ranks rarely share one.
    pool = [t for _ in range(4096) for t in _page(rng)]
    halves = (args["new_pages"] // 2, args["new_pages"] - args["new_pages"] // 2)
    system_tokens = [t for _ in range(SYSTEM_PAGES) for t in _page(random.Random(99))]
    system_hashes = [rng.getrandbits(63) for _ in range(SYSTEM_PAGES)]
    fanins: list[FanIn] = []
    endpoints = []
    for _ in range(args["instances"]):
        config = PluginConfig(
            endpoint=f"tcp://127.0.0.1:{free_port()}",
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            bind=True,
            buffer_steps=args["buffer_steps"],  # ~25 KB a batch: the default 10,000 is 250 MB per instance
        )
        fanin = FanIn(config, RANKS, listen_channel=False)
        fanin.start()
        fanins.append(fanin)
        endpoints.append((config.endpoint, config.replay_endpoint))
    ranks = [[_Rank(args["rank_blocks"]) for _ in range(RANKS)] for _ in fanins]
    epoch = 1
    sent = {"batches": 0, "blocks": 0}

    def send(i: int, r: int, events: list[Any]) -> None:
        rank = ranks[i][r]
        fanins[i].ingest(r, epoch, rank.seq, EventBatch(ts=time.time(), events=events))
        rank.seq += 1
        sent["batches"] += 1

    def request(i: int, r: int, tokens: list[int] | None = None) -> None:
        rank = ranks[i][r]
        if tokens is None:
            tokens = []
            for pages in halves:
                start = rng.randrange(4096 - pages) * BS
                tokens += pool[start : start + pages * BS]
        hashes = [rng.getrandbits(63) for _ in range(len(tokens) // BS)]
        events: list[Any] = []
        evicted: list[int] = []
        while rank.blocks + len(hashes) > rank.capacity and rank.resident:
            old = rank.resident.pop(0)
            evicted += old
            rank.blocks -= len(old)
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
        rank.resident.append(hashes)
        rank.blocks += len(hashes)
        sent["blocks"] += len(hashes) + len(evicted)
        send(i, r, events)

    def entries() -> int:
        return sum(SYSTEM_PAGES + rank.blocks for inst in ranks for rank in inst)

    conn.send({"endpoints": endpoints})
    running = False
    rate = args["rps_per_rank"]
    workers = [(i, r) for i in range(len(fanins)) for r in range(RANKS)]
    next_due = 0.0
    started = 0.0
    cursor = 0
    due_total = 0
    while True:
        if conn.poll(0 if running else None):
            command = conn.recv()
            kind = command[0]
            if kind == "fill_system":
                for i in range(len(fanins)):
                    for r in range(RANKS):
                        stored = BlockStored(
                            block_hashes=system_hashes, token_ids=system_tokens, block_size=BS, medium="GPU"
                        )
                        send(i, r, [stored])
                conn.send({"entries": entries(), "batches": sent["batches"]})
            elif kind == "fill_wave":  # one request per rank
                for i, r in workers:
                    request(i, r)
                conn.send({"entries": entries(), "batches": sent["batches"]})
            elif kind == "run":
                running = True
                started = next_due = time.monotonic()
                due_total = 0
                sent["batches"] = sent["blocks"] = 0
            elif kind == "probe":
                _, i, r, tokens = command
                published = time.monotonic()
                request(i, r, tokens)
                conn.send({"published": published})
            elif kind == "stats":
                elapsed = time.monotonic() - started
                conn.send(
                    {
                        "offered_batches_per_s": round(rate * len(workers), 1),
                        "achieved_batches_per_s": round(sent["batches"] / elapsed, 1) if elapsed else 0.0,
                        "block_events_per_s": round(sent["blocks"] / elapsed) if elapsed else 0,
                        "entries": entries(),
                        "batches": sent["batches"],
                        "cpu_s": time.process_time(),
                    }
                )
            elif kind == "stop":
                break
            continue
        now = time.monotonic()
        # Requests due since the start at rate x ranks, dealt round-robin over the ranks.
        due = int((now - started) * rate * len(workers)) - due_total
        for _ in range(min(due, 64)):
            i, r = workers[cursor]
            cursor = (cursor + 1) % len(workers)
            request(i, r)
            due_total += 1
        if due <= 0:
            next_due = started + (due_total + 1) / (rate * len(workers))
            time.sleep(max(0.0, min(next_due - time.monotonic(), 0.005)))
    for fanin in fanins:
        fanin.stop()
    conn.send({"stopped": True})


# --------------------------------------------------------------------------- the adapter


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_s(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _start_adapter(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", _ADAPTER, "--log-level", "WARNING", "serve", "--registry", "memory"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"motor-kv-adapter serve exited with {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("motor-kv-adapter serve did not answer /health within 60 s")


class _MemoryGuard:
    """Kills the adapter's process group when the watched processes' RSS passes the limit."""

    def __init__(self, pids: list[int], limit_gb: float) -> None:
        self.pids = [pid for pid in pids if pid]
        self.limit = limit_gb * 2**30
        self.peak = 0
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            total = 0
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    total += _rss_bytes(pid)
            self.peak = max(self.peak, total)
            if total > self.limit:
                self.tripped = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pids[0], signal.SIGKILL)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _registration(n: int, endpoint: str, replay: str) -> dict[str, Any]:
    return {
        "instance_id": f"prefill-{n}",
        "medium_endpoints": {"npu": endpoint},
        "replay_endpoint": replay,
        "type": "sglang",
        "modelname": MODEL,
        "block_size": BS,
        "fanned_in": True,
        "dp_size": RANKS,
    }


def _synced(base: str, count: int) -> bool:
    workers = _http(base + "/workers")["workers"]
    live = sum(1 for w in workers for hs in w["health"].values() for h in hs if h.get("connected") and h.get("dp_size"))
    return live >= count


# --------------------------------------------------------------------------- measuring


async def _measure(base: str, pid: int, args: argparse.Namespace, gen: Any, instances: int) -> dict[str, Any]:
    import aiohttp
    import msgpack

    rng = random.Random(5)
    system = [t for _ in range(SYSTEM_PAGES) for t in _page(random.Random(99))]
    prompt = system + [t for _ in range(32) for t in _page(rng)]
    body = msgpack.packb({"model": MODEL, "block_size": BS, "token_ids": prompt, "tenant_id": "default"})
    headers = {"Content-Type": "application/msgpack"}
    lat: dict[str, list[float]] = {"noop": [], "query": []}
    cpu: dict[str, float] = {"noop": 0.0, "query": 0.0}
    count: dict[str, int] = {"noop": 0, "query": 0}
    lags: list[float] = []
    missed = errors = 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def probe(session: Any) -> None:
        nonlocal missed
        k = 0
        while not stop.is_set():
            k += 1
            tokens = _page(random.Random(10_000 + k))  # stored under the system prompt the rank holds
            i, r = rng.randrange(instances), rng.randrange(RANKS)
            ask = msgpack.packb({"model": MODEL, "block_size": BS, "token_ids": system + tokens})
            gen.send(("probe", i, r, tokens))
            published = (await loop.run_in_executor(None, gen.recv))["published"]
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    async with session.post(base + "/query", data=ask, headers=headers) as response:
                        answer = json.loads(await response.read())
                except aiohttp.ClientError:
                    answer = {}
                seen = time.monotonic()
                if answer.get("default", {}).get(f"prefill-{i}", {}).get("longest_matched", 0) >= len(system) + BS:
                    lags.append((seen - published) * 1000)
                    break
                if seen > deadline:
                    missed += 1
                    break
                await asyncio.sleep(args.probe_poll_ms / 1000)
            await asyncio.sleep(args.probe_every_ms / 1000)

    async def phase(session: Any, name: str, seconds: float) -> None:
        stop_at = time.perf_counter() + seconds
        samples: list[float] = []

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with session.post(f"{base}/{name}", data=body, headers=headers) as response:
                        await response.read()
                        if response.status != 200:
                            raise RuntimeError(f"/{name}: HTTP {response.status}")
                except aiohttp.ClientError:  # a dropped keep-alive connection: counted, not timed
                    errors += 1
                    continue
                samples.append((time.perf_counter() - t0) * 1000)

        before = _cpu_s(pid, pid)
        await asyncio.gather(*(client() for _ in range(args.clients)))
        cpu[name] += _cpu_s(pid, pid) - before
        lat[name] += samples
        count[name] += len(samples)

    connector = aiohttp.TCPConnector(limit=args.clients + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name in ("noop", "query"):
            await phase(session, name, 0.5)  # warm-up
        lat = {"noop": [], "query": []}
        cpu = {"noop": 0.0, "query": 0.0}
        count = {"noop": 0, "query": 0}
        applied_before = await loop.run_in_executor(None, _applied_batches, base)
        whole_before, loop_before = _cpu_s(pid), _cpu_s(pid, pid)
        began = time.monotonic()
        for n in range(args.rounds):
            for name in ("noop", "query") if n % 2 else ("query", "noop"):
                await phase(session, name, args.seconds)
        elapsed = time.monotonic() - began
        whole, on_loop = _cpu_s(pid) - whole_before, _cpu_s(pid, pid) - loop_before
        applied = await loop.run_in_executor(None, _applied_batches, base) - applied_before
        # The lag probes after the phases (still ingesting): their polls must not count as load
        # of either phase.
        prober = asyncio.create_task(probe(session))
        await asyncio.sleep(args.probe_seconds)
        stop.set()
        await prober
    out: dict[str, Any] = {}
    for name in ("noop", "query"):
        out[f"{name}_p50_ms"] = round(percentile(lat[name], 50), 3)
        out[f"{name}_p99_ms"] = round(percentile(lat[name], 99), 3)
        out[f"{name}_rps"] = round(count[name] / (args.rounds * args.seconds), 1)
        out[f"{name}_cpu_us"] = round(cpu[name] / count[name] * 1e6, 1) if count[name] else None
    # No probe seen within its 5 s: no figure (a target must not read an empty sample as 0 ms).
    out["lag_p50_ms"] = round(percentile(lags, 50), 2) if lags else None
    out["lag_p99_ms"] = round(percentile(lags, 99), 2) if lags else None
    out["lag_max_ms"] = round(max(lags), 2) if lags else None
    out["lag_probes"] = len(lags)
    out["lag_probes_missed"] = missed
    out["adapter_cpu_pct"] = round(whole / elapsed * 100, 1)
    # Ingest's own cost: every thread but the HTTP loop's, per batch applied meanwhile.
    out["ingest_cpu_pct"] = round((whole - on_loop) / elapsed * 100, 1)
    out["ingest_cpu_us_per_batch"] = round((whole - on_loop) / applied * 1e6, 1) if applied else None
    out["applied_batches_per_s"] = round(applied / elapsed, 1)
    out["client_errors"] = errors
    return out


def run_level(instances: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    gen_args = {
        "instances": instances,
        "rank_blocks": args.rank_blocks,
        "new_pages": args.new_pages,
        "rps_per_rank": args.rps_per_rank,
        "seed": instances,
        "buffer_steps": args.buffer_steps,
    }
    generator = ctx.Process(target=_generator_main, args=(gen_args, theirs), daemon=True)
    generator.start()
    endpoints = mine.recv()["endpoints"]  # the fan-ins bound theirs first: no port picked twice
    port = free_port()
    adapter = _start_adapter(port)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        for n, (endpoint, replay) in enumerate(endpoints):
            _http(base + "/register", _registration(n, endpoint, replay))
        registered_s = time.monotonic() - started
        deadline = time.monotonic() + 120
        while not _synced(base, instances):
            if time.monotonic() > deadline:
                raise RuntimeError("the adapter did not sync every stream within 120 s")
            time.sleep(0.2)
        mem_empty = _http(base + "/bench-memory")
        fill_started = time.monotonic()
        # The fill goes through the wire in waves of one request per rank, each applied before
        # the next (the stream counters): a burst would only queue in ZMQ and the adapter's
        # buffers, and the RSS measured after it would hold that queue's high-water mark.
        waves = args.rank_blocks // args.new_pages
        for command in [("fill_system",)] + [("fill_wave",)] * waves:
            mine.send(command)
            filled = mine.recv()
            _drained(base, filled["batches"], deadline_s=120, idle_s=0.0)
        _drained(base, filled["batches"], deadline_s=120, idle_s=0.5)
        fill_s = time.monotonic() - fill_started
        memory = _memory_figures(_http(base + "/bench-memory"), mem_empty, filled["entries"])
        mine.send(("stats",))
        gen_cpu_before = mine.recv()["cpu_s"]
        mine.send(("run",))
        run_started = time.monotonic()
        time.sleep(args.warmup)
        guard = _MemoryGuard([adapter.pid, generator.pid or 0], args.max_rss_gb)
        profiler = _start_profile(adapter.pid, instances, args)
        try:
            record = asyncio.run(_measure(base, adapter.pid, args, mine, instances))
        except Exception:
            if not guard.tripped:
                raise
            record = {"instances": instances, "ranks": instances * RANKS}
        finally:
            guard.stop()
        if profiler is not None:
            record["profile"] = _finish_profile(profiler)
        record["peak_rss_gb"] = round(guard.peak / 2**30, 2)
        if guard.tripped:  # the fill's memory figures were taken before: kept
            record["saturated"] = f"RSS over {args.max_rss_gb} GB: the adapter fell behind and queued batches"
            record.update(instances=instances, ranks=instances * RANKS, fill_s=round(fill_s, 1), **memory)
            return record
        # Again after the measurement's churn (every rank's LRU turned over many times): the
        # steady state, where CPython's dicts have re-grown over their removed entries.
        steady = _memory_figures(_http(base + "/bench-memory"), mem_empty, filled["entries"])
        mine.send(("stats",))
        gen = mine.recv()
        generator_cpu_pct = round((gen["cpu_s"] - gen_cpu_before) / (time.monotonic() - run_started) * 100, 1)
        record.update(_stream_faults(base))
        record.update(
            {
                "instances": instances,
                "ranks": instances * RANKS,
                "register_all_s": round(registered_s, 2),
                "fill_s": round(fill_s, 1),
                **memory,
                **{f"steady_{k}": steady[k] for k in _STEADY_FIGURES},
                "rss_mb": round(_rss_bytes(adapter.pid) / 2**20, 1),
                "offered_batches_per_s": gen["offered_batches_per_s"],
                "achieved_batches_per_s": gen["achieved_batches_per_s"],
                "block_events_per_s": gen["block_events_per_s"],
                "generator_keeps_up": gen["achieved_batches_per_s"] >= 0.95 * gen["offered_batches_per_s"],
                "generator_cpu_pct": generator_cpu_pct,
            }
        )
        record.update(_capacity(record, gen["batches"], gen["cpu_s"] - gen_cpu_before, args.rps_per_rank))
        return record
    finally:
        with contextlib.suppress(Exception):
            mine.send(("stop",))
            mine.poll(10) and mine.recv()
        generator.join(10)
        if generator.is_alive():
            generator.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(adapter.pid, signal.SIGTERM)
        try:
            adapter.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(adapter.pid, signal.SIGKILL)
            adapter.wait()


_STEADY_FIGURES = ("index_entries", "estimate_bytes_per_entry", "rss_over_estimate", "rss_bytes_per_entry")


def _ratio(num: float, den: float, digits: int) -> float | None:
    """``num / den`` rounded, or None (no figure) when there is nothing to divide by."""
    return round(num / den, digits) if den else None


def _memory_figures(full: dict[str, Any], empty: dict[str, Any], entries: int) -> dict[str, Any]:
    """The adapter's RSS growth over the fill against the index's own account of its bytes
    (for this workload) and the design budget per entry; the growth split by allocator.  An
    empty index (no entries, or none in the index's account) gives None for the per-entry
    figures: no figure rather than a crash or a 0 a target would read as met."""
    grown = full["rss"] - empty["rss"]
    estimate = full["index_bytes"]
    return {
        "entries": entries,
        "index_entries": full["index_entries"],
        "rss_index_mb": round(grown / 2**20, 1),
        "rss_estimate_mb": round(estimate / 2**20, 1),
        "estimate_bytes_per_entry": _ratio(estimate, entries, 1),
        "rss_over_estimate": _ratio(grown, estimate, 3),
        "rss_bytes_per_entry": _ratio(grown, entries, 1),
        "budget_bytes_per_entry": BUDGET_BYTES,
        **{
            f"{name}_per_entry": _ratio(full[name] - empty[name], entries, 1)
            for name in ("pymalloc_used", "pymalloc_arena_bytes", "malloc_in_use", "malloc_free", "malloc_mmapped")
            if name in full and name in empty
        },
    }


def _capacity(record: dict[str, Any], gen_batches: int, gen_cpu_s: float, rps_per_rank: float) -> dict[str, Any]:
    """What each side could sustain on one core, from its own CPU per batch: the adapter's
    ingest threads per batch applied, the generator's process per batch sent.  Beside the
    offered rate they tell which side a row measured: a generator that fell behind (sent
    under 95 % of the offered batches, or ran at ``GENERATOR_BUSY_PCT`` of its core or more,
    where its fan-ins' sends and the lag probes queue behind its own loop) makes the row
    say nothing about the adapter, so the row is marked not measured rather than met or failed."""
    adapter_us = record.get("ingest_cpu_us_per_batch")
    gen_us = round(gen_cpu_s / gen_batches * 1e6, 1) if gen_batches else None
    per_instance = rps_per_rank * RANKS  # batches/s one instance offers
    out: dict[str, Any] = {
        "adapter_capacity_batches_per_s": round(1e6 / adapter_us) if adapter_us else None,
        "adapter_capacity_instances": round(1e6 / adapter_us / per_instance, 1) if adapter_us else None,
        "generator_cpu_us_per_batch": gen_us,
        "generator_capacity_batches_per_s": round(1e6 / gen_us) if gen_us else None,
    }
    reasons = []
    if not record["generator_keeps_up"]:
        reasons.append(
            f"the generator sent {record['achieved_batches_per_s']} of {record['offered_batches_per_s']} batches/s"
        )
    if record["generator_cpu_pct"] >= GENERATOR_BUSY_PCT:
        reasons.append(f"the generator ran at {record['generator_cpu_pct']} % of a core")
    if reasons:
        out["not_measured"] = "; ".join(reasons) + ": the row does not measure the adapter"
    return out


def _start_profile(pid: int, instances: int, args: argparse.Namespace) -> tuple[Any, Path] | None:
    """py-spy (not a dependency: ``pip install py-spy``) on the adapter over the measurement."""
    if not args.profile:
        return None
    out = Path(f"{args.profile}-{instances}.txt")
    seconds = args.rounds * 2 * args.seconds + args.probe_seconds + 1
    cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--format", "raw"]
    cmd += ["--threads", "--nonblocking", "--rate", "200", "--duration", str(int(seconds)), "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out


def _finish_profile(profiler: tuple[Any, Path]) -> dict[str, Any]:
    """Where the samples went: per thread kind, and the leaf functions most often on top."""
    proc, out = profiler
    proc.wait(120)
    threads: dict[str, int] = {}
    leaves: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        count = int(count_text)
        total += count
        names = " ".join(frames[1:3])
        kind = (
            "ingest-reader" if "_run (motor_adapter/ingest.py" in stack
            else "stream-sync" if "_work (motor_adapter/stream.py" in stack
            else "stream-thread" if "_run (motor_adapter/stream.py" in stack
            else "event-loop" if "run_forever" in stack or "asyncio" in names
            else "other"
        )  # fmt: skip
        threads[kind] = threads.get(kind, 0) + count
        leaf = frames[-1].split(" (")[0] if frames else "?"
        leaves[leaf] = leaves.get(leaf, 0) + count
    top = sorted(leaves.items(), key=lambda kv: -kv[1])[:8]
    return {
        "file": str(out),
        "samples": total,
        "threads_pct": {k: round(v * 100 / total, 1) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        "top_leaves_pct": {k: round(v * 100 / total, 1) for k, v in top},
    }


def _health(base: str) -> list[dict[str, Any]]:
    workers = _http(base + "/workers")["workers"]
    return [h for w in workers for hs in w["health"].values() for h in hs]


def _applied_batches(base: str) -> int:
    return sum(h.get("batches", 0) for h in _health(base))


def _stream_faults(base: str) -> dict[str, int]:
    """Gaps, replays, snapshots and restarts summed over the streams (0 on a clean run)."""
    health = _health(base)
    return {f"stream_{k}": sum(h.get(k, 0) for h in health) for k in ("gaps", "replays", "snapshots", "restarts")}


def _idle_s(base: str) -> float:
    workers = _http(base + "/workers")["workers"]
    ages = [h.get("last_event_age_s") for w in workers for hs in w["health"].values() for h in hs]
    return min((age for age in ages if age is not None), default=0.0)


def _drained(base: str, batches: int, deadline_s: float, idle_s: float) -> None:
    """Waits until the adapter's streams applied ``batches`` (heartbeats count too) and no
    stream applied events for ``idle_s``."""
    deadline = time.monotonic() + deadline_s
    while _applied_batches(base) < batches or (idle_s and _idle_s(base) < idle_s):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the adapter applied fewer than {batches} batches within {deadline_s} s")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", default="25,50,100,150", help="N values, comma-separated, raised in order")
    parser.add_argument("--rank-blocks", type=int, default=1000, help="HBM blocks of each rank (128 tokens)")
    parser.add_argument("--new-pages", type=int, default=40, help="pages each request stores (~5k tokens)")
    parser.add_argument("--rps-per-rank", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="noop/query phase pairs, interleaved")
    parser.add_argument("--seconds", type=float, default=2.0, help="per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of traffic before measuring")
    parser.add_argument("--probe-seconds", type=float, default=5.0, help="lag probing window, after the phases")
    parser.add_argument("--probe-every-ms", type=float, default=20.0)
    parser.add_argument("--probe-poll-ms", type=float, default=1.0)
    parser.add_argument("--buffer-steps", type=int, default=256, help="each fan-in's replay buffer (batches)")
    parser.add_argument(
        "--max-rss-gb",
        type=float,
        default=6.0,
        help="the level is stopped when the adapter and the generator hold more (an adapter that falls behind "
        "queues up to its SUB sockets' rcvhwm, 1,000 batches per stream; the machine is shared)",
    )
    parser.add_argument("--profile", help="py-spy the adapter during the measurement: raw stacks to PREFIX-N.txt")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup: no orphan adapter
    for instances in (int(n) for n in args.instances.split(",")):
        record = {"bench": "scale", **run_level(instances, args)}
        record["loadavg_1m"] = round(os.getloadavg()[0], 2)
        emit(with_targets(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
