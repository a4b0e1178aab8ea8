"""Fan-in cost: added latency and throughput of the instance stream vs direct per-rank streams.

Producer processes host the ranks (16 by default).  Every batch is published twice, in the
same call: directly on the rank's own PUB (what SGLang does today, base+rank) and through
a :class:`RankPublisher` to the fan-in process, over the internal channel the plugin uses
by default on one node (a Unix SEQPACKET socket in the private per-instance directory;
``--channel ipc`` or ``tcp`` measures ZMQ's PUSH/PULL instead).

* latency phase: ``rate`` batches/s per rank x 4 events for ``seconds``.  ONE subscriber
  process holds two SUB sockets - one connected to the 16 direct streams, one to the
  instance stream - and reads them alternately, stamping each batch on receipt, so both
  arms meet the same consumer.  Each arm's latency is rank publish (the batch's ``ts``)
  to receipt.  ``added_latency_p50_ms`` / ``added_latency_p99_ms`` are the instance
  stream's percentile minus the direct streams' percentile: how much the fan-in moves the
  latency distribution a router sees.
  Reported alongside, ``paired_added_latency_p50_p99_ms``: the percentiles of the
  per-batch difference (instance arrival minus the same batch's direct arrival).  Its
  tail also holds every stall that hit one path and not the other, wherever it came from;
  ``--control aa`` measures how large that is for two *identical* paths (see below).
* ``--control aa`` (A/A control; not a measurement of the fan-in): each batch also goes
  out on a second direct PUB per rank, in the same call, and the subscriber reads the
  two direct arms instead of direct + instance (the fan-in still runs and is fed, so the
  load is about the same).  The same statistics then show what the method reports for a
  relay that adds nothing.
* throughput phase: producers publish as fast as they can; two subscriber processes, one
  per arm, each rate = batches received / span of its arrivals; ratio = instance / direct.

The producer processes run at ``--producer-nice`` (default 10) in both phases: they
stand in for 16 scheduler processes that in a deployment have cores of their own, as
does the DP controller that hosts the fan-in; on this 2-core box, without it, the load
generators would take the CPU from the processes being measured (the fan-in and the
subscriber, which keep the default priority).  ``--nice-scope generator`` (default)
renices only the generating thread, after the sockets exist (Linux niceness is per
thread): the producers' ZMQ I/O threads keep the default priority, as a scheduler
process's publisher thread does.  That I/O thread is the direct arm's first hop; with
the default channel the instance arm has none (the rank's send is a system call in the
generating thread), so this is the scope that does not slow the baseline down.
``--nice-scope process`` renices the whole producer before it creates anything, I/O
thread included: the direct arm then waits for a niced thread, which makes the instance
stream look faster than it is (its added p99 comes out below zero).
Diagnostic fields: each arm's own latency from the publish-time stamp (``ts``, taken
with ``time.time()`` in the producer and compared with ``time.time()`` at receipt: one
clock on one machine), the CPU share of each process during the latency phase, and how
far the instance stream ends behind the direct one in the throughput phase.

Prints ONE JSON line.  Run: ``python bench/fanin.py [--ranks 16 --rate 500 --seconds 5]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.ports import free_port_block
from sglang_kvpub.transport.channel import private_dir, resolve_channel_endpoint
from sglang_kvpub.transport.zmq_io import NOBLOCK, recv_frame

PAGE = 128


def make_batch(rank: int, phase: int, index: int) -> wire.EventBatch:
    key = (phase << 56) | (rank << 40) | index
    tokens = list(range(index % 1000, index % 1000 + PAGE))
    events: list[wire.Event] = [
        wire.BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=tokens, block_size=PAGE),
        wire.BlockStored(block_hashes=[key + (1 << 39)], parent_block_hash=key, token_ids=tokens, block_size=PAGE),
        wire.BlockRemoved(block_hashes=[key - 2]),
        wire.BlockRemoved(block_hashes=[key - 1 + (1 << 39)]),
    ]
    return wire.EventBatch(ts=time.time(), events=events)


def producer(
    config: PluginConfig, ranks: list[int], direct_base: int, channel: str, rate: float, seconds: float,
    go: Any, phase_done: Any, nice: int, nice_scope: str, control_base: int | None,
) -> None:  # fmt: skip
    import os

    from sglang_kvpub.publish.rank_publisher import RankPublisher

    if nice and nice_scope == "process":
        os.nice(nice)  # before any thread exists: every thread of the producer inherits it
    ctx: zmq.Context[Any] = zmq.Context()

    def bound_pub(port: int) -> zmq.Socket[bytes]:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(f"tcp://127.0.0.1:{port}")
        return pub

    pubs = {rank: bound_pub(direct_base + rank) for rank in ranks}
    controls = {rank: bound_pub(control_base + rank) for rank in ranks} if control_base is not None else {}
    publishers = {rank: RankPublisher(config, rank, PAGE, channel, context=ctx) for rank in ranks}
    if nice and nice_scope == "generator":
        os.nice(nice)  # this thread only: the I/O and sender threads already exist
    encoder = msgspec.msgpack.Encoder()
    clock = time.thread_time_ns  # CPU time of this thread: preemption is not billed
    for phase, paced in ((1, True), (2, False)):
        go[phase].wait(60)
        costs: dict[str, list[int]] = {"direct": [], "instance": []}
        start = time.monotonic()
        index = 0
        while time.monotonic() - start < seconds:
            for rank in ranks:
                batch = make_batch(rank, phase, index)
                # Encoded before publish(): the rank publisher's in-place enrichment comes after.
                c0 = clock()
                direct = wire.EventBatch(ts=batch.ts, events=batch.events, dp_rank=rank)
                frames = [b"", wire.encode_seq(index), encoder.encode(direct)]
                pubs[rank].send_multipart(frames)
                c1 = clock()
                if controls:
                    controls[rank].send_multipart(frames)  # the A/A control's second direct arm
                c1b = clock() if controls else c1
                publishers[rank].publish(batch)  # same ts: pairs the arrivals
                c2 = clock()
                if paced:
                    costs["direct"].append(c1 - c0)
                    costs["instance"].append(c2 - c1b)
            index += 1
            if paced:
                delay = start + index / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        phase_done.put((phase, ranks[0], index, costs))
    for publisher in publishers.values():
        publisher.shutdown()
    go[3].wait(60)
    ctx.destroy(linger=0)


class _Head(msgspec.Struct, array_like=True):
    """Just what identifies a batch: (dp_rank, ts); the events stay undecoded."""

    ts: float
    events: msgspec.Raw
    dp_rank: int | None = None


Arrival = tuple[tuple[int, float], float]  # ((dp_rank, ts), receipt time)


def _sub_socket(ctx: zmq.Context[Any], endpoints: list[str]) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        sub.connect(endpoint)
    return sub


def _read_one(sub: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[_Head], arrivals: list[Arrival]) -> bool:
    """One message if there is one; stamps it on receipt.  False when none was waiting."""
    try:
        recv_frame(sub, NOBLOCK)
    except zmq.Again:
        return False
    recv_frame(sub, 0)  # the rest of a multipart message is already here
    payload = recv_frame(sub, 0)
    now = time.time()
    head = decoder.decode(payload)
    if head.dp_rank is not None and len(head.events) > 1:  # not a heartbeat
        arrivals.append(((head.dp_rank, head.ts), now))
    return True


def subscriber(streams: dict[str, list[str]], ready: Any, stop: Any, out: Any) -> None:
    """Reads every named stream (one SUB each) in one process, alternating between them.

    The cyclic GC is off here: the arrival lists grow by one tracked tuple per batch, and a
    full collection over them (milliseconds) would stall the stamping of both arms at once -
    noise of the measuring tool, not of either path."""
    import gc

    gc.disable()
    ctx: zmq.Context[Any] = zmq.Context()
    subs = {name: _sub_socket(ctx, endpoints) for name, endpoints in streams.items()}
    poller = zmq.Poller()
    for sub in subs.values():
        poller.register(sub, zmq.POLLIN)
    decoder = msgspec.msgpack.Decoder(_Head)
    arrivals: dict[str, list[Arrival]] = {name: [] for name in subs}
    order = list(subs.items())
    ready.set()
    while not stop.is_set():
        if not poller.poll(100):
            continue
        busy = True
        while busy:  # one message per stream per turn: neither arm is read first for long
            busy = False
            for name, sub in order:
                busy = _read_one(sub, decoder, arrivals[name]) or busy
    out.put(arrivals)
    ctx.destroy(linger=0)


def fanin_proc(config: PluginConfig, dp_size: int, channel: str, ready: Any, stop: Any, out: Any) -> None:
    import gc

    from sglang_kvpub.publish.fanin import FanIn

    # (generation, wall ms, CPU ms of the collecting thread) of every cyclic-GC collection:
    # the wall time holds preemption by other processes, the thread's CPU time does not.
    pauses: list[tuple[int, float, float]] = []
    started: list[float] = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.thread_time()
        else:
            wall, cpu = time.perf_counter() - started[0], time.thread_time() - started[1]
            pauses.append((int(info.get("generation", -1)), wall * 1e3, cpu * 1e3))

    fanin = FanIn(config, dp_size, channel_endpoint=channel)
    fanin.start()
    gc.callbacks.append(on_gc)
    ready.set()
    stop.wait(600)
    gc.callbacks.remove(on_gc)
    stats = fanin.stats()
    stats["gc_pauses"] = pauses
    out.put(stats)
    fanin.stop()


def _spin_for_gaps(cpu: int, seconds: float, out: Any) -> None:
    """Spins on one CPU and reports how often, and for how long, it was not running."""
    import os

    os.sched_setaffinity(0, {cpu})
    clock = time.perf_counter_ns
    end = clock() + int(seconds * 1e9)
    prev = clock()
    over_half, over_1ms, longest = 0, 0, 0
    while prev < end:
        now = clock()
        gap = now - prev
        prev = now
        if gap > 500_000:
            over_half += 1
            over_1ms += gap > 1_000_000
            longest = max(longest, gap)
    out.put({"cpu": cpu, "over_0.5ms": over_half, "over_1ms": over_1ms, "max_ms": round(longest / 1e6, 2)})


def host_stall_probe(seconds: float) -> list[dict[str, Any]]:
    """Before the phases, with nothing else busy: one spinning process per CPU.  A gap in
    its clock readings is time the CPU ran something else - on an idle VM, mostly the
    host descheduling the virtual CPU.  Such stalls hit either path of the latency phase
    and set a floor under its tail that no code here can lower."""
    import os

    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    procs = [spawn.Process(target=_spin_for_gaps, args=(cpu, seconds, out)) for cpu in sorted(os.sched_getaffinity(0))]
    for proc in procs:
        proc.start()
    results = sorted((out.get(timeout=seconds + 60) for _ in procs), key=lambda r: int(r["cpu"]))
    for proc in procs:
        proc.join(10)
    return results


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds per process ({} without psutil: the shares are omitted)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        out[name] = times.user + times.system
    return out


def _next_report(phase_done: Any, producers: list[Any], timeout_s: float = 600.0) -> Any:
    """The next producer's phase report; fails fast when a producer died instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return phase_done.get(timeout=1.0)
        except queue.Empty:
            dead = [proc for proc in producers if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"producer {dead[0].name} exited with code {dead[0].exitcode}") from None
    raise TimeoutError(f"no producer report within {timeout_s:.0f} s")


def _run_phase(
    phase: int, streams: dict[str, dict[str, list[str]]], go: Any, phase_done: Any, producers: list[Any],
    watched: dict[str, int],
) -> tuple[dict[str, list[Arrival]], dict[str, float], dict[str, list[int]]]:  # fmt: skip
    """Starts the phase's subscriber processes, lets the producers go, collects arrivals and
    each watched process's CPU share (of one core) over the phase, and the producers' CPU
    cost per batch and arm (paced phase only)."""
    spawn = mp.get_context("spawn")
    procs = []
    for group, group_streams in streams.items():
        ready, stop, out = spawn.Event(), spawn.Event(), spawn.Queue()
        proc = spawn.Process(target=subscriber, args=(group_streams, ready, stop, out), name=group)
        proc.start()
        ready.wait(60)
        procs.append((proc, stop, out))
    time.sleep(1.0)  # let SUB connections settle (slow joiner) before traffic starts
    pids = {**watched, **{proc.name: proc.pid for proc, _, _ in procs if proc.pid is not None}}
    cpu0, t0 = _cpu_seconds(pids), time.monotonic()
    go[phase].set()
    costs: dict[str, list[int]] = {}
    for _ in producers:
        for arm, values in _next_report(phase_done, producers)[3].items():
            costs.setdefault(arm, []).extend(values)
    cpu1, t1 = _cpu_seconds(pids), time.monotonic()
    time.sleep(2.0)  # drain in-flight batches
    arrivals: dict[str, list[Arrival]] = {}
    for proc, stop, out in procs:
        stop.set()
        arrivals.update(out.get(timeout=120))
        proc.join(30)
    shares = {name: round((cpu1[name] - cpu0[name]) / (t1 - t0), 3) for name in cpu1}
    return arrivals, shares, costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rate", type=float, default=500.0, help="batches/s per rank in the latency phase")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--producers", type=int, default=4, help="processes hosting the ranks")
    parser.add_argument("--producer-nice", type=int, default=10, help="niceness of the producer processes (0: none)")
    parser.add_argument(
        "--nice-scope", choices=("process", "generator"), default="generator", help="what --producer-nice applies to"
    )
    parser.add_argument("--rank-send", choices=("inline", "thread"), default="inline", help="PluginConfig.rank_send")
    parser.add_argument(
        "--channel",
        choices=("default", "ipc", "tcp"),
        default="default",
        help="internal channel: the plugin's default on one node (unixpkt), ZMQ ipc, or ZMQ tcp on loopback",
    )
    parser.add_argument(
        "--host-probe-s", type=float, default=2.0, help="seconds of the host stall probe before the phases (0: none)"
    )
    parser.add_argument(
        "--control",
        choices=("aa",),
        default=None,
        help="aa: the latency phase compares two identical direct arms (the method's own floor), not the fan-in",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="whole runs in a row: one JSON line each, then a summary line"
    )
    args = parser.parse_args()
    lines = []
    for index in range(max(1, args.runs)):
        line = run_once(args)
        line["run"] = index + 1
        lines.append(line)
        print(json.dumps(_with_targets(line)), flush=True)
    print(json.dumps(_with_targets(summarize(lines))), flush=True)
    return 0


# A run whose direct arm alone (SGLang's own per-rank streams, no fan-in on its path) has a
# p99 above this was disturbed by the host or its neighbours: the summary names it.
DISTURBED_DIRECT_P99_MS = 1.0


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of ``--runs``: how many runs met the added-latency bound, and which runs
    were disturbed (their direct baseline's own p99 over ``DISTURBED_DIRECT_P99_MS``).  A
    disturbed run is counted like any other: the summary says so, it does not drop it."""
    bound = 1.0
    added = [line["added_latency_p99_ms"] for line in lines]
    direct = [(line["direct_latency_p50_p99_ms"] or [None, None])[1] for line in lines]
    met = [value is not None and value <= bound for value in added]
    disturbed = [i + 1 for i, value in enumerate(direct) if value is not None and value > DISTURBED_DIRECT_P99_MS]
    missed = [i + 1 for i, ok in enumerate(met) if not ok]
    ratios = [line["throughput_ratio_vs_direct"] for line in lines]
    return {
        "bench": "fanin",
        "summary": "every run",
        "runs": len(lines),
        "runs_met": sum(met),
        # The worst run's figures, so the per-run targets hold for every run here too.
        "added_latency_p99_ms": max((v for v in added if v is not None), default=None),
        "throughput_ratio_vs_direct": min((v for v in ratios if v is not None), default=None),
        "added_latency_p99_ms_per_run": added,
        "direct_latency_p99_ms_per_run": direct,
        "paired_added_latency_p99_ms_per_run": [
            (line["paired_added_latency_p50_p99_ms"] or [None, None])[1] for line in lines
        ],
        "fanin_gc_max_ms_per_run": [line["fanin_gc"]["max_ms"] for line in lines],
        "load_avg_1m_per_run": [line["load_avg_1m"] for line in lines],
        "disturbed_runs": disturbed,
        "disturbed_rule": f"the direct arm's own p99 > {DISTURBED_DIRECT_P99_MS:g} ms "
        "(the host or its neighbours: no fan-in on that path)",
        "missed_runs": missed,
        "missed_runs_disturbed": [i for i in missed if i in disturbed],
    }


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run (fresh processes, sockets and ports): its JSON record."""
    host_stalls = host_stall_probe(args.host_probe_s) if args.host_probe_s > 0 else None
    spawn = mp.get_context("spawn")
    direct_base = free_port_block(args.ranks)
    control_base = free_port_block(args.ranks) if args.control else None
    instance = f"tcp://127.0.0.1:{free_port_block(1)}"
    internal = {
        "default": None,  # the plugin's choice: unixpkt in the private directory
        "ipc": f"ipc://{private_dir() / f'bench-fanin-{direct_base}.sock'}",
        "tcp": f"tcp://127.0.0.1:{free_port_block(1)}",
    }[args.channel]
    config = PluginConfig(
        endpoint=instance, bind=True, heartbeat_s=1.0, rank_send=args.rank_send, internal_channel=internal
    )
    channel = resolve_channel_endpoint(config)
    stop_fanin, fanin_ready, fanin_out = spawn.Event(), spawn.Event(), spawn.Queue()
    fanin = spawn.Process(target=fanin_proc, args=(config, args.ranks, channel, fanin_ready, stop_fanin, fanin_out))
    fanin.start()
    fanin_ready.wait(60)

    go = {phase: spawn.Event() for phase in (1, 2, 3)}
    phase_done = spawn.Queue()
    groups = [list(range(args.ranks))[i :: args.producers] for i in range(args.producers)]
    common = (args.rate, args.seconds, go, phase_done, args.producer_nice, args.nice_scope, control_base)
    producers = [
        spawn.Process(target=producer, args=(config, group, direct_base, channel, *common)) for group in groups if group
    ]
    for proc in producers:
        proc.start()
    named = {"fanin": fanin, **{f"producer{i}": p for i, p in enumerate(producers)}}
    watched = {name: proc.pid for name, proc in named.items() if proc.pid is not None}

    direct_streams = [f"tcp://127.0.0.1:{direct_base + r}" for r in range(args.ranks)]
    # The arm compared with the direct streams: the instance stream, or the A/A control's twin.
    arm = "control" if control_base is not None else "instance"
    compared = [f"tcp://127.0.0.1:{control_base + r}" for r in range(args.ranks)] if control_base else [instance]
    paired = {"subscriber": {"direct": direct_streams, arm: compared}}
    latency, cpu_shares, send_costs = _run_phase(1, paired, go, phase_done, producers, watched)
    separate = {"subscriber_direct": {"direct": direct_streams}, "subscriber_instance": {"instance": [instance]}}
    throughput, _, _ = _run_phase(2, separate, go, phase_done, producers, watched)
    go[3].set()
    for proc in producers:
        proc.join(60)
    stop_fanin.set()
    fanin_stats = fanin_out.get(timeout=60)
    pauses: list[tuple[int, float, float]] = fanin_stats.pop("gc_pauses")
    fanin.join(30)

    direct_at = dict(latency["direct"])
    paired_added = [(t - direct_at[k]) * 1000 for k, t in latency[arm] if k in direct_at]
    # Each arm's own latency from the batch's publish-time stamp (same clock).
    arm_lat = [(t - k[1]) * 1000 for k, t in latency[arm]]
    direct_lat = [(t - k[1]) * 1000 for k, t in latency["direct"]]

    def rate_of(arrivals: list[Arrival]) -> float:
        if len(arrivals) < 2:
            return 0.0
        return len(arrivals) / (arrivals[-1][1] - arrivals[0][1])

    def pcts(values: list[float]) -> list[float] | None:
        return [round(percentile(values, q), 4) for q in (0.5, 0.99)] if values else None

    def added_at(q: float) -> float | None:
        if not arm_lat or not direct_lat:
            return None
        return round(percentile(arm_lat, q) - percentile(direct_lat, q), 4)

    sustained = rate_of(throughput["instance"])
    direct_rate = rate_of(throughput["direct"])
    line = {
        "bench": "fanin",
        "ranks": args.ranks,
        "added_latency_p50_ms": added_at(0.50),
        "added_latency_p99_ms": added_at(0.99),
        "sustained_batches_per_s": round(sustained, 1),
        "direct_batches_per_s": round(direct_rate, 1),
        "throughput_ratio_vs_direct": round(sustained / direct_rate, 3) if direct_rate else None,
        "latency_method": "publish-to-receipt percentile of the instance stream minus that of the direct streams; "
        "one subscriber process reads both",
        "control": args.control,
        "latency_phase_batches": len(latency[arm]),
        "latency_phase_direct_batches": len(direct_at),
        "latency_phase_offered": args.ranks * args.rate * args.seconds,
        "added_latency_p999_ms": added_at(0.999),
        f"{arm}_latency_p50_p99_ms": pcts(arm_lat),
        "direct_latency_p50_p99_ms": pcts(direct_lat),
        # Per batch: its arrival on the compared arm minus its arrival on the direct arm.
        "paired_added_latency_p50_p99_ms": pcts(paired_added),
        "paired_added_latency_p999_ms": round(percentile(paired_added, 0.999), 4) if paired_added else None,
        "paired_added_latency_mean_ms": round(statistics.fmean(paired_added), 4) if paired_added else None,
        "latency_phase_cpu_share": cpu_shares,
        # CPU in the publishing thread per batch: SGLang's direct path (encode + send on the
        # rank's PUB) vs RankPublisher.publish (rank_send inline: enrich + encode + send).
        "publish_cpu_us_p50_p99": {
            arm: [round(percentile(values, q) / 1e3, 2) for q in (0.5, 0.99)] for arm, values in send_costs.items()
        },
        "throughput_phase_batches": {"instance": len(throughput["instance"]), "direct": len(throughput["direct"])},
        "throughput_phase_end_lag_ms": round((throughput["instance"][-1][1] - throughput["direct"][-1][1]) * 1000, 1)
        if throughput["instance"] and throughput["direct"]
        else None,
        "channel": channel.split(":", 1)[0],
        "rank_send": args.rank_send,
        "producer_nice": args.producer_nice,
        "nice_scope": args.nice_scope,
        "fanin_gaps": sum(r["gaps"] for r in fanin_stats["ranks"].values()),
        "host_stalls": {"probe_s": args.host_probe_s, "per_cpu": host_stalls} if host_stalls else None,
        "fanin_gc": {
            "collections": len(pauses),
            "gen2": sum(gen == 2 for gen, _, _ in pauses),
            "over_0_5ms": sum(ms > 0.5 for _, ms, _ in pauses),
            "max_ms": round(max((ms for _, ms, _ in pauses), default=0.0), 3),
            "max_ms_by_generation": {
                str(gen): round(max(ms for g, ms, _ in pauses if g == gen), 3)
                for gen in sorted({g for g, _, _ in pauses})
            },
            "cpu_over_0_5ms": sum(cpu > 0.5 for _, _, cpu in pauses),
            "cpu_max_ms": round(max((cpu for _, _, cpu in pauses), default=0.0), 3),
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    return line


def _with_targets(record: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench._common import with_targets

    return with_targets(record)


if __name__ == "__main__":
    sys.exit(main())
