"""``check-config`` says plainly that Motor's own Rust kv-conductor cannot read SGLang 0.5.20+ events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from motor_adapter.config_check import check_config

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

pytestmark = pytest.mark.unit


def test_the_note_names_what_fails_and_what_to_run_instead() -> None:
    config = json.loads((EXAMPLES / "motor_user_config.json").read_text())
    env_config = json.loads((EXAMPLES / "motor_env_config.json").read_text())
    findings = check_config(config, env={"KV_CONDUCTOR_SERVICE": "10.0.0.9"}, env_config=env_config)
    assert [f for f in findings if f.severity == "problem"] == []
    (note,) = [f for f in findings if "Rust kv-conductor" in f.message]
    assert note.severity == "note" and note.key == "kv_conductor_config"
    assert "CANNOT read SGLang 0.5.20+" in note.message and "falls back to" in note.message
    assert "kv-conductor --host HOST --port PORT" in note.fix and "/opt/motor/bin" in note.fix


def test_the_cli_prints_it_and_still_passes() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "motor_adapter.cli",
            "check-config",
            str(EXAMPLES / "motor_user_config.json"),
            "--env-config",
            str(EXAMPLES / "motor_env_config.json"),
        ],
        capture_output=True,
        text=True,
        env={"KV_CONDUCTOR_SERVICE": "10.0.0.9", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: kv_conductor_config: Motor's own Rust kv-conductor" in done.stdout
    assert "fix: run this package's conductor where Motor's would run: `kv-conductor" in done.stdout
