"""``kv-conductor``'s settings: the role script passes only --host/--port, the rest is the environment's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from motor_adapter.tools import kv_conductor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("rust_log", "level"),
    [
        ("", "INFO"),
        ("debug", "DEBUG"),
        ("warn,hyper=info", "WARNING"),
        ("trace", "DEBUG"),
        ("tower_http=debug", "INFO"),
    ],
)
def test_rust_log_sets_the_level(rust_log: str, level: str) -> None:
    assert kv_conductor._log_level({"RUST_LOG": rust_log}) == level


def test_the_config_comes_from_the_environment_first(tmp_path: Path) -> None:
    given = str(tmp_path / "adapter.json")
    assert kv_conductor.config_path({kv_conductor.CONFIG_ENV: given}) == given
    expected = kv_conductor.DEFAULT_CONFIG_PATH if Path(kv_conductor.DEFAULT_CONFIG_PATH).is_file() else None
    assert kv_conductor.config_path({}) == expected


def test_only_host_and_port_are_flags() -> None:
    parser = kv_conductor.build_parser()
    args = parser.parse_args(["--host", "0.0.0.0", "--port", "13333"])
    assert (args.host, args.port) == ("0.0.0.0", 13333)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--host", "0.0.0.0"])


def test_a_missing_config_file_fails_the_start_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    done = subprocess.run(
        [sys.executable, "-m", "motor_adapter.tools.kv_conductor", "--host", "127.0.0.1", "--port", "1"],
        env={kv_conductor.CONFIG_ENV: str(missing), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert str(missing) in done.stderr and "MOTOR_KV_ADAPTER_CONFIG" in done.stderr
