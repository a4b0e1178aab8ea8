"""The plugin's cost inside a real SGLang server: throughput and per-step scheduler time.

Two real ``python -m sglang.launch_server`` (CPU, ``--dp-size 2``, a tiny dummy-weight
Llama, bench/sglang_server.py) run side by side in one run: ``plain`` without the plugin and
``plugin`` with ``--plugin sglang_kvpub`` (its defaults: instance stream, release hooks,
idle reconciliation, cache-aware dispatch).  Both serve the same workload, rounds
alternating which goes first, so machine noise hits both alike:

- *throughput*: ``--requests`` /generate requests (prompts of ``--prompt-tokens`` in groups
  sharing a prefix, ``--new-tokens`` each, request n pinned to rank n % 2 on both servers so
  the batches match) from ``--concurrency`` clients; requests/s per round, median over
  rounds; ``throughput_cost_pct`` = (1 - plugin/plain) x 100 (target <= 2 %);
- *per-step scheduler time*: a probe (bench/server_probe, loaded into both servers) times
  each scheduler step's ``get_next_batch_to_run`` + ``process_batch_result`` in thread CPU
  time - the part of a step where tree operations, event flushes and every per-step
  plugin hook run (the forward pass is excluded: identical and the largest noise);
  ``step_overhead_us_median`` = plugin median - plain median (target <= 20 us).

One JSON line per tree core (``--tree-core``: rust, python or both).  On a CPU-only machine
the servers get the CPU stand-ins of bench/cpu_shims on their PYTHONPATH (this process
imports nothing from tests/; see that README for why they exist).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _steps(probe_dir: Path) -> list[float]:
    samples: list[float] = []
    for path in probe_dir.glob("steps-*.txt"):
        samples.extend(float(line) for line in path.read_text().split())
    return samples


def _wait_steps(probe_dir: Path, at_least: int, timeout_s: float = 30.0) -> list[float]:
    """The probe flushes when a scheduler goes idle: poll until the round's steps are in."""
    deadline = time.monotonic() + timeout_s
    samples = _steps(probe_dir)
    while len(samples) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        samples = _steps(probe_dir)
    return samples


def bench_core(core: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = sglang_server.make_model_dir(work / "model")
    servers: dict[str, sglang_server.Server] = {}
    probes: dict[str, Path] = {}
    try:
        for name, plugin in (("plain", False), ("plugin", True)):
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
            )
            servers[name] = sglang_server.Server(spec).start(timeout_s=args.start_timeout)
        for server in servers.values():  # warm-up, not measured
            _run(server, _workload(99, 8, args.prompt_tokens), args.concurrency, args.new_tokens)
        time.sleep(1.0)  # let the warm-up's idle flush land before the files are cleared
        for probe in probes.values():
            for path in probe.glob("steps-*.txt"):
                path.unlink()
        rps: dict[str, list[float]] = {"plain": [], "plugin": []}
        for round_index in range(args.rounds):
            order = ("plain", "plugin") if round_index % 2 == 0 else ("plugin", "plain")
            prompts = _workload(round_index, args.requests, args.prompt_tokens)
            for name in order:
                rps[name].append(_run(servers[name], prompts, args.concurrency, args.new_tokens))
        steps = {name: _wait_steps(probe, args.requests) for name, probe in probes.items()}
        starts = {name: round(server.started_s, 1) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    plain_rps, plugin_rps = statistics.median(rps["plain"]), statistics.median(rps["plugin"])
    ratio = plugin_rps / plain_rps
    plain_med, plugin_med = statistics.median(steps["plain"]), statistics.median(steps["plugin"])
    return {
        "bench": "server",
        "tree_core": core,
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
        "throughput_cost_pct": round((1.0 - ratio) * 100.0, 2),
        "plain_step_us_median": round(plain_med, 2),
        "plugin_step_us_median": round(plugin_med, 2),
        "step_overhead_us_median": round(plugin_med - plain_med, 2),
        "plain_step_us_p90": round(percentile(steps["plain"], 90), 2),
        "plugin_step_us_p90": round(percentile(steps["plugin"], 90), 2),
        "steps": {name: len(values) for name, values in steps.items()},
        "start_s": starts,
        "targets": {"throughput_cost_pct": "<= 2", "step_overhead_us_median": "<= 20"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree-core", default="both", choices=("rust", "python", "both"))
    parser.add_argument("--requests", type=int, default=48, help="requests per server and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true", help="rust core only, 2 rounds of 16 requests")
    args = parser.parse_args(argv)
    cores = ["rust", "python"] if args.tree_core == "both" else [args.tree_core]
    if args.quick:
        cores, args.rounds, args.requests = [cores[0]], 2, 16
    for core in cores:
        with tempfile.TemporaryDirectory(prefix="kvpub-bench-server-") as work:
            emit(bench_core(core, args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
