"""``/query`` latency and throughput of the conductor-compatible service over loopback.

The service runs in this process with an index of ``--instances`` fanned-in instances x
``--ranks`` ranks holding ``--prompts`` prompts each; ``--clients`` concurrent aiohttp
clients in ANOTHER process post Motor-shaped msgpack ``/query`` bodies of ``--tokens``
token ids (the service decodes and hashes them). The baseline is a no-op endpoint (reads
the body, answers ``{}``) of the same app - same aiohttp stack, same middleware - measured
in the same run, phases interleaved. Three phases:

- ``noop``: the baseline;
- ``query``: one prompt posted again and again (Motor's repeat: a prompt the
  service has seen before - its hashed keys are cached; the index walk runs for every
  request, and the answer is rendered once per walk result, as for any prompt);
- ``query_distinct``: every request a body never seen before (the prompt with its last
  token changed per request): no body seen before, so every request decodes, range-checks
  and hashes the ids its leading blocks do not share with a recent body (the handler's
  prefix reuse, docs/native.md: here the last block);
- ``query_loads``, ``query_distinct_loads``: the same two while rank loads flow as in
  production: every instance's stream sends a rank-load message (``wire.LoadReport``,
  through its codec, into the book as the subscriber thread hands it on) every
  ``--load-period`` seconds with changed figures (the fan-in's ``load_report_s``), so every
  answer is rank-aware (the rank that would serve the request, its hit and load)
  and each answer commits its prompt's uncached tokens to the rank it names.

Prints one JSON line with ``targets`` (p99 <= 2 x no-op p99 + 0.3 ms; CPU per request
<= 1.2 x no-op's for ``query``, <= 1.5 x for ``query_distinct``, the same bounds for the two
phases with rank loads: the service adds little to what any aiohttp endpoint costs).

``*_cpu_us``: the server process's CPU time per request in each phase (read before and after
every phase). Unlike the latencies they hardly move when other processes load the machine,
so they tell a server-side change from noise. ``*_cpu_us_rounds``: the same per round (each
phase runs ``--rounds`` times, interleaved): on a shared host one round of a phase can cost
a third more than another of the same phase with the same code. Hence 18 rounds by default
(~100 s a run): with 6, the round-to-round spread alone moved a phase's ratio to the no-op
by ~0.1 between runs of the same code (docs/operations.md).

    python bench/service.py [--clients 64] [--seconds 1] [--rounds 18] [--tokens 6144] [--phases query_distinct]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import TARGETS, emit, percentile, with_targets  # noqa: E402
from sglang_kvpub.tools.ports import free_port  # noqa: E402

BS = 128
MODEL = "bench-model"


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(tokens)]


# --------------------------------------------------------------------------- client process


async def _server_cpu(session: Any, base: str) -> float:
    async with session.get(base + "/_cpu") as response:
        return float(await response.text())


PHASES = ("noop", "query", "query_distinct", "query_loads", "query_distinct_loads")
_MARK = 0xABCDEF12  # the last token of the template body: a u32 (0xce) the client rewrites per request


def _bodies(template: bytes) -> Any:
    """``query_distinct``'s bodies: the template with its last token set to a new id each time."""
    at = template.index(b"\xce" + _MARK.to_bytes(4, "big")) + 1
    counter = 0
    while True:
        counter += 1
        body = bytearray(template)
        body[at : at + 4] = (0x80000000 | counter).to_bytes(4, "big")
        yield bytes(body)


async def _phase(
    session: Any, base: str, name: str, body: bytes, clients: int, seconds: float
) -> tuple[list[float], float, float]:
    """Latencies, elapsed seconds and the server's CPU seconds of one phase."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    headers = {"Content-Type": "application/msgpack"}
    url = f"{base}/{'noop' if name == 'noop' else 'query'}"
    fresh = _bodies(body) if name.startswith("query_distinct") else None
    loads = name.endswith("_loads")

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            data = body if fresh is None else next(fresh)
            start = time.perf_counter()
            async with session.post(url, data=data, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url}: HTTP {response.status}")
            latencies.append(time.perf_counter() - start)

    if loads:  # the feed runs through the phase: its CPU counts as the subscriber's does in production
        await _switch_loads(session, base, "on")
    cpu_before = await _server_cpu(session, base)
    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - began
    cpu = await _server_cpu(session, base) - cpu_before
    if loads:
        await _switch_loads(session, base, "off")
    return latencies, elapsed, cpu


async def _switch_loads(session: Any, base: str, state: str) -> None:
    async with session.post(base + "/_loads", data=state.encode()) as response:
        await response.read()


def _client_main(
    base: str, bodies: dict[str, bytes], phases: list[str], clients: int, seconds: float, rounds: int, out: Any
) -> None:
    # per phase: latencies, elapsed seconds, requests, server CPU seconds, each round's CPU us per request
    results: dict[str, list[Any]] = {name: [[], 0.0, 0, 0.0, []] for name in phases}

    async def run() -> None:
        import aiohttp

        # ONE session for the run, as a router keeps its connections: a session per phase put
        # 64 TCP handshakes into every phase's latencies (over 1% of a query phase's requests).
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60.0)) as session:
            for name in phases:  # warm-up: connections, caches
                await _phase(session, base, name, bodies[name], clients, 0.5)
            for _ in range(rounds):  # short phases, interleaved: background load hits all alike
                for name in phases:
                    lat, elapsed, cpu = await _phase(session, base, name, bodies[name], clients, seconds)
                    results[name][0].extend(lat)
                    results[name][1] += elapsed
                    results[name][2] += len(lat)
                    results[name][3] += cpu
                    results[name][4].append(round(cpu / len(lat) * 1e6, 1) if lat else 0.0)

    asyncio.run(run())
    out.send({k: tuple(v) for k, v in results.items()})
    out.close()


# --------------------------------------------------------------------------- server side


def _build_state(args: argparse.Namespace, rng: random.Random) -> tuple[Any, list[list[int]], list[str]]:
    from motor_adapter.affinity import KvAffinity, NoSubscriber
    from motor_adapter.registration import parse_registration
    from motor_adapter.scoring import KvAffinityConfig
    from motor_adapter.service import AdapterState, ServiceConfig
    from sglang_kvpub import wire

    state = AdapterState(
        ServiceConfig(kv_affinity=KvAffinityConfig(block_size=BS)),
        affinity_factory=lambda cfg, cap: KvAffinity(cfg, cap, subscriber_factory=NoSubscriber),
    )
    prompts = [_prompt(rng, args.tokens) for _ in range(args.prompts)]
    urls = []
    for i in range(args.instances):
        url = f"tcp://127.0.0.1:{free_port()}"
        urls.append(url)
        reg = parse_registration(
            {
                "instance_id": f"vllm-prefill-{i}",
                "medium_endpoints": {"npu": url},
                "type": "sglang",
                "modelname": MODEL,
                "block_size": BS,
                "fanned_in": True,
            }
        )
        state.register(reg)
        aff = state.affinity(MODEL, "default", BS)
        assert aff is not None
        for rank in range(args.ranks):
            for p, tokens in enumerate(prompts):
                if (p + rank + i) % 3:  # every prompt cached on some ranks of some instances
                    continue
                keep = len(tokens) // BS * BS * (1 + (rank % 4)) // 4 // BS * BS
                hashes = [rng.getrandbits(64) for _ in range(keep // BS)]
                event = wire.BlockStored(block_hashes=hashes, token_ids=tokens[:keep], block_size=BS, medium="GPU")
                aff.index.apply_batch(url, wire.EventBatch(ts=0.0, events=[event], dp_rank=rank))
    return state, prompts, urls


class _LoadFeed:
    """Every instance's rank-load messages while switched on, as the fan-ins send them: one
    ``wire.LoadReport`` per instance every ``period`` seconds with changed figures (a random
    walk of each rank's load), encoded and decoded by the wire codec and handed to the
    instance's book from a thread, as its stream subscriber does.  Switched off, the books
    forget the instances: answers are by the longest hit again, as without loads."""

    def __init__(self, state: Any, urls: list[str], ranks: int, period: float) -> None:
        import threading

        from sglang_kvpub import wire

        self._wire = wire
        self._codec = wire.LoadReportCodec()
        self._affinity = state.affinity(MODEL, "default", BS)
        self._urls = urls
        self._ranks = ranks
        self._period = period
        self._rng = random.Random(11)
        self._loads = {url: [float(self._rng.randrange(20_000)) for _ in range(ranks)] for url in urls}
        self._stop = threading.Event()
        self._thread: Any = None
        self._threading = threading
        self.reports = 0

    def switch(self, on: bool) -> None:
        if on and self._thread is None:
            self._stop.clear()
            self._send_all()  # the first figures before the phase's first query
            self._thread = self._threading.Thread(target=self._run, name="load-feed", daemon=True)
            self._thread.start()
        elif not on and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            for url in self._urls:
                self._affinity.loads.forget(url)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._send_all()

    def _send_all(self) -> None:
        wire = self._wire
        for url in self._urls:
            loads = self._loads[url]
            for rank in range(self._ranks):  # every rank's queue moves between two reports
                loads[rank] = max(0.0, loads[rank] + self._rng.uniform(-2_000.0, 2_000.0))
            ranks = [wire.RankLoad(rank, load, int(load) // 4_000) for rank, load in enumerate(loads)]
            payload = self._codec.encode(time.time(), wire.RankLoads(ranks, {}, self._period))
            report = self._codec.decode(payload)
            assert report is not None
            self._affinity.loads.apply(url, report)
            self.reports += 1


async def _serve(args: argparse.Namespace) -> dict[str, Any]:
    import msgpack
    from aiohttp import web

    from motor_adapter.service import build_app

    rng = random.Random(7)
    state, prompts, urls = _build_state(args, rng)
    feed = _LoadFeed(state, urls, args.ranks, args.load_period)
    app = build_app(state)

    async def noop(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({})

    async def cpu(request: web.Request) -> web.Response:
        return web.Response(text=repr(time.process_time()))

    async def switch_loads(request: web.Request) -> web.Response:
        feed.switch(await request.read() == b"on")
        return web.Response(text="ok")

    app.router.add_post("/noop", noop)
    app.router.add_get("/_cpu", cpu)
    app.router.add_post("/_loads", switch_loads)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    body = msgpack.packb({"model": MODEL, "block_size": BS, "token_ids": prompts[0], "tenant_id": "default"})
    template = {"model": MODEL, "block_size": BS, "token_ids": [*prompts[0][:-1], _MARK], "tenant_id": "default"}
    distinct = msgpack.packb(template)
    bodies = {"query": body, "noop": body, "query_distinct": distinct, "query_loads": body}
    bodies["query_distinct_loads"] = distinct
    phases = ["noop", *[name for name in args.phases.split(",") if name and name != "noop"]]
    if unknown := set(phases) - set(PHASES):
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    client_args = (f"http://127.0.0.1:{port}", bodies, phases, args.clients, args.seconds, args.rounds, send)
    proc = ctx.Process(target=_client_main, args=client_args)
    proc.start()
    send.close()
    loop = asyncio.get_running_loop()
    try:
        results = await loop.run_in_executor(None, recv.recv)
    finally:
        await loop.run_in_executor(None, proc.join, 30)
        if proc.is_alive():
            proc.kill()
        feed.switch(False)
        await runner.cleanup()
    out: dict[str, Any] = {"bench": "service"}
    for name in phases:
        latencies, elapsed, count, cpu_s, rounds = results[name]
        ms = [x * 1000 for x in latencies]
        out[f"{name}_p50_ms"] = round(percentile(ms, 50), 3)
        out[f"{name}_p99_ms"] = round(percentile(ms, 99), 3)
        out[f"{name}_rps"] = round(count / elapsed, 1) if elapsed else 0.0
        out[f"{name}_cpu_us"] = round(cpu_s / count * 1e6, 1) if count else 0.0
        # Each round's figure: a host hiccup shows as one round apart from the rest (the
        # targets read the whole phase, *_cpu_us, as before).
        out[f"{name}_cpu_us_rounds"] = rounds
    order = [
        "bench",
        "query_p50_ms",
        "query_p99_ms",
        "query_rps",
        "noop_p99_ms",
        "noop_rps",
        "noop_p50_ms",
        "query_cpu_us",
        "noop_cpu_us",
        *(f"{name}_{figure}" for name in PHASES[2:] for figure in ("p50_ms", "p99_ms", "rps", "cpu_us")),
    ]
    record = {k: out[k] for k in order if k in out}
    record.update({k: v for k, v in out.items() if k.endswith("_cpu_us_rounds")})
    record.update(
        load_reports=feed.reports,
        load_period_s=args.load_period,
        clients=args.clients,
        tokens=args.tokens,
        instances=args.instances,
        ranks=args.ranks,
        stack=f"aiohttp {aiohttp_version()}",
        loadavg_1m=round(os.getloadavg()[0], 2),
    )
    return with_targets(record, [t for t in TARGETS if t.figure in record])  # --phases may leave some out


def aiohttp_version() -> str:
    import aiohttp

    return str(aiohttp.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=18, help="rounds of every phase, interleaved")
    parser.add_argument("--tokens", type=int, default=6144, help="prompt length of each /query")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--load-period", type=float, default=0.1, help="seconds between an instance's load reports")
    parser.add_argument(
        "--phases", default=",".join(PHASES[1:]), help=f"comma-separated, of {', '.join(PHASES[1:])} (noop always)"
    )
    args = parser.parse_args()
    emit(asyncio.run(_serve(args)))


if __name__ == "__main__":
    main()
