"""The plugin's cost inside a real SGLang server: throughput and per-step scheduler time.

Two real ``python -m sglang.launch_server`` (CPU, ``--dp-size 2``, a tiny dummy-weight
Llama, bench/sglang_server.py) run side by side in one run: ``plain`` without the plugin and
``plugin`` with ``--plugin sglang_kvpub`` (its defaults: instance stream, release hooks,
idle reconciliation, cache-aware dispatch).  Both serve the same workload, rounds
alternating which goes first, so machine noise hits both alike; while one serves, the
other's whole process group is stopped (SIGSTOP, SIGCONT after): SGLang's DP controller
polls without blocking, one core at 100 % even when idle, and on a 2-core machine the
idle server's controller made both servers several times slower and the rounds erratic:

- *throughput*: ``--requests`` /generate requests (prompts of ``--prompt-tokens`` in groups
  sharing a prefix, ``--new-tokens`` each, request n pinned to rank n % 2 on both servers so
  the batches match) from ``--concurrency`` clients; requests/s per round, median over
  rounds; ``throughput_ratio`` is the geometric mean of the per-round plugin/plain ratios
  (order alternating, so going first or second cancels out) and ``throughput_cost_pct`` =
  (1 - ratio) x 100 (target <= 2 %).  Both servers run with ``--sleep-on-idle`` (an idle
  scheduler waits on its sockets instead of spinning);
- *CPU per request*: user + system CPU of each server's whole process tree over its own
  rounds, per request, the DP controller's spinning main thread excepted (the plugin's
  fan-in and dispatch threads counted); ``cpu_cost_pct`` = plugin / plain - 1;
- *per-step scheduler time*: a probe (bench/server_probe, loaded into both servers) times
  each scheduler step's ``get_next_batch_to_run`` + ``process_batch_result`` in thread CPU
  time - the part of a step where tree operations, event flushes and every per-step
  plugin hook run (the forward pass is excluded: identical and the largest noise) - and,
  inside it, the plugin's own code (publisher, release hooks, tracker; the SGLang
  originals its hooks wrap taken out).  ``plugin_own_us_median`` is the plugin's own time
  per step, median over every step of the plugin server (target <= 20 us); its mean, p90
  and p99 are beside it, with the rank publisher's sender thread's CPU (batches too big to
  send inline) per step and ``plugin_total_us_mean`` (own mean + sender thread); and
  ``plain_publisher_us_*`` is what SGLang's own publisher costs the plain server per step
  (the part the plugin replaces).  The difference of the two servers' step medians
  (``step_overhead_us_median``) is printed too: two noisy medians apart, not the
  plugin's cost;
- *idle hook*: calls and CPU per call of the plugin's idle-time hook (it runs while a
  scheduler has nothing to do, so it is not part of any step);
- ``plugin_entries_calls_us_max_us``: per plugin entry point (hook, publisher), its calls,
  total and largest CPU time since the server started - where the plugin's time goes (a
  hook reached from inside the SGLang operation another hook wraps counts in both).

One JSON line per tree core (``--tree-core``: rust, python or both).  ``--control aa`` runs
the same with neither server loading the plugin: its ``throughput_cost_pct`` and
``cpu_cost_pct`` are this machine's noise floor for the figures above (measured: several
percent either way over 4-8 rounds, which is why the rounds default to 16).  On a CPU-only machine
the servers get the CPU stand-ins of bench/cpu_shims on their PYTHONPATH (this process
imports nothing from tests/; see that README for why they exist).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import sglang_server
from _common import emit, percentile

HERE = Path(__file__).resolve().parent
PROBE = HERE / "server_probe"
PAGE = 16


def _workload(round_index: int, requests: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts in groups of 4 sharing a prefix of half the prompt (cache hits, stores and
    evictions on both servers alike); new seeds every round."""
    prompts = []
    for n in range(requests):
        group = sglang_server.prompt_ids(10_000 * round_index + n // 4, prompt_tokens // 2)
        tail = sglang_server.prompt_ids(10_000 * round_index + 5_000 + n, prompt_tokens - len(group))
        prompts.append(group + tail)
    return prompts


def _run(server: sglang_server.Server, prompts: Sequence[list[int]], concurrency: int, new_tokens: int) -> float:
    """Requests per second for ``prompts`` sent by ``concurrency`` clients.  Request ``n``
    is pinned to rank ``n % 2`` on both servers: the batches are the same, so the
    comparison measures the plugin's cost, not what its dispatch changes (the hits it
    brings are measured by the server tier and the end-to-end bench)."""

    def send(item: tuple[int, list[int]]) -> Any:
        n, ids = item
        return server.generate(ids, max_new_tokens=new_tokens, dp_rank=n % 2)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for result in pool.map(send, enumerate(prompts)):
            assert result["meta_info"]["completion_tokens"] == new_tokens
    return len(prompts) / (time.perf_counter() - start)


Sample = tuple[float, float, float]  # (step, plugin's own, SGLang publisher) microseconds


def _tree_cpu_s(server: sglang_server.Server) -> float:
    """User + system CPU seconds so far of the server's whole process tree (launcher,
    tokenizer, DP controller with the fan-in's threads, schedulers, detokenizer), minus the
    DP controller's main thread: SGLang 0.5.23's controller loop polls its socket without
    blocking, one core at 100 % whatever the load, so its CPU measures wall time, not work
    (the plugin's fan-in and dispatch run in their own threads, counted)."""
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
            if "data_parallel_controller" in proc.name():
                total -= sum(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid)
        except psutil.NoSuchProcess:
            continue
    return total


def _freeze(server: sglang_server.Server, frozen: bool) -> None:
    """SIGSTOP / SIGCONT the server's process group: the server not being measured takes no
    CPU (its DP controller would otherwise spin a core against the measured one)."""
    assert server.proc is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)


def _measure(
    server: sglang_server.Server, others: Sequence[sglang_server.Server], run: Callable[[], float]
) -> tuple[float, float]:
    """``run()``'s result and the server's CPU seconds for it, every other server frozen."""
    for other in others:
        _freeze(other, True)
    try:
        before = _tree_cpu_s(server)
        result = run()
        return result, _tree_cpu_s(server) - before
    finally:
        for other in others:
            _freeze(other, False)


def _steps(probe_dir: Path) -> list[Sample]:
    samples: list[Sample] = []
    for path in probe_dir.glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            step, plugin, publisher = (float(v) for v in line.split())
            samples.append((step, plugin, publisher))
    return samples


def _idle(probe_dir: Path) -> tuple[int, float, float]:
    """(idle hook calls, their CPU us, the sender thread's CPU us) over the measured rounds."""
    calls, idle_us, sender_us = 0, 0.0, 0.0
    for path in probe_dir.glob("idle-*.txt"):
        for line in path.read_text().splitlines():
            count, idle, sender = line.split()
            calls, idle_us, sender_us = calls + int(count), idle_us + float(idle), sender_us + float(sender)
    return calls, idle_us, sender_us


def _entries(probe_dir: Path) -> dict[str, list[float]]:
    """Plugin entry point -> [calls, CPU us, max us] since the server started (warm-up included)."""
    totals: dict[str, list[float]] = {}
    for path in probe_dir.glob("entries-*.txt"):
        for line in path.read_text().splitlines():
            name, calls, total, most = line.split()
            entry = totals.setdefault(name, [0, 0.0, 0.0])
            entry[0] += int(calls)
            entry[1] = round(entry[1] + float(total), 1)
            entry[2] = max(entry[2], float(most))
    return dict(sorted(totals.items(), key=lambda item: -item[1][1]))


def _wait_steps(probe_dir: Path, at_least: int, timeout_s: float = 30.0) -> list[Sample]:
    """The probe flushes when a scheduler goes idle: poll until the round's steps are in."""
    deadline = time.monotonic() + timeout_s
    samples = _steps(probe_dir)
    while len(samples) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        samples = _steps(probe_dir)
    return samples


def _clear(probe_dir: Path) -> None:
    for path in [*probe_dir.glob("steps-*.txt"), *probe_dir.glob("idle-*.txt"), *probe_dir.glob("entries-*.txt")]:
        path.unlink()


def _figures(prefix: str, values: Sequence[float]) -> dict[str, float]:
    return {
        f"{prefix}_median": round(statistics.median(values), 2),
        f"{prefix}_mean": round(statistics.fmean(values), 2),
        f"{prefix}_p90": round(percentile(values, 90), 2),
        f"{prefix}_p99": round(percentile(values, 99), 2),
    }


def bench_core(core: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = sglang_server.make_model_dir(work / "model")
    servers: dict[str, sglang_server.Server] = {}
    probes: dict[str, Path] = {}
    try:
        # --control aa: the "plugin" server runs without the plugin too (the noise floor).
        for name, plugin in (("plain", False), ("plugin", args.control != "aa")):
            probes[name] = work / f"probe-{core}-{name}"
            probes[name].mkdir()
            spec = sglang_server.ServerSpec(
                model_path=model,
                log_path=work / f"server-{core}-{name}.log",
                plugin=plugin,
                tree_core=core,
                page_size=PAGE,
                max_total_tokens=args.max_total_tokens,
                shim_dir=sglang_server.cpu_shim_dir(),
                extra_paths=(PROBE,),
                env={"KVPUB_PROBE_DIR": str(probes[name])},
                extra_args=("--sleep-on-idle",),  # idle schedulers wait instead of spinning
            )
            servers[name] = sglang_server.Server(spec).start(timeout_s=args.start_timeout)
        for server in servers.values():  # warm-up, not measured
            _run(server, _workload(99, 8, args.prompt_tokens), args.concurrency, args.new_tokens)
        time.sleep(1.0)  # let the warm-up's idle flush land before the files are cleared
        for probe in probes.values():
            _clear(probe)
        rps: dict[str, list[float]] = {"plain": [], "plugin": []}
        cpu_s = {"plain": 0.0, "plugin": 0.0}
        for round_index in range(args.rounds):
            order = ("plain", "plugin") if round_index % 2 == 0 else ("plugin", "plain")
            prompts = _workload(round_index, args.requests, args.prompt_tokens)
            for name in order:
                server = servers[name]
                others = [other for other in servers.values() if other is not server]
                value, cpu = _measure(
                    server, others, functools.partial(_run, server, prompts, args.concurrency, args.new_tokens)
                )
                rps[name].append(value)
                cpu_s[name] += cpu
        steps = {name: _wait_steps(probe, args.requests) for name, probe in probes.items()}
        idle = {name: _idle(probe) for name, probe in probes.items()}
        entries = _entries(probes["plugin"])
        starts = {name: round(server.started_s, 1) for name, server in servers.items()}
    finally:
        for server in servers.values():
            _freeze(server, False)  # a stopped group would not see SIGTERM
            server.stop()
    plain_rps, plugin_rps = statistics.median(rps["plain"]), statistics.median(rps["plugin"])
    # Per round (same prompts, back to back), then the geometric mean: with the order
    # alternating, an effect of going first or second cancels over each pair of rounds.
    ratio = statistics.geometric_mean([b / a for a, b in zip(rps["plain"], rps["plugin"], strict=True)])
    step = {name: [sample[0] for sample in values] for name, values in steps.items()}
    plugin_own = [sample[1] for sample in steps["plugin"]]
    plain_publisher = [sample[2] for sample in steps["plain"]]
    plain_med, plugin_med = statistics.median(step["plain"]), statistics.median(step["plugin"])
    idle_calls, idle_us, sender_us = idle["plugin"]
    requests = args.rounds * args.requests
    sender_per_step = sender_us / len(plugin_own)
    return {
        "bench": "server",
        "tree_core": core,
        "control": args.control,
        "dp_size": 2,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "concurrency": args.concurrency,
        "plain_rps": round(plain_rps, 3),
        "plugin_rps": round(plugin_rps, 3),
        "plain_rps_rounds": [round(v, 3) for v in rps["plain"]],
        "plugin_rps_rounds": [round(v, 3) for v in rps["plugin"]],
        "throughput_ratio": round(ratio, 4),
        "throughput_ratio_of_medians": round(plugin_rps / plain_rps, 4),
        "plain_cpu_ms_per_request": round(1000.0 * cpu_s["plain"] / requests, 2),
        "plugin_cpu_ms_per_request": round(1000.0 * cpu_s["plugin"] / requests, 2),
        "cpu_cost_pct": round((cpu_s["plugin"] / cpu_s["plain"] - 1.0) * 100.0, 2),
        "throughput_cost_pct": round((1.0 - ratio) * 100.0, 2),
        **_figures("plugin_own_us", plugin_own),
        "plugin_sender_thread_us_per_step": round(sender_per_step, 2),
        "plugin_total_us_mean": round(statistics.fmean(plugin_own) + sender_per_step, 2),
        "plugin_steps_with_own_work_pct": round(100.0 * sum(1 for v in plugin_own if v > 0) / len(plugin_own), 1),
        **_figures("plain_publisher_us", plain_publisher),
        "plain_step_us_median": round(plain_med, 2),
        "plugin_step_us_median": round(plugin_med, 2),
        "step_overhead_us_median": round(plugin_med - plain_med, 2),
        "plain_step_us_p90": round(percentile(step["plain"], 90), 2),
        "plugin_step_us_p90": round(percentile(step["plugin"], 90), 2),
        "idle_hook_calls": idle_calls,
        "idle_hook_us_per_call": round(idle_us / idle_calls, 2) if idle_calls else 0.0,
        "steps": {name: len(values) for name, values in steps.items()},
        "plugin_entries_calls_us_max_us": entries,
        "start_s": starts,
        "targets": {"throughput_cost_pct": "<= 2", "plugin_own_us_median": "<= 20"},
    }


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree-core", default="both", choices=("rust", "python", "both"))
    parser.add_argument("--requests", type=int, default=48, help="requests per server and round")
    parser.add_argument("--rounds", type=int, default=16, help="even: each order as often")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true", help="rust core only, 2 rounds of 16 requests")
    parser.add_argument(
        "--control",
        default="-",
        choices=("-", "aa"),
        help="aa: both servers without the plugin - what this machine's noise alone makes of the figures",
    )
    args = parser.parse_args(argv)
    cores = ["rust", "python"] if args.tree_core == "both" else [args.tree_core]
    if args.quick:
        cores, args.rounds, args.requests = [cores[0]], 2, 16
    signal.signal(signal.SIGTERM, _stop)  # a stopped bench stops its servers (the finally blocks)
    for core in cores:
        with tempfile.TemporaryDirectory(prefix="kvpub-bench-server-") as work:
            emit(bench_core(core, args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
