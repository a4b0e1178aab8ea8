"""bench/run_all.py: JSON-line collection, flag filtering and the markdown it writes (unit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import run_all

pytestmark = pytest.mark.unit


def test_only_json_object_lines_are_collected() -> None:
    text = 'note: warming up\n{"bench": "wire", "x": 1}\n[1, 2]\n{broken\n  {"bench": "wire", "y": 2.5}\n'
    assert run_all.parse_json_lines(text) == [{"bench": "wire", "x": 1}, {"bench": "wire", "y": 2.5}]


def test_table_has_every_key_of_every_record_as_a_column() -> None:
    lines = run_all.table([{"bench": "b", "a": 1, "b": 0.123456}, {"bench": "b", "a": 20000, "c": None, "d": [1]}])
    assert lines[0] == "| a | b | c | d |"
    assert lines[2] == "| 1 | 0.1235 | - | - |"
    assert lines[3] == "| 20,000 | - | - | `[1]` |"


def test_missing_script_is_skipped_with_a_note_and_quick_flags_follow_help() -> None:
    missing = run_all.run_bench(run_all.Bench("nope", "bench/does_not_exist.py"), quick=False, timeout_s=5)
    assert missing["status"] == "skipped" and "does not exist" in missing["note"]
    routing = next(b for b in run_all.BENCHES if b.name == "routing")
    offered = run_all.Bench("routing", routing.script, quick=(("--no-plot", None), ("--not-a-flag", "1")))
    cmd = run_all.command_for(offered, quick=True)
    assert cmd is not None and "--no-plot" in cmd and "--not-a-flag" not in cmd


def test_markdown_shows_the_command_above_each_table() -> None:
    report = {
        "command": "python bench/run_all.py",
        "generated": "now",
        "quick": False,
        "machine": {"cpus": 2, "python": "3.11"},
        "benches": [
            {"name": "wire", "status": "ok", "command": "python bench/wire.py", "duration_s": 1.0,
             "records": [{"bench": "wire", "decode_ratio": 0.9}]},
            {"name": "fanin", "status": "skipped", "note": "bench/fanin.py does not exist yet", "records": []},
        ],
    }  # fmt: skip
    text = run_all.markdown(report)
    assert "`python bench/wire.py` (ok, 1.0 s)" in text and "| decode_ratio |" in text and "| 0.9 |" in text
    assert "Skipped: bench/fanin.py does not exist yet." in text


def test_files_a_bench_writes_follow_the_out_dir(tmp_path: Path) -> None:
    routing = next(b for b in run_all.BENCHES if b.name == "routing")
    cmd = run_all.command_for(routing, quick=False, out_dir=tmp_path)
    assert cmd is not None and cmd[cmd.index("--out-dir") + 1] == str(tmp_path)
    default = run_all.command_for(routing, quick=False, out_dir=run_all.HERE / "results")
    assert default is not None and "--out-dir" not in default


def _report(records: dict[str, list[dict[str, object]]]) -> dict[str, object]:
    return {
        "command": "python bench/run_all.py",
        "generated": "now",
        "quick": False,
        "machine": {"cpus": 2, "python": "3.11"},
        "benches": [{"name": name, "status": "ok", "records": recs} for name, recs in records.items()],
    }


def test_target_table_says_met_or_not_including_relative_targets() -> None:
    report = _report(
        {
            "service": [{"query_p99_ms": 5.0, "noop_p99_ms": 2.0}],
            "dispatch": [{"decision_us_p50": 40.0}],
            "wire": [{"encoding": "map", "decode_ratio": 0.5}],
        }
    )
    rows = "\n".join(run_all.target_rows(report))  # type: ignore[arg-type]
    assert "| service | query_p99_ms | 5 | <= 2 x noop_p99_ms + 0.3 | **no** |" in rows
    assert "| dispatch | decision_us_p50 | 40 | <= 50 | yes |" in rows
    assert "| wire | decode_ratio (map) | 0.5 | >= 0.8 | **no** |" in rows
    assert "| index | ingest_blocks_per_s | - | >= 300000 | not run |" in rows


def test_readme_block_is_rewritten_between_the_markers_only(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run_all.README_START}\nold\n{run_all.README_END}\noutro\n", encoding="utf-8")
    assert run_all.update_readme(_report({"dispatch": [{"decision_us_p50": 40.0}]}), readme)  # type: ignore[arg-type]
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "\nold\n" not in text
    assert "| dispatch | decision_us_p50 | 40 | <= 50 | yes |" in text
    readme.write_text("no markers\n", encoding="utf-8")
    assert not run_all.update_readme(_report({}), readme)  # type: ignore[arg-type]


def test_an_only_run_replaces_its_benches_and_keeps_the_others(tmp_path: Path) -> None:
    def bench(name: str, value: int) -> dict[str, object]:
        return {"name": name, "status": "ok", "command": f"python bench/{name}.py", "duration_s": 1.0,
                "records": [{"bench": name, "value": value}]}  # fmt: skip

    machine = {"cpus": 2, "python": "3.11", "platform": "x", "loadavg_1m": 1.0}
    previous = {"generated": "then", "command": "python bench/run_all.py --readme", "quick": False,
                "partial": False, "machine": machine, "benches": [bench("wire", 1), bench("routing", 1)]}  # fmt: skip
    fresh = {**previous, "generated": "now", "command": "python bench/run_all.py --only routing --readme",
             "benches": [bench("routing", 2)]}  # fmt: skip
    (tmp_path / "latest.json").write_text(run_all.json.dumps(previous))
    assert run_all._previous(tmp_path / "latest.json") == previous
    merged = run_all._merged(previous, fresh, {"routing"})
    assert [(b["name"], b["records"][0]["value"]) for b in merged["benches"]] == [("wire", 1), ("routing", 2)]
    assert merged["generated"] == "then" and [r["generated"] for r in merged["remeasured"]] == ["now"]
    # A second partial run keeps the first one's note for the benches it did not re-measure.
    later = {**fresh, "generated": "later", "command": "python bench/run_all.py --only wire --readme",
             "benches": [bench("wire", 3)]}  # fmt: skip
    twice = run_all._merged(merged, later, {"wire"})
    assert [(r["benches"], r["generated"]) for r in twice["remeasured"]] == [(["routing"], "now"), (["wire"], "later")]
    assert [(b["name"], b["records"][0]["value"]) for b in twice["benches"]] == [("wire", 3), ("routing", 2)]
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:start -->\nold\n<!-- bench:end -->\nb\n")
    assert run_all.update_readme(merged, readme)
    text = readme.read_text()
    assert "the `routing` rows re-measured by `python bench/run_all.py --only routing --readme` on now" in text
    assert text.startswith("a\n") and text.endswith("\nb\n")
    (tmp_path / "latest.json").write_text(run_all.json.dumps({**previous, "partial": True}))
    assert run_all._previous(tmp_path / "latest.json") is None  # never merge into a cut-short run
