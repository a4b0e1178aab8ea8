"""The REAL SGLang 0.5.23 publisher end to end: ``sglang-kvpub tail`` and the ``fanin`` sidecar.

SGLang's own ``ZmqEventPublisher`` (made by its ``EventPublisherFactory``, in a child
process, see :mod:`interop_sglang_ranks`) publishes SGLang's own ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` structs.  ``tail --json`` (a subprocess) must print
them in the documented shape, and replay them from SGLang's real replay ROUTER; the
sidecar (a subprocess) must turn SGLang's per-rank streams on base+rank into one instance
stream, filling gaps from each rank's real replay ROUTER.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sglang_real
import zmq
from conftest import free_port_block, free_tcp_endpoint
from interop_sglang_ranks import RealRanks, event_dict, sglang_config
from kvpub_procs import BLOCK_SIZE, batch_events

from fanin.test_fanin import Sub, check_rank_batch, wait_for_heartbeat
from sglang_kvpub import wire

pytestmark = [pytest.mark.integration, sglang_real.requires_sglang_kv_events]

TOPIC = "kv"
DEADLINE_S = 30.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_kvpub.cli", *args]


def _stop(proc: subprocess.Popen[Any], sig: int = signal.SIGINT) -> int:
    """Signals ``proc`` and reaps it; kills it if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


# --------------------------------------------------------------------------- tail


def _tail_scenario() -> list[dict[str, Any]]:
    """Batches covering every documented field, in SGLang's own event classes' terms."""
    return [
        {
            "ts": 1000.5,
            "events": [
                {  # a merged two-block store, engine left medium unset
                    "type": "BlockStored",
                    "block_hashes": [111, -222],
                    "parent_block_hash": None,
                    "token_ids": list(range(8)),
                    "block_size": 4,
                    "lora_id": None,
                },
                {
                    "type": "BlockStored",
                    "block_hashes": [333],
                    "parent_block_hash": -222,
                    "token_ids": [8, 9, 10, 11],
                    "block_size": 4,
                    "lora_id": 7,
                    "medium": "CPU_PINNED",
                    "lora_name": "adapter-a",
                },
            ],
        },
        {"ts": 1001.0, "events": [{"type": "BlockRemoved", "block_hashes": [333], "medium": "CPU_PINNED"}]},
        {"ts": 1002.25, "events": [{"type": "BlockRemoved", "block_hashes": [-222]}, {"type": "AllBlocksCleared"}]},
    ]


def _documented_json(seq: int, dp_rank: int, batch: dict[str, Any]) -> dict[str, Any]:
    """What ``sglang-kvpub tail --json`` prints for this batch."""
    events: list[dict[str, Any]] = []
    for event in batch["events"]:
        if event["type"] == "BlockStored":
            keys = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
            out = {"type": "BlockStored", **{k: event[k] for k in keys}}
            out.update(medium=event.get("medium"), lora_name=event.get("lora_name"))
        elif event["type"] == "BlockRemoved":
            out = {"type": "BlockRemoved", "block_hashes": event["block_hashes"], "medium": event.get("medium")}
        else:
            out = {"type": "AllBlocksCleared"}
        events.append(out)
    return {"seq": seq, "ts": batch["ts"], "dp_rank": dp_rank, "events": events}


def _matches_doc(line: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every documented key present with the expected value (extra keys are allowed)."""
    for key in ("seq", "ts", "dp_rank"):
        assert line[key] == expected[key], key
    assert len(line["events"]) == len(expected["events"])
    for got, want in zip(line["events"], expected["events"], strict=True):
        assert {k: got[k] for k in want} == want


class LineReader:
    """Non-blocking line reader over a child's stdout."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        self.lines: list[dict[str, Any]] = []

    def pump(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 1 << 16):
                self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        self.lines.extend(json.loads(line) for line in complete if line.strip())


@pytest.mark.timeout(90)
def test_tail_prints_and_replays_a_real_sglang_publisher() -> None:
    rank = 1  # SGLang offsets both ports by the publisher's rank
    base = free_port_block(4)
    endpoint, replay = f"tcp://127.0.0.1:{base + rank}", f"tcp://127.0.0.1:{base + 2 + rank}"
    ranks = RealRanks(sglang_config(f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}", TOPIC), [rank])
    try:
        assert ranks.types == ["ZmqEventPublisher"]
        tail = subprocess.Popen(_cli("tail", endpoint, "--topic", TOPIC, "--json"), stdout=subprocess.PIPE)
        try:
            reader = LineReader(tail)
            deadline = time.monotonic() + DEADLINE_S
            while not reader.lines:  # slow joiner: SGLang heartbeats until tail prints one
                assert time.monotonic() < deadline, "tail never received SGLang's stream"
                ranks.publish(rank, [{"ts": time.time(), "events": []}])
                time.sleep(0.05)  # pacing the probe, not synchronisation
                reader.pump()
            scenario = _tail_scenario()
            seqs = ranks.publish(rank, scenario)
            while not any(line["seq"] == seqs[-1] for line in reader.lines):
                assert time.monotonic() < deadline, f"tail printed {reader.lines!r}"
                reader.pump()
                time.sleep(0.02)
        finally:
            assert _stop(tail) == 0  # Ctrl-C exits 0
        printed = {line["seq"]: line for line in reader.lines}
        for seq, batch in zip(seqs, scenario, strict=True):
            _matches_doc(printed[seq], _documented_json(seq, rank, batch))
        live_seqs = [line["seq"] for line in reader.lines]
        assert live_seqs == list(range(live_seqs[0], live_seqs[-1] + 1))  # SGLang's seq, no gap

        # Replay from a seq in the middle: exactly the batches with seq >= N, from SGLang's ROUTER.
        from_seq = seqs[1]
        result = subprocess.run(
            _cli(
                *("tail", endpoint, "--topic", TOPIC, "--replay-endpoint", replay),
                *("--from-seq", str(from_seq), "--json", "--idle-exit", "0.5"),
            ),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        replayed = [json.loads(line) for line in result.stdout.splitlines()]
        assert [line["seq"] for line in replayed] == list(range(from_seq, seqs[-1] + 1))
        for line, batch in zip(replayed, scenario[1:], strict=True):
            _matches_doc(line, _documented_json(line["seq"], rank, batch))
    finally:
        ranks.close()


# --------------------------------------------------------------------------- sidecar


def _sglang_batch(rank: int, index: int) -> dict[str, Any]:
    """kvpub_procs' deterministic batch ``index`` of ``rank`` as SGLang would publish it."""
    return {"ts": time.time(), "events": [event_dict(e, BLOCK_SIZE) for e in batch_events(rank, index)]}


def _indices(sub: Sub, rank: int) -> list[int]:
    """Which kvpub_procs batch each of the rank's instance batches is (by its first stored hash)."""
    out = []
    for batch in sub.rank_batches(rank):
        first = batch.events[0]
        assert isinstance(first, wire.BlockStored)
        out.append((first.block_hashes[0] & 0xFFFFFFFF) - 1)
    return out


@pytest.mark.timeout(120)
def test_sidecar_over_real_sglang_rank_publishers(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    dp_size, early = 4, 3
    ports = free_port_block(2 * dp_size)
    base, replay_base = ports, ports + dp_size  # replay base >= base + N: no collision
    ranks = RealRanks(
        sglang_config(f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{replay_base}", TOPIC), list(range(dp_size))
    )
    sidecar: subprocess.Popen[bytes] | None = None
    log_path = tmp_path / "sidecar.log"
    try:
        assert ranks.types == ["ZmqEventPublisher"]
        next_index = [0] * dp_size
        for rank in range(dp_size):  # published before the sidecar exists: only replay can deliver them
            ranks.publish(rank, [_sglang_batch(rank, i) for i in range(early)])
            next_index[rank] = early
        endpoint, instance_replay = free_tcp_endpoint(), free_tcp_endpoint()
        with log_path.open("wb") as log:
            sidecar = subprocess.Popen(
                _cli(
                    *("fanin", "--rank-base", f"tcp://127.0.0.1:{base}", "--dp-size", str(dp_size)),
                    *("--rank-replay-base", f"tcp://127.0.0.1:{replay_base}"),
                    *("--endpoint", endpoint.replace("127.0.0.1", "*"), "--replay-endpoint", instance_replay),
                    *("--topic", TOPIC, "--heartbeat-s", "0.2", "--status-interval", "0"),
                ),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        sub = Sub(ctx, endpoint, TOPIC.encode())
        wait_for_heartbeat(sub)  # our SUB is live before any rank batch reaches the sidecar

        def seen(rank: int) -> bool:
            if _indices(sub, rank):
                return True
            ranks.publish(rank, [_sglang_batch(rank, next_index[rank])])  # slow joiner: publish live until seen
            next_index[rank] += 1
            return False

        for rank in range(dp_size):
            sub.pump_until(lambda rank=rank: seen(rank), timeout_s=DEADLINE_S)  # type: ignore[misc]
        for rank in range(dp_size):  # more live traffic, interleaved across ranks
            ranks.publish(rank, [_sglang_batch(rank, next_index[rank] + i) for i in range(5)])
            next_index[rank] += 5
        sub.pump_until(lambda: all(max(_indices(sub, r), default=-1) == next_index[r] - 1 for r in range(dp_size)))

        for rank in range(dp_size):
            assert _indices(sub, rank) == list(range(next_index[rank])), f"rank {rank}"  # each once, in order
            for index, batch in enumerate(sub.rank_batches(rank)):
                check_rank_batch(batch, rank, index)  # dp_rank right, medium GPU where SGLang left None
        seqs = [seq for seq, _, _ in sub.msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one contiguous instance seq
        assert len({wire.seq_epoch(s) for s in seqs}) == 1
    finally:
        returncode = _stop(sidecar, signal.SIGTERM) if sidecar is not None else 0
        ranks.close()
    log_text = log_path.read_text()
    assert returncode == 0, log_text[-3000:]
    final = [line for line in log_text.splitlines() if "(stopped)" in line][-1]
    replayed = int(final.split(" replayed ")[1].split()[0])
    assert replayed >= dp_size * early, final  # the early batches came from SGLang's replay ROUTERs
    assert "malformed 0" in final and "restarts 0" in final
