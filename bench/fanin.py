"""Fan-in cost: added latency and throughput of the instance stream vs direct per-rank streams.

Producer processes host the ranks (16 by default).  Every batch is published twice, in the
same call: directly on the rank's own PUB (what SGLang does today, base+rank) and through
a :class:`RankPublisher` to the fan-in process.  One subscriber process reads the 16
direct streams, another the instance stream; both stamp each batch on arrival.

* latency phase: ``rate`` batches/s per rank x 4 events for ``seconds``; added latency
  is, per batch, instance arrival minus direct arrival (p50/p99 over all batches);
* throughput phase: producers publish as fast as they can; each subscriber's rate is
  batches received / span of its arrivals; ratio = instance / direct.

Prints ONE JSON line.  Run: ``python bench/fanin.py [--ranks 16 --rate 500 --seconds 5]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import msgspec
import zmq

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig

PAGE = 128


def free_port_block(count: int) -> int:
    import socket

    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free ports")


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
    go: Any, phase_done: Any,
) -> None:  # fmt: skip
    from sglang_kvpub.rank_publisher import RankPublisher

    ctx: zmq.Context[Any] = zmq.Context()
    pubs = {}
    for rank in ranks:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(f"tcp://127.0.0.1:{direct_base + rank}")
        pubs[rank] = pub
    publishers = {rank: RankPublisher(config, rank, PAGE, channel, context=ctx) for rank in ranks}
    encoder = msgspec.msgpack.Encoder()
    for phase, paced in ((1, True), (2, False)):
        go[phase].wait(60)
        start = time.monotonic()
        index = 0
        while time.monotonic() - start < seconds:
            for rank in ranks:
                batch = make_batch(rank, phase, index)
                direct = wire.EventBatch(ts=batch.ts, events=batch.events, dp_rank=rank)
                pubs[rank].send_multipart([b"", wire.encode_seq(index), encoder.encode(direct)])
                publishers[rank].publish(make_batch_copy(batch))  # same ts: pairs the two arrivals
            index += 1
            if paced:
                delay = start + index / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        phase_done.put((phase, ranks[0], index))
    for publisher in publishers.values():
        publisher.shutdown()
    go[3].wait(60)
    ctx.destroy(linger=0)


def make_batch_copy(batch: wire.EventBatch) -> wire.EventBatch:
    # The rank publisher enriches in place; the direct path already encoded its copy.
    return wire.EventBatch(ts=batch.ts, events=[msgspec.structs.replace(e) for e in batch.events])


class _Head(msgspec.Struct, array_like=True):
    """Just what identifies a batch: (dp_rank, ts); the events stay undecoded."""

    ts: float
    events: msgspec.Raw
    dp_rank: int | None = None


def subscriber(endpoints: list[str], ready: Any, stop: Any, out: Any) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(_Head)
    arrivals: list[tuple[tuple[int, float], float]] = []
    ready.set()
    while not stop.is_set():
        if not sub.poll(100):
            continue
        while True:
            try:
                frames = sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            now = time.time()
            head = decoder.decode(frames[2])
            if head.dp_rank is not None and len(head.events) > 1:  # not a heartbeat
                arrivals.append(((head.dp_rank, head.ts), now))
    out.put(arrivals)
    ctx.destroy(linger=0)


def fanin_proc(config: PluginConfig, dp_size: int, channel: str, ready: Any, stop: Any, out: Any) -> None:
    from sglang_kvpub.fanin import FanIn

    fanin = FanIn(config, dp_size, channel_endpoint=channel)
    fanin.start()
    ready.set()
    stop.wait(600)
    out.put(fanin.stats())
    fanin.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rate", type=float, default=500.0, help="batches/s per rank in the latency phase")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--producers", type=int, default=4, help="processes hosting the ranks")
    args = parser.parse_args()

    spawn = mp.get_context("spawn")
    direct_base = free_port_block(args.ranks)
    instance_port = free_port_block(2)
    instance = f"tcp://127.0.0.1:{instance_port}"
    channel = f"tcp://127.0.0.1:{instance_port + 1}"
    config = PluginConfig(endpoint=instance, bind=True, internal_channel=channel, heartbeat_s=1.0)
    stop_fanin, fanin_ready, fanin_out = spawn.Event(), spawn.Event(), spawn.Queue()
    fanin = spawn.Process(target=fanin_proc, args=(config, args.ranks, channel, fanin_ready, stop_fanin, fanin_out))
    fanin.start()
    fanin_ready.wait(60)

    go = {phase: spawn.Event() for phase in (1, 2, 3)}
    phase_done = spawn.Queue()
    groups = [list(range(args.ranks))[i :: args.producers] for i in range(args.producers)]
    producers = [
        spawn.Process(
            target=producer, args=(config, group, direct_base, channel, args.rate, args.seconds, go, phase_done)
        )
        for group in groups
        if group
    ]
    for proc in producers:
        proc.start()

    results: dict[str, dict[int, list[tuple[tuple[int, float], float]]]] = {"direct": {}, "instance": {}}
    for phase in (1, 2):
        stops = {name: spawn.Event() for name in results}
        outs = {name: spawn.Queue() for name in results}
        endpoints = {
            "direct": [f"tcp://127.0.0.1:{direct_base + r}" for r in range(args.ranks)],
            "instance": [instance],
        }
        subs = []
        for name in results:
            ready = spawn.Event()
            proc = spawn.Process(target=subscriber, args=(endpoints[name], ready, stops[name], outs[name]))
            proc.start()
            ready.wait(60)
            subs.append(proc)
        time.sleep(1.0)  # let SUB connections settle (slow joiner) before traffic starts
        go[phase].set()
        for _ in producers:
            phase_done.get(timeout=600)
        time.sleep(2.0)  # drain in-flight batches
        for name in results:
            stops[name].set()
            results[name][phase] = outs[name].get(timeout=120)
        for proc in subs:
            proc.join(30)
    go[3].set()
    for proc in producers:
        proc.join(60)
    stop_fanin.set()
    fanin_stats = fanin_out.get(timeout=60)
    fanin.join(30)

    direct_at = dict(results["direct"][1])
    added = [(t - direct_at[k]) * 1000 for k, t in results["instance"][1] if k in direct_at]
    # Diagnostics: each arm's own latency from the batch's publish-time stamp (same clock).
    instance_lat = [(t - k[1]) * 1000 for k, t in results["instance"][1]]
    direct_lat = [(t - k[1]) * 1000 for k, t in results["direct"][1]]

    def rate_of(arrivals: list[tuple[tuple[int, float], float]]) -> float:
        if len(arrivals) < 2:
            return 0.0
        return len(arrivals) / (arrivals[-1][1] - arrivals[0][1])

    sustained = rate_of(results["instance"][2])
    direct_rate = rate_of(results["direct"][2])
    line = {
        "bench": "fanin",
        "ranks": args.ranks,
        "added_latency_p50_ms": round(percentile(added, 0.50), 4) if added else None,
        "added_latency_p99_ms": round(percentile(added, 0.99), 4) if added else None,
        "sustained_batches_per_s": round(sustained, 1),
        "direct_batches_per_s": round(direct_rate, 1),
        "throughput_ratio_vs_direct": round(sustained / direct_rate, 3) if direct_rate else None,
        "latency_phase_batches": len(results["instance"][1]),
        "latency_phase_direct_batches": len(direct_at),
        "latency_phase_offered": args.ranks * args.rate * args.seconds,
        "added_latency_mean_ms": round(statistics.fmean(added), 4) if added else None,
        "throughput_phase_batches": {"instance": len(results["instance"][2]), "direct": len(results["direct"][2])},
        "instance_latency_p50_p99_ms": [round(percentile(instance_lat, q), 4) for q in (0.5, 0.99)]
        if instance_lat
        else None,
        "direct_latency_p50_p99_ms": [round(percentile(direct_lat, q), 4) for q in (0.5, 0.99)] if direct_lat else None,
        "throughput_phase_end_lag_ms": round((results["instance"][2][-1][1] - results["direct"][2][-1][1]) * 1000, 1)
        if results["instance"][2] and results["direct"][2]
        else None,
        "fanin_gaps": sum(r["gaps"] for r in fanin_stats["ranks"].values()),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
