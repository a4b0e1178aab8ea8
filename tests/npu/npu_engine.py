"""A real ``sglang.launch_server`` with ``--plugin sglang_kvpub``, its instance stream and HTTP API.

Used by tests/npu/test_npu_e2e.py and scripts/npu-smoke.sh (``python tests/npu/npu_engine.py``).
Standard library + pyzmq only: it must run inside a CANN container as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from sglang_kvpub import wire

PAGE_SIZE = 128
TOPIC = "kv"


@dataclasses.dataclass
class EngineSpec:
    device: str  # "npu" or "cuda"
    model_path: str
    http_port: int
    kv_port: int
    replay_port: int
    dp_size: int = 2
    page_size: int = PAGE_SIZE
    max_total_tokens: int | None = None  # small values force eviction
    extra_args: Sequence[str] = ()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def stream_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def kv_events_config(self) -> str:
        return json.dumps(
            {
                "publisher": "zmq",
                "endpoint": self.stream_endpoint,
                "bind": True,
                "replay_endpoint": self.replay_endpoint,
                "topic": TOPIC,
            }
        )

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--device",
            self.device,
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http_port),
            "--tp-size",
            str(self.dp_size),
            "--dp-size",
            str(self.dp_size),
            "--enable-dp-attention",
            "--page-size",
            str(self.page_size),
            "--kv-events-config",
            self.kv_events_config(),
            "--plugin",
            "sglang_kvpub",
        ]
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        return cmd + list(self.extra_args)


class StreamRecorder:
    """Subscribes to the instance stream in a thread; keeps every ``(seq, EventBatch)``."""

    def __init__(self, endpoint: str, topic: str = TOPIC) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._decoder = wire.BatchDecoder()
        self._loads_codec = wire.LoadReportCodec()
        self._lock = threading.Lock()
        self._batches: list[tuple[int, wire.EventBatch]] = []
        self.load_reports: list[wire.LoadReport] = []  # the rank-load messages (docs/wire.md)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpub-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            try:
                _, seq, payload = wire.parse_live_frames(self._sub.recv_multipart())
                batch = self._decoder.decode(payload)
                report = None if batch.events else self._loads_codec.decode(payload)
                if report is not None:
                    with self._lock:
                        self.load_reports.append(report)
            except wire.WireError:
                self.errors += 1
                continue
            with self._lock:
                self._batches.append((seq, batch))

    def snapshot(self) -> list[tuple[int, wire.EventBatch]]:
        with self._lock:
            return list(self._batches)

    def last_seq(self) -> int:
        batches = self.snapshot()
        return batches[-1][0] if batches else -1

    def wait_for(self, check: Callable[[list[tuple[int, wire.EventBatch]]], Any], timeout: float) -> Any:
        """Re-runs ``check`` on the recorded stream until it stops raising AssertionError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return check(self.snapshot())
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)  # polling a condition with a deadline, not synchronising on time

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()


class Engine:
    """The server process: start, wait for /health, HTTP calls, stop (whole process group)."""

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, SGLANG_KVPUB_ENABLED="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            spec.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.spec.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)  # server start-up takes minutes; poll /health once a second
        raise TimeoutError(f"/health not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.spec.base_url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], dp_rank: int | None = None, max_new_tokens: int = 4) -> Any:
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        }
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        return self.post("/generate", body)

    def flush_cache(self) -> Any:
        return self.post("/flush_cache")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def prompt_ids(seed: int, pages: int, page_size: int = PAGE_SIZE) -> list[int]:
    """Token ids known to every vocabulary (100..30099): no tokenizer needed, exact on both sides."""
    return [100 + (seed * 7919 + i * 31) % 30_000 for i in range(pages * page_size)]


# --------------------------------------------------------------------------- the scenario


@dataclasses.dataclass
class ScenarioResult:
    """What the tests assert on (through tests/e2e_checks.py)."""

    spec: EngineSpec
    startup_s: float = 0.0
    long_prompt: list[int] = dataclasses.field(default_factory=list)
    pinned: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    cold_decision: dict[str, Any] = dataclasses.field(default_factory=dict)
    hot_decision: dict[str, Any] = dataclasses.field(default_factory=dict)
    before_pressure_seq: int = -1
    before_flush_seq: int = -1
    stream: list[tuple[int, wire.EventBatch]] = dataclasses.field(default_factory=list)
    decode_errors: int = 0


def _settle(recorder: StreamRecorder, check: Callable[[Any], Any], timeout: float) -> None:
    """Waits for ``check`` to hold; on timeout returns anyway: the test's own check then fails
    with the precise reason."""
    with contextlib.suppress(AssertionError):
        recorder.wait_for(check, timeout)


def _decision_dict(decision: Any) -> dict[str, Any]:
    return {k: getattr(decision, k, None) for k in ("policy", "matched", "hbm", "cpu", "dp_rank", "reason")}


def run_scenario(spec: EngineSpec, log_dir: Path, start_timeout: float = 1200, settle_s: float = 60) -> ScenarioResult:
    import e2e_checks as checks

    from motor_adapter.affinity import KvAffinity
    from motor_adapter.scoring import Candidate, KvAffinityConfig

    result = ScenarioResult(spec=spec)
    ranks = list(range(spec.dp_size))
    recorder = StreamRecorder(spec.stream_endpoint)
    engine = Engine(spec, log_dir / f"sglang-{spec.device}.log")
    adapter = KvAffinity(KvAffinityConfig(block_size=spec.page_size))
    try:
        result.startup_s = engine.wait_healthy(start_timeout)
        adapter.add_instance("prefill-0", spec.stream_endpoint, spec.replay_endpoint, topic=TOPIC.encode())
        candidates = [Candidate(instance_id="prefill-0", load=0.0)]

        result.long_prompt = prompt_ids(1, 8, spec.page_size)
        result.cold_decision = _decision_dict(adapter.select(candidates, result.long_prompt))
        engine.generate(result.long_prompt)
        engine.generate(result.long_prompt)
        for rank in ranks:
            result.pinned[rank] = prompt_ids(10 + rank, 2, spec.page_size)
            engine.generate(result.pinned[rank], dp_rank=rank)

        def stored_everywhere(stream: Any) -> None:
            checks.check_ranks_in_one_stream(stream, ranks)
            checks.check_stored_blocks(stream, block_size=spec.page_size, ranks=ranks)
            for rank, ids in result.pinned.items():
                checks.check_prompt_on_rank(stream, ids, rank, spec.page_size)

        _settle(recorder, stored_everywhere, settle_s)

        deadline = time.monotonic() + settle_s
        while True:  # the adapter's index follows the stream asynchronously
            decision = adapter.select(candidates, result.long_prompt)
            if decision.policy == checks.POLICY_AFFINITY or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        result.hot_decision = _decision_dict(decision)

        if spec.max_total_tokens:
            result.before_pressure_seq = recorder.last_seq()
            pages = 8
            rounds = 2 * spec.max_total_tokens // (pages * spec.page_size) + 1
            for n in range(rounds):
                engine.generate(prompt_ids(100 + n, pages, spec.page_size), dp_rank=0)

        result.before_flush_seq = recorder.last_seq()
        engine.flush_cache()
        flushed = result.before_flush_seq
        _settle(recorder, lambda s: checks.check_released_after(s, flushed, ranks), settle_s)
    finally:
        result.stream = recorder.snapshot()
        result.decode_errors = recorder.errors
        adapter.close()
        engine.stop()
        recorder.close()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/npu/npu_engine.py --device npu``: run the scenario, print PASS/FAIL + figures."""
    import argparse
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for e2e_checks
    import e2e_checks as checks
    from conftest import free_tcp_port  # tests/conftest.py

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="npu", choices=["npu", "cuda"])
    parser.add_argument("--model-path", default=os.environ.get("KVPUB_TEST_MODEL", ""))
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--log-dir", default=None)
    args, extra = parser.parse_known_args(argv)
    if not args.model_path:
        print("FAIL: no model: pass --model-path or set KVPUB_TEST_MODEL")
        return 2
    spec = EngineSpec(
        device=args.device,
        model_path=args.model_path,
        http_port=free_tcp_port(),
        kv_port=free_tcp_port(),
        replay_port=free_tcp_port(),
        max_total_tokens=args.max_total_tokens,
        extra_args=extra,
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvpub-smoke-"))
    result = run_scenario(spec, log_dir)
    ranks = list(range(spec.dp_size))
    stream = result.stream
    figures: dict[str, Any] = {"startup_s": round(result.startup_s, 1), "batches": len(stream)}
    verdicts: list[tuple[str, str]] = []

    def verdict(name: str, fn: Callable[[], Any]) -> None:
        try:
            figures[name] = fn()
            verdicts.append((name, "PASS"))
        except AssertionError as exc:
            verdicts.append((name, f"FAIL: {exc}"))

    verdict("batches_per_rank", lambda: checks.check_ranks_in_one_stream(stream, ranks))
    verdict("gpu_blocks_stored", lambda: checks.check_stored_blocks(stream, block_size=spec.page_size, ranks=ranks))
    for rank, ids in result.pinned.items():
        verdict(
            f"pinned_rank{rank}_blocks",
            functools.partial(checks.check_prompt_on_rank, stream, ids, rank, spec.page_size),
        )
    verdict("cold_decision", lambda: checks.check_cold_decision(result.cold_decision))
    holders = [r for r in ranks if _holds(stream, result.long_prompt, r, spec.page_size)]
    verdict("hot_decision", lambda: checks.check_affinity_decision(result.hot_decision, holders))
    if spec.max_total_tokens:
        verdict("evicted_rank0", lambda: _evicted(stream, result.before_pressure_seq, result.before_flush_seq))
    verdict("released_after_flush", lambda: checks.check_released_after(stream, result.before_flush_seq, ranks))
    for name, outcome in verdicts:
        print(f"{name:24s} {outcome}")
    print(json.dumps({"figures": figures, "decode_errors": result.decode_errors, "log_dir": str(log_dir)}, default=str))
    failed = [n for n, o in verdicts if o != "PASS"]
    print("FAIL: " + ", ".join(failed) if failed else "PASS")
    return 1 if failed else 0


def _holds(stream: Any, ids: Sequence[int], rank: int, page_size: int) -> bool:
    import e2e_checks as checks

    try:
        checks.check_prompt_on_rank(stream, ids, rank, page_size)
    except AssertionError:
        return False
    return True


def _evicted(stream: Sequence[tuple[int, wire.EventBatch]], after: int, before: int) -> int:
    """GPU blocks rank 0 removed between ``after`` and ``before`` (eviction pressure, no flush)."""
    removed = sum(
        len(e.block_hashes)
        for seq, b in stream
        if after < seq <= before and b.dp_rank == 0
        for e in b.events
        if isinstance(e, wire.BlockRemoved) and e.medium in (wire.MEDIUM_GPU, None)
    )
    if removed == 0:
        raise AssertionError(
            f"no BlockRemoved(medium=GPU) from dp_rank 0 under eviction pressure (seq {after}..{before})"
        )
    return removed


if __name__ == "__main__":
    sys.exit(main())
