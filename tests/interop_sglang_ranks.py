"""REAL SGLang 0.5.23 per-rank publishers in a child process, driven over stdin/stdout.

The child builds one ``ZmqEventPublisher`` per rank through SGLang's own
``EventPublisherFactory.create(config_json, attn_dp_rank=rank)`` (so SGLang itself offsets
the PUB and replay ports by the rank), in the light strategy of :mod:`sglang_real`: a fresh
interpreter, so no plugin hook another test installed can stand in for SGLang's class.

Protocol (JSON lines): the child prints ``{"types": [...]}`` once ready; the parent sends
``{"op": "publish", "rank": r, "batches": [{"ts": float, "events": [event dict, ...]}]}``
and gets ``{"seqs": [...]}`` once SGLang's publisher thread has sent and buffered them;
``{"op": "stop"}`` shuts the publishers down.  Event dicts are SGLang's field names plus
``"type"`` (``msgspec.to_builtins`` of a :mod:`sglang_kvpub.wire` event gives one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec
import sglang_real

from sglang_kvpub import wire

_CHILD_MAIN = "import interop_sglang_ranks as _m\n_m.child_main()\n"


def event_dict(event: wire.Event, block_size: int | None = None) -> dict[str, Any]:
    """A wire event as SGLang constructor kwargs plus ``type``; ``block_size`` fills an unset one."""
    fields: dict[str, Any] = msgspec.to_builtins(event)
    if fields["type"] == "BlockStored" and block_size is not None and not fields["block_size"]:
        fields["block_size"] = block_size
    return fields


def sglang_config(endpoint: str, replay_endpoint: str | None, topic: str, **extra: Any) -> str:
    """A ``--kv-events-config`` for SGLang's real publisher, binding the concrete loopback host."""
    body: dict[str, Any] = {"publisher": "zmq", "endpoint": endpoint, "bind": True, "topic": topic, **extra}
    if replay_endpoint:
        body["replay_endpoint"] = replay_endpoint
    return json.dumps(body)


# --------------------------------------------------------------------------- child side


def _make_event(kv: Any, fields: dict[str, Any]) -> Any:
    values = dict(fields)
    cls = getattr(kv, values.pop("type"))
    return cls(**values)


def child_main() -> None:
    config_json, ranks_arg = sys.argv[1], sys.argv[2]
    kv = sglang_real.load_kv_events()
    pubs = {int(r): kv.EventPublisherFactory.create(config_json, attn_dp_rank=int(r)) for r in ranks_arg.split(",")}
    counts = dict.fromkeys(pubs, 0)
    print(json.dumps({"types": sorted({type(p).__name__ for p in pubs.values()})}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            break
        rank = command["rank"]
        pub = pubs[rank]
        seqs = []
        for batch in command["batches"]:
            events = [_make_event(kv, e) for e in batch["events"]]
            pub.publish(kv.KVEventBatch(ts=batch["ts"], events=events))
            seqs.append(counts[rank])  # SGLang numbers each publisher's batches 0, 1, 2, ...
            counts[rank] += 1
        # SGLang's publisher thread marks a batch done after sending and buffering it.
        pub._event_queue.join()
        print(json.dumps({"seqs": seqs}), flush=True)
    for pub in pubs.values():
        pub.shutdown()


# --------------------------------------------------------------------------- parent side


class RealRanks:
    """The child process; ``close()`` always reaps it."""

    def __init__(self, config_json: str, ranks: list[int]) -> None:
        code = sglang_real.sglang_bootstrap_code("light") + _CHILD_MAIN
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, config_json, ",".join(map(str, ranks))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            self.types: list[str] = self._read()["types"]
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            _, err = self.proc.communicate(timeout=10)
            raise RuntimeError(f"SGLang child exited ({self.proc.returncode}): {err[-2000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def publish(self, rank: int, batches: list[dict[str, Any]]) -> list[int]:
        """Publishes ``[{"ts", "events"}]`` on ``rank``; returns SGLang's seqs once sent."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "publish", "rank": rank, "batches": batches}) + "\n")
        self.proc.stdin.flush()
        seqs: list[int] = self._read()["seqs"]
        return seqs

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
