"""Run every benchmark of the project and collect its figures for docs/benchmarks.md.

    python bench/run_all.py [--quick] [--only wire,index,...] [--timeout 900] [--out-dir DIR]

Each bench (wire, fanin, residency, index, service, replay, scale, dispatch, server, e2e, e2e_pd, routing) runs as a
subprocess of this interpreter from the repository root, with a timeout; a bench script that
does not exist yet is skipped with a note. Every JSON line it prints on stdout is kept (other lines are ignored).
Writes ``bench/results/latest.json`` (every record, the exact command, exit status, duration,
the stderr tail of a failure) and ``bench/results/latest.md`` (one markdown table per bench
with every figure, under the command that produced it); ``--readme`` rewrites the block of
docs/benchmarks.md (the README's summary links it).

``--quick`` scales each bench down with the flags it offers (a flag is passed only if the
bench's ``--help`` lists it), for a smoke run, and writes to ``bench/results/quick/``; the
published figures come from a full run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is a folder, the repository root holds it
    sys.path.insert(0, str(ROOT))

from bench._common import MOONCAKE_TRACES as TRACES  # noqa: E402
from bench._common import TARGETS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Bench:
    name: str
    script: str  # relative to the repository root
    args: tuple[str, ...] = ()  # always passed
    quick: tuple[tuple[str, str | None], ...] = ()  # (flag, value or None for a switch) under --quick
    min_timeout_s: float = 0.0  # a bench that starts real servers needs more than --timeout


BENCHES: tuple[Bench, ...] = (
    Bench("wire", "bench/wire.py", quick=(("--batches", "200"), ("--seconds", "0.3"))),
    Bench(
        "fanin",
        "bench/fanin.py",
        args=("--runs", "5"),  # the bound must hold in every one of 5 runs, not on average
        quick=(("--ranks", "4"), ("--seconds", "1"), ("--producers", "2"), ("--host-probe-s", "0.2"), ("--runs", "1")),
    ),
    Bench(
        "residency",
        "bench/residency.py",
        quick=(("--steps", "200"), ("--pages", "100000"), ("--blocks", "100000"), ("--quick", None)),
    ),
    Bench("index", "bench/index.py", quick=(("--blocks", "100000"), ("--queries", "200"), ("--no-memory", None))),
    Bench("service", "bench/service.py", quick=(("--seconds", "1"), ("--rounds", "1"), ("--clients", "16"))),
    # The Mooncake conversation trace through the index and Dynamo's RadixTree.
    Bench(
        "replay",
        "bench/replay.py",
        args=("--trace", str(TRACES / "conversation_trace.jsonl")),
        quick=(("--limit", "1500"),),
    ),
    # N dp-16 instances into one motor-kv-adapter serve process; up to ~6 GB.
    Bench(
        "scale",
        "bench/scale.py",
        args=("--instances", "25,50,100"),
        quick=(("--instances", "4"), ("--rank-blocks", "200"), ("--rounds", "1"), ("--probe-seconds", "1")),
        min_timeout_s=1800.0,
    ),
    Bench("dispatch", "bench/dispatch.py", quick=(("--decisions", "300"), ("--prompts", "20"))),
    # Two real SGLang servers (plain, plugin) per tree core; minutes, not seconds.
    Bench("server", "bench/server.py", quick=(("--quick", None),), min_timeout_s=3600.0),
    # Motor's real coordinator in front of a real SGLang server with the plugin; minutes too.
    Bench("e2e", "bench/e2e.py", quick=(("--prompts", "1"), ("--repeats", "1")), min_timeout_s=1800.0),
    # The report's PD shape: Motor pd_dual_dispatch, 2 prefills x dp 2 + a decode over Mooncake TCP.
    Bench(
        "e2e_pd", "bench/e2e.py", args=("--pd",), quick=(("--prompts", "1"), ("--repeats", "1")), min_timeout_s=2400.0
    ),
    Bench(
        "routing",
        "bench/routing.py",
        args=("--trace", str(TRACES / "conversation_trace.jsonl")),
        quick=(("--limit", "3000"), ("--no-plot", None)),
    ),
    Bench(
        "routing",
        "bench/routing.py",
        args=("--trace", str(TRACES / "synthetic_trace.jsonl")),
        quick=(("--limit", "3000"), ("--no-plot", None)),
    ),
    # Agentic multi-turn sessions generated from a seed: no input file.
    Bench(
        "routing",
        "bench/routing.py",
        args=("--workload", "agentic", "--seed", "0"),
        quick=(("--sessions", "300"), ("--no-plot", None)),
    ),
    # RL rollout bursts generated from a seed: GRPO groups sent at once (no input file).
    Bench(
        "routing",
        "bench/routing.py",
        args=("--workload", "rollout", "--seed", "0"),
        quick=(("--limit", "1536"), ("--no-plot", None)),
    ),
)


# --------------------------------------------------------------------------- running


def _help_text(script: Path) -> str:
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return ""
    return proc.stdout


def _offers(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def command_for(bench: Bench, quick: bool, out_dir: Path | None = None) -> list[str] | None:
    """The command line, or None when the script or one of its input files is missing.

    A bench that writes files of its own (``--out-dir``) writes them next to ``latest.json``,
    so a quick run never overwrites the full run's plots.
    """
    script = ROOT / bench.script
    if not script.exists():
        return None
    args = list(bench.args)
    if "--trace" in args and not Path(args[args.index("--trace") + 1]).exists():
        return None
    offered = _help_text(script) if (quick and bench.quick) or out_dir is not None else ""
    if quick:
        for flag, value in bench.quick:
            if _offers(offered, flag):
                args += [flag] if value is None else [flag, value]
    if out_dir is not None and _offers(offered, "--out-dir") and out_dir.resolve() != (HERE / "results").resolve():
        args += ["--out-dir", str(out_dir)]
    return [sys.executable, bench.script, *args]


def parse_json_lines(text: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def run_bench(bench: Bench, quick: bool, timeout_s: float, out_dir: Path | None = None) -> dict[str, Any]:
    cmd = command_for(bench, quick, out_dir)
    result: dict[str, Any] = {"name": bench.name, "script": bench.script}
    if cmd is None:
        missing = bench.script if not (ROOT / bench.script).exists() else "its input file"
        result.update(status="skipped", note=f"{missing} does not exist yet", records=[])
        return result
    shown = ["python", *cmd[1:]]
    result["command"] = " ".join(shlex.quote(_relative(part)) for part in shown)
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=max(timeout_s, bench.min_timeout_s), cwd=ROOT, env=env
        )
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired as exc:
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr)
        code, status = None, "timeout"
    records = parse_json_lines(stdout)
    if status == "ok" and not records:
        status = "failed"
    result.update(
        status=status,
        returncode=code,
        duration_s=round(time.monotonic() - started, 1),
        records=records,
    )
    if status != "ok":
        result["stderr_tail"] = stderr.strip()[-3000:]
    return result


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _relative(part: str) -> str:
    """Paths inside the parent of the repository, written relative to the repository root."""
    path = Path(part)
    if path.is_absolute():
        try:
            return os.path.relpath(path, ROOT)
        except ValueError:
            return part
    return part


# --------------------------------------------------------------------------- reporting


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:,.4g}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, (list, dict)):
        return "`" + json.dumps(value, separators=(",", ":")) + "`"
    return str(value).replace("|", "\\|")


def table(records: Sequence[dict[str, Any]]) -> list[str]:
    """One markdown table: every key of every record (first-seen order) as a column."""
    columns: list[str] = []
    for record in records:
        for key in record:
            if key not in columns and key not in ("bench", "targets"):  # targets: the Targets table
                columns.append(key)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for record in records:
        lines.append("| " + " | ".join(_cell(record.get(key)) for key in columns) + " |")
    return lines


def target_rows(report: dict[str, Any]) -> list[str]:
    """A markdown table: every target with the measured value and whether it is met."""
    lines = ["| bench | figure | measured | target | met |", "|---|---|---|---|---|"]
    for target in TARGETS:
        records = [
            record
            for bench in report["benches"]
            for record in bench["records"]
            if target.applies(bench["name"], record)
        ]
        label = target.figure + "".join(f" ({value})" for _, value in target.where)
        for record in records[:1]:
            value, met = target.check(record)
            verdict = "not measured" if record.get("not_measured") else {True: "yes", False: "**no**", None: "?"}[met]
            lines.append(f"| {target.bench} | {label} | {_cell(value)} | {target.describe()} | {verdict} |")
        if not records:
            lines.append(f"| {target.bench} | {label} | - | {target.describe()} | not run |")
    return lines


def routing_rows(report: dict[str, Any]) -> list[str]:
    """Every routing policy's headline figures, per trace."""
    columns = (
        "trace",
        "policy",
        "code",
        "hit_ratio",
        "hit_ratio_vs_oracle",
        "prefill_tokens",
        "ttft_p50_s",
        "ttft_p90_s",
    )
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for bench in report["benches"]:
        if bench["name"] == "routing":
            for record in bench["records"]:
                lines.append("| " + " | ".join(_cell(record.get(key)) for key in columns) + " |")
    return lines


BENCH_DOC = ROOT / "docs" / "benchmarks.md"  # the README shows a summary and links it
README_START = "<!-- bench:start -->"
README_END = "<!-- bench:end -->"


def update_readme(report: dict[str, Any], readme: Path) -> bool:
    """Rewrites the block between the bench markers of ``readme`` (docs/benchmarks.md, which the
    README links); False when the markers are absent."""
    text = readme.read_text(encoding="utf-8")
    if README_START not in text or README_END not in text:
        return False
    block = [
        README_START,
        f"Measured by `{report['command']}` on {report['generated']} on this project's CI machine kind "
        f"({report['machine']['cpus']} CPUs, no accelerator{_load_note(report)}){_remeasured_note(report)}; "
        "every figure of every bench is in [bench/results/latest.md](../bench/results/latest.md).",
        "",
        *target_rows(report),
        "",
        "Routing quality on the Mooncake traces and the generated agentic sessions (2 prefill instances x 16 "
        "DP ranks, LRU per rank; `code`: `shipped` runs motor_adapter's adapter state or KvAffinity and "
        "sglang_kvpub's dispatcher fed through the wire codec, `model` is a baseline model; `default` is what "
        "operators get: Motor's unchanged cost over the adapter's `/query` answer, then the plugin's dispatcher):",
        "",
        *routing_rows(report),
        README_END,
    ]
    head, rest = text.split(README_START, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + "\n".join(block) + tail, encoding="utf-8")
    return True


def _remeasured_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The partial runs merged into the report, oldest first (one dict in older reports)."""
    again = report.get("remeasured") or []
    return [again] if isinstance(again, dict) else list(again)


def _remeasured_note(report: dict[str, Any]) -> str:
    notes = []
    for again in _remeasured_runs(report):
        names = ", ".join(f"`{name}`" for name in again["benches"])
        notes.append(f"; the {names} rows re-measured by `{again['command']}` on {again['generated']}")
    return "".join(notes)


def _load_note(report: dict[str, Any]) -> str:
    load = report["machine"].get("loadavg_1m")
    return f", load average {load:g} at the end" if isinstance(load, (int, float)) else ""


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Made by `{report['command']}` on {report['generated']}{_remeasured_note(report)} "
        f"({report['machine']['cpus']} CPUs, Python {report['machine']['python']}"
        f"{_load_note(report)}{', quick mode: scaled down' if report['quick'] else ''}"
        f"{', PARTIAL: the run was cut short' if report.get('partial') else ''}).",
        "Each table holds every figure the bench printed; the command above it reproduces it.",
        "",
        "## Targets",
        "",
        *target_rows(report),
        "",
    ]
    for bench in report["benches"]:
        title = bench["name"]
        if bench.get("command") and "--trace" in bench["command"]:
            title += " (" + Path(bench["command"].split("--trace", 1)[1].split()[0]).stem + ")"
        elif bench.get("command") and "--workload agentic" in bench["command"]:
            title += " (agentic sessions)"
        lines.append(f"## {title}")
        lines.append("")
        if bench["status"] == "skipped":
            lines += [f"Skipped: {bench['note']}.", ""]
            continue
        lines += [f"`{bench['command']}` ({bench['status']}, {bench['duration_s']} s)", ""]
        if bench["records"]:
            lines += table(bench["records"])
        else:
            lines.append("No figures: the bench printed no JSON line (see latest.json for its stderr).")
        lines.append("")
    return "\n".join(lines)


def _report(args: argparse.Namespace, argv: Sequence[str] | None, results: list[Any], partial: bool) -> dict[str, Any]:
    own = ["python", "bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(p) for p in own),
        "quick": args.quick,
        "partial": partial,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        },
        "benches": results,
    }


def _previous(path: Path) -> dict[str, Any] | None:
    """The last complete full report at ``path`` (what an ``--only`` run merges into), or None."""
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(previous, dict) or previous.get("quick") or previous.get("partial"):
        return None
    return previous


def _merged(previous: dict[str, Any], report: dict[str, Any], wanted: set[str]) -> dict[str, Any]:
    """A partial run (``--only``) merged into the previous full report: its benches replace
    those of the same name, the others keep their figures; ``remeasured`` lists the partial
    runs whose figures the report holds, which benches and how (``partial`` while the run
    goes on)."""
    fresh = {b["name"] for b in report["benches"]}
    benches = []
    for bench in BENCHES:  # BENCHES order; one entry per script and arguments
        pool = report["benches"] if bench.name in fresh else previous.get("benches", [])
        benches += [b for b in pool if b["name"] == bench.name and b not in benches]
    merged = dict(previous)
    merged["benches"] = benches
    merged["partial"] = report.get("partial", False)
    # Every partial run stays named with the benches it still holds the figures of.
    earlier = [
        {**run, "benches": [name for name in run["benches"] if name not in wanted]}
        for run in _remeasured_runs(previous)
    ]
    merged["remeasured"] = [run for run in earlier if run["benches"]] + [
        {
            "benches": sorted(wanted),
            "command": report["command"],
            "generated": report["generated"],
            "machine": report["machine"],
        }
    ]
    return merged


def _write(out_dir: Path, report: dict[str, Any]) -> None:
    (out_dir / "latest.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / "latest.md").write_text(markdown(report), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="scaled-down settings (smoke run)")
    parser.add_argument("--only", default="", help="comma-separated bench names (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per bench (default 900)")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="default bench/results (bench/results/quick with --quick)"
    )
    parser.add_argument("--readme", action="store_true", help="also rewrite the benchmark block of docs/benchmarks.md")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="render an existing latest.json instead of running the benches"
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
        (args.from_json.parent / "latest.md").write_text(markdown(report), encoding="utf-8")
        if args.readme and not update_readme(report, BENCH_DOC):
            parser.error(f"docs/benchmarks.md has no {README_START} ... {README_END} block")
        return 0
    out_dir: Path = args.out_dir or (HERE / "results" / "quick" if args.quick else HERE / "results")
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = wanted - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"unknown bench(es): {', '.join(sorted(unknown))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = _previous(out_dir / "latest.json") if wanted and not args.quick else None
    results = []
    for bench in BENCHES:
        if wanted and bench.name not in wanted:
            continue
        print(f"run_all: {bench.name} ({bench.script}) ...", file=sys.stderr, flush=True)
        result = run_bench(bench, args.quick, args.timeout, out_dir)
        print(
            f"run_all: {bench.name}: {result['status']}, {len(result['records'])} record(s)"
            + (f", {result['duration_s']} s" if "duration_s" in result else f" ({result.get('note')})"),
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
        partial = _report(args, argv, results, partial=True)  # a run cut short keeps what it measured
        _write(out_dir, _merged(previous, partial, wanted) if previous else partial)
    report = _report(args, argv, results, partial=False)
    if previous:
        report = _merged(previous, report, wanted)
    _write(out_dir, report)
    print(f"run_all: wrote {out_dir / 'latest.json'} and {out_dir / 'latest.md'}", file=sys.stderr)
    if args.readme and not args.quick and update_readme(report, BENCH_DOC):
        print("run_all: rewrote the benchmark block of docs/benchmarks.md", file=sys.stderr)
    failed = [r["name"] for r in results if r["status"] in ("failed", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
