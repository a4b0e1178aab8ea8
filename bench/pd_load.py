"""The PD rig (bench/pd_rig.py) under load: what the plugin's PD mode costs the prefill
scheduler, and a soak.

``cost``: two rigs, one after the other, each under ``--clients`` concurrent requests through
Motor for ``--seconds`` (both prefills busy): ``cache_aware`` (the plugin's PD mode: SGLang's
``auto`` made ``round_robin``, each request's rank registered with the bootstrap server, off
the scheduler thread) and ``sglang_pd_default`` (``follow_bootstrap_room``: no registration).
One ``pd_cost`` line per rig: the schedulers' CPU time per request, the registration's part
on the scheduler thread (the plugin's enqueue) and the POST it replaced (what SGLang's own
synchronous registration would spend there), and the prefix hit (cached / prompt tokens,
from SGLang's ``#cached-token``); then one ``pd_cost_ratio`` line: the registration's share
of the scheduler's time under each, and the hit gain.

``soak``: one rig (``cache_aware``), a steady stream of requests through Motor, one at a time
so that each request's lines are its own, for ``--seconds`` (``slow``: 600 and more).  Every
request is checked: HTTP 200 with tokens, and the hit Motor was given equals SGLang's
``#cached-token``.  RSS of every process (Motor, the adapter, each server's processes) is
sampled; the bootstrap servers' room tables are probed with the rooms of requests the soak
sent itself (``/query_dp_ranks``): those older than SGLang's cleanup interval must be gone.
One ``pd_soak`` line.  ``tests/pd/test_pd_faults.py`` runs a short soak in CI on its rig.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import e2e_rig
import pd_rig
import sglang_server
from _common import emit

ROOM_CLEANUP_S = 30  # SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL on the soak's prefills
_STATS = re.compile(r"DP(\d+)[^\]]*\] sglang_kvpub: bootstrap registrations (\{.*\})")
_CLK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime, stime


def scheduler_cpu_s(server: sglang_server.Server) -> float:
    """CPU seconds of the server's scheduler processes (``sglang::scheduler...``)."""
    if server.proc is None:
        return 0.0
    total = 0.0
    for pid, title, _ in sglang_server.process_memory(server.proc.pid):
        if title.startswith("sglang::scheduler"):
            with contextlib.suppress(OSError):
                total += process_cpu_s(pid)
    return total


def registration_stats(text: str) -> dict[int, dict[str, Any]]:
    """The last ``bootstrap registrations`` line of each DP rank in a prefill's log."""
    found: dict[int, dict[str, Any]] = {}
    for rank, payload in _STATS.findall(text):
        found[int(rank)] = json.loads(payload)
    return found


def rss_by_part(rig: pd_rig.PdRig) -> dict[str, int]:
    """RSS bytes per process, keyed ``part/title/pid`` (Motor, the adapter, every server)."""
    parts: dict[str, int] = {}
    roots: list[tuple[str, int | None]] = [
        (f"prefill{n}", s.proc.pid if s.proc else None) for n, s in enumerate(rig.prefills)
    ]
    roots += [("decode", rig.decode.proc.pid if rig.decode.proc else None)]
    roots += [("adapter", rig.adapter_pid), ("motor", rig.coordinator.pid)]
    for part, pid in roots:
        if pid is None:
            continue
        for child, title, rss in sglang_server.process_memory(pid):
            if rss:
                parts[f"{part}/{title.rsplit('/', 1)[-1][:40]}/{child}"] = rss
    return parts


def query_rooms(host: str, port: int, rooms: Sequence[int]) -> dict[str, int]:
    """SGLang's bootstrap server's ``/query_dp_ranks``: the rooms it still holds."""
    request = urllib.request.Request(
        f"http://{host}:{port}/query_dp_ranks",
        data=json.dumps({"bootstrap_rooms": list(rooms)}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, int] = json.loads(response.read())
    return answer


# --------------------------------------------------------------------------- cost


def cost_line(label: str, args: argparse.Namespace, work: Path, model: Path) -> dict[str, Any]:
    spec = pd_rig.PdRigSpec(
        work_dir=work / f"cost-{label}",
        model_dir=model,
        dispatch={"cache_aware": "cache_aware", "sglang_pd_default": "default"}[label],
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        decode_max_total_tokens=args.max_total_tokens,
    )
    prompts = [e2e_rig.prompt_text(5000 + n, args.prompt_words) for n in range(args.prompts)]
    with pd_rig.PdRig(spec) as rig:
        for warmup in range(spec.dp_size * len(rig.prefills)):
            rig.complete(e2e_rig.prompt_text(900 + warmup, args.prompt_words), max_tokens=2)
        marks = rig.log_marks()
        cpu_before = [scheduler_cpu_s(s) for s in rig.prefills]
        statuses: list[int] = []
        lock = threading.Lock()
        deadline = time.monotonic() + args.seconds
        body = {"model": rig.model_name, "max_tokens": 2, "temperature": 0, "ignore_eos": True}

        def client(n: int) -> None:
            rng = random.Random(n)
            while time.monotonic() < deadline:
                status, _, _ = rig.post_completion({**body, "prompt": rng.choice(prompts)}, 600.0)
                with lock:
                    statuses.append(status)

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(args.clients)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.monotonic() - began
        cpu_s = sum(scheduler_cpu_s(s) for s in rig.prefills) - sum(cpu_before)
        _, logs = rig.log_since(marks)
        prefills = [p for n in range(len(rig.prefills)) for p in e2e_rig.parse_prefills(logs[n])]
        registrations = [st for s in rig.prefills for st in registration_stats(s.log_text()).values()]
    requests = len(statuses)
    cached = sum(p.cached_tokens for p in prefills)
    prompt_tokens = cached + sum(p.new_tokens for p in prefills)
    submitted = sum(r["submitted"] for r in registrations)
    enqueue_us = _weighted(registrations, "scheduler_us_per_request", "submitted")
    enqueue_cpu_us = _weighted(registrations, "scheduler_cpu_us_per_request", "submitted")
    post_ms = _weighted(registrations, "post_ms_per_request", "registered")
    schedulers = len(rig.prefills) * spec.dp_size
    cpu_ms = cpu_s / requests * 1e3 if requests else 0.0
    return {
        "bench": "pd_cost",
        "dispatch": label,
        "clients": args.clients,
        "seconds": round(wall_s, 1),
        "requests": requests,
        "errors": sum(1 for s in statuses if s != 200),
        "scheduler_cpu_ms_per_request": round(cpu_ms, 3),
        "scheduler_wall_ms_per_request": round(wall_s * schedulers / requests * 1e3, 3) if requests else None,
        "registrations": submitted,
        "registration_failed": sum(sum(r["failed"].values()) for r in registrations),
        "registration_scheduler_us_per_request": round(enqueue_us, 2),
        "registration_scheduler_cpu_us_per_request": round(enqueue_cpu_us, 2),
        "registration_scheduler_us_max": max((r.get("scheduler_us_max", 0.0) for r in registrations), default=0.0),
        "registration_post_ms_per_request": round(post_ms, 3),
        "hit_fraction": round(cached / prompt_tokens, 3) if prompt_tokens else 0.0,
    }


def _weighted(stats: Sequence[dict[str, Any]], key: str, weight: str) -> float:
    total = sum(s[weight] for s in stats)
    return sum(s[key] * s[weight] for s in stats) / total if total else 0.0


def ratio_line(lines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    plugin, baseline = lines["cache_aware"], lines["sglang_pd_default"]
    per_request_ms = plugin["scheduler_cpu_ms_per_request"] or 1.0
    return {
        "bench": "pd_cost_ratio",
        # The scheduler thread's part of the registration over the scheduler's CPU time per request.
        "registration_share_plugin": round(
            plugin["registration_scheduler_cpu_us_per_request"] / 1e3 / per_request_ms, 5
        ),
        "registration_share_plugin_wall": round(
            plugin["registration_scheduler_us_per_request"] / 1e3 / per_request_ms, 5
        ),
        "registration_share_follow_bootstrap_room": 0.0 if baseline["registrations"] == 0 else None,
        # What SGLang's own synchronous POST would have spent on that thread, per request.
        "registration_share_sglang_sync": round(plugin["registration_post_ms_per_request"] / per_request_ms, 4),
        "hit_fraction_plugin": plugin["hit_fraction"],
        "hit_fraction_follow_bootstrap_room": baseline["hit_fraction"],
        "hit_gain": round(plugin["hit_fraction"] - baseline["hit_fraction"], 3),
        "target_registration_share": 0.01,
    }


# --------------------------------------------------------------------------- soak


class Quiet:
    """Counts the heartbeats (batches without events) of each prefill's instance stream;
    :meth:`wait` returns once each sent two more: the last request's events passed the fan-in."""

    def __init__(self, rig: pd_rig.PdRig) -> None:
        import zmq

        from sglang_kvpub import wire

        self._rig = rig
        self._ctx = zmq.Context()
        self._counts = [0] * len(rig.prefills)
        self._stop = threading.Event()
        self._threads = []
        for n, server in enumerate(rig.prefills):
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(server.spec.stream_endpoint)
            thread = threading.Thread(target=self._run, args=(n, sub, wire), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, n: int, sub: Any, wire: Any) -> None:
        decoder = wire.BatchDecoder()
        while not self._stop.is_set():
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            with contextlib.suppress(wire.WireError):
                _, _, payload = wire.parse_live_frames(frames)
                if not decoder.decode(payload).events:
                    self._counts[n] += 1
        sub.close()

    def wait(self) -> None:
        starts = list(self._counts)
        self._rig.wait_for(
            lambda: all(c >= s + 2 for c, s in zip(self._counts, starts, strict=True)), "two heartbeats per stream"
        )

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._ctx.term()


class Soak:
    """A steady stream through Motor on a running rig; :meth:`run` returns the ``pd_soak`` line."""

    def __init__(self, rig: pd_rig.PdRig, *, prompts: int = 10, words: int = 300, seed: int = 7) -> None:
        self.rig = rig
        self.rng = random.Random(seed)
        self.prompts = [e2e_rig.prompt_text(seed * 1000 + n, words) for n in range(prompts)]
        self.requests = self.errors = self.mismatches = self.hits = 0
        self.samples: list[dict[str, int]] = []
        self.rooms: list[tuple[float, int, int]] = []  # (sent at, prefill, room) of the soak's own requests
        self.mismatch_examples: list[dict[str, Any]] = []

    def _one(self) -> None:
        done = self.rig.complete(self.rng.choice(self.prompts))
        self.requests += 1
        if done.status != 200 or done.completion_tokens == 0 or not done.scores:
            self.errors += 1
            return
        matched = done.scores[-1].matched
        self.hits += matched > 0
        if matched != done.cached_tokens:
            self.mismatches += 1
            if len(self.mismatch_examples) < 5:
                self.mismatch_examples.append({"motor": matched, "sglang": done.cached_tokens, "at": self.requests})

    def _own(self) -> None:
        """One request sent as pd_dual_dispatch sends it, with a room the soak keeps."""
        prefill = self.requests % len(self.rig.prefills)
        room = self.rng.randint(0, 2**63 - 1)
        statuses = self.rig.seed(self.rng.choice(self.prompts), prefill, room=room)
        self.requests += 1
        self.errors += statuses != [200, 200]
        self.rooms.append((time.monotonic(), prefill, room))

    def run(self, seconds: float, warmup: int = 12, before_each: Callable[[], None] | None = None) -> dict[str, Any]:
        """``before_each``: called before each request (e.g. a wait until the streams are quiet,
        so that the hit Motor is given already includes the previous request's events)."""
        for _ in range(warmup):  # every prompt cold once and the allocators warm: not measured
            self._one()
        self.requests = self.errors = self.mismatches = self.hits = 0
        self.samples = [rss_by_part(self.rig)]
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            if before_each is not None:
                before_each()
            self._own() if self.requests % 10 == 9 else self._one()
            if self.requests % 20 == 0:
                self.samples.append(rss_by_part(self.rig))
        self.samples.append(rss_by_part(self.rig))
        return self.line(time.monotonic() - began)

    def room_table(self) -> dict[str, int]:
        """Rooms the bootstrap servers still hold: of the soak's own, those sent over two
        cleanup intervals ago (``stale``) and all (``held``)."""
        now = time.monotonic()
        held = stale = 0
        for n, server in enumerate(self.rig.prefills):
            rooms = [(at, room) for at, p, room in self.rooms if p == n]
            if not rooms:
                continue
            answer = query_rooms(server.spec.host, self.rig.bootstrap_port, [room for _, room in rooms])
            held += len(answer)
            stale += sum(1 for at, room in rooms if str(room) in answer and now - at > 2 * ROOM_CLEANUP_S)
        return {"own_rooms": len(self.rooms), "held": held, "stale": stale}

    def line(self, seconds: float) -> dict[str, Any]:
        first, last = self.samples[0], self.samples[-1]
        common = [k for k in first if k in last]
        growth = {k: (last[k] - first[k]) / first[k] for k in common if first[k]}
        peak = {k: max(s.get(k, 0) for s in self.samples) for k in common}
        worst = max(growth, key=lambda k: abs(growth[k])) if growth else None
        return {
            "bench": "pd_soak",
            "seconds": round(seconds, 1),
            "requests": self.requests,
            "errors": self.errors,
            "hits": self.hits,
            "hit_mismatches": self.mismatches,
            "mismatch_examples": self.mismatch_examples,
            "processes": len(common),
            "rss_total_mib_first": round(sum(first[k] for k in common) / 2**20, 1),
            "rss_total_mib_last": round(sum(last[k] for k in common) / 2**20, 1),
            "rss_growth_max": round(growth[worst], 4) if worst else 0.0,
            "rss_growth_max_process": worst,
            "rss_peak_over_first_max": round(max((peak[k] / first[k] for k in common if first[k]), default=1.0), 4),
            "rss_growth_median": round(statistics.median(growth.values()), 4) if growth else 0.0,
            "room_table": self.room_table(),
            "target_rss_growth": 0.10,
        }


def soak_spec(work: Path, model: Path, **extra: Any) -> pd_rig.PdRigSpec:
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": str(ROOM_CLEANUP_S)}
    env.update(extra.pop("prefill_env", {}))
    return pd_rig.PdRigSpec(work_dir=work, model_dir=model, page_size=128, prefill_env=env, **extra)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("cost", "soak"))
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=4, help="cost: concurrent requests through Motor")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    missing = e2e_rig.environment_ready()
    if missing:
        emit({"bench": f"pd_{args.mode}", "skipped": f"needs {', '.join(missing)}"})
        return 0
    with tempfile.TemporaryDirectory(prefix="kvpub-bench-pd-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        model = sglang_server.make_model_dir(work / "model")
        if args.mode == "cost":
            lines = {label: cost_line(label, args, work, model) for label in ("cache_aware", "sglang_pd_default")}
            for line in lines.values():
                emit(line)
            emit(ratio_line(lines))
            return 0
        with pd_rig.PdRig(soak_spec(work / "soak", model)) as rig:
            soak = Soak(rig, prompts=args.prompts, words=args.prompt_words)
            quiet = Quiet(rig)
            try:
                emit(soak.run(args.seconds, before_each=quiet.wait))
            finally:
                quiet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
