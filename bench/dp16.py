"""The report's dp 16 in one real CPU server: start time, memory per rank, and what the stream shows.

``sglang.launch_server --dp-size 16 --plugin sglang_kvpub --sleep-on-idle`` (the tiny
dummy-weight model of bench/sglang_server.py, one OpenMP core group per rank), with
``motor-kv-adapter serve`` registered for its instance stream as Motor registers it.
Measured: seconds to ready, RSS summed over the server's processes and per scheduler (one
per rank); one request pinned to each rank, then the ranks the ONE instance stream
carried; a long prompt sent once and repeated three times (each repeat after the ranks'
idle flush): the repeats on the first request's rank with every full page cached; a
flush, then seconds until the adapter's index is empty; a ``kill -9`` of the server,
then seconds until the adapter reports the instance dead.  The assertions of the same
sequence are ``tests/server/test_server_dp16.py`` (slow).  ~13 GB: run it alone on the host.

    python bench/dp16.py [--dp-size 16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import sglang_server  # noqa: E402 (bench/sglang_server.py)

from bench._common import emit, with_targets  # noqa: E402
from sglang_kvpub import wire  # noqa: E402
from sglang_kvpub.tools.ports import free_port  # noqa: E402

PAGE = 16
MODEL = "tiny-llama"
INSTANCE = "sglang-cpu-dp16"
LONG = 600


class _Stream:
    """The instance stream as a plain SUB sees it: the ranks of its batches with events."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.ranks: set[int] = set()
        self.heartbeats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = wire.BatchDecoder()
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            with contextlib.suppress(wire.WireError):
                _, _, payload = wire.parse_live_frames(self._sub.recv_multipart())
                batch = decoder.decode(payload)
                if batch.events and batch.dp_rank is not None:
                    self.ranks.add(batch.dp_rank)
                elif not batch.events:
                    self.heartbeats += 1

    def quiet(self, timeout_s: float = 60.0) -> None:
        """Two heartbeats from now: every rank's flush has passed the fan-in."""
        start, deadline = self.heartbeats, time.monotonic() + timeout_s
        while self.heartbeats < start + 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()


def _call(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _until(check: Any, timeout_s: float) -> float | None:
    """Seconds until ``check()`` is true, None past the timeout (polling with a deadline)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return round(time.monotonic() - start, 2)
        time.sleep(0.05)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp-size", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    dp = args.dp_size
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpub-dp16-"))
    model = sglang_server.make_model_dir(workdir / "model")
    spec = sglang_server.ServerSpec(
        model_path=model,
        log_path=workdir / "server.log",
        shim_dir=sglang_server.cpu_shim_dir(),
        dp_size=dp,
        page_size=PAGE,
        kv_events_extra={"heartbeat_s": 0.2},
        extra_args=("--sleep-on-idle", "--mem-fraction-static", "0.5"),
    )
    server = sglang_server.Server(spec)
    port = free_port()
    adapter_log = open(workdir / "adapter.log", "wb")  # noqa: SIM115 (closed below)
    adapter = subprocess.Popen(
        [sys.executable, "-m", "motor_adapter.cli", "serve", "--registry", "memory", "--port", str(port)],
        stdout=adapter_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    record: dict[str, Any] = {"bench": "dp16", "dp_size": dp}
    stream = None
    try:
        server.start(timeout_s=1800.0)
        record["start_s"] = round(server.started_s, 1)
        procs = sglang_server.process_memory(server.proc.pid) if server.proc else []
        ranks_rss = sorted(rss for _, title, rss in procs if title.startswith("sglang::scheduler"))
        record["rss_total_gib"] = round(sum(rss for _, _, rss in procs) / 2**30, 2)
        record["schedulers"] = len(ranks_rss)
        record["rss_per_rank_mib_min_median_max"] = (
            [round(ranks_rss[i] / 2**20) for i in (0, len(ranks_rss) // 2, -1)] if ranks_rss else None
        )
        record["fanned_in"] = server.server_info()["kv_events"].get("fanned_in")
        stream = _Stream(spec.stream_endpoint)
        _until(lambda: _health(base), 60)
        _call(
            base + "/register",
            {
                "instance_id": INSTANCE,
                "medium_endpoints": {"npu": spec.stream_endpoint},
                "replay_endpoint": f"tcp://127.0.0.1:{spec.replay_port}",
                "type": "sglang",
                "modelname": MODEL,
                "block_size": PAGE,
                "fanned_in": True,
                "dp_size": dp,
            },
        )
        for rank in range(dp):
            server.generate(sglang_server.prompt_ids(300 + rank, 5 * PAGE + 3), dp_rank=rank)
        stream.quiet()
        record["ranks_in_stream"] = len(stream.ranks)
        ids = sglang_server.prompt_ids(17, LONG)
        first = server.generate(ids)["meta_info"]
        same = cached = 0
        for _ in range(3):
            stream.quiet()
            again = server.generate(ids)["meta_info"]
            same += again["dp_rank"] == first["dp_rank"]
            cached += again["cached_tokens"] == (LONG // PAGE) * PAGE
        record["repeats_on_holding_rank"] = f"{same}/3"
        record["repeats_cached"] = f"{cached}/3"
        lines = [line for line in server.log_text().splitlines() if "dp_dispatch" in line and "cache_hit" in line]
        record["dispatch_log_line"] = lines[-1].strip() if lines else None
        query = {"model": MODEL, "block_size": PAGE, "token_ids": ids}

        def matched() -> int:
            answer = _call(base + "/query", query).get("default", {}).get(INSTANCE, {})
            return int(answer.get("longest_matched", 0))

        record["adapter_hit_s"] = _until(lambda: matched() > 0, 60)
        server.flush_cache()
        record["flush_to_empty_index_s"] = _until(lambda: matched() == 0, 60)
        server.generate(ids)
        _until(lambda: matched() > 0, 60)
        server.kill9()
        record["kill9_to_dead_s"] = _until(lambda: _dead(base), 120)
    finally:
        if stream is not None:
            stream.close()
        server.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(adapter.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            adapter.wait(15)
        adapter_log.close()
    record["workdir"] = str(workdir)
    emit(with_targets(record))
    return 0


def _health(base: str) -> bool:
    with contextlib.suppress(OSError):
        urllib.request.urlopen(base + "/health", timeout=2).read()
        return True
    return False


def _dead(base: str) -> bool:
    workers = _call(base + "/workers")["workers"]
    healths = [h for w in workers for hs in w["health"].values() for h in hs]
    return bool(healths) and not any(h["connected"] for h in healths)


if __name__ == "__main__":
    sys.exit(main())
