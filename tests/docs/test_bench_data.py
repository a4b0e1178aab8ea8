"""The Mooncake traces the routing bench replays ship in the repository, unchanged, with licence and source."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import run_all  # noqa: E402
from bench._common import MOONCAKE_TRACES  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_traces_live_inside_the_repository() -> None:
    assert MOONCAKE_TRACES.resolve().is_relative_to(ROOT.resolve())
    assert run_all.TRACES == MOONCAKE_TRACES
    for bench in run_all.BENCHES:
        if "--trace" in bench.args:
            trace = Path(bench.args[bench.args.index("--trace") + 1])
            assert trace.is_file() and trace.resolve().is_relative_to(ROOT.resolve()), bench


def test_each_trace_matches_the_digest_its_readme_records() -> None:
    readme = (MOONCAKE_TRACES / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\w+\.jsonl) \|.*\| `([0-9a-f]{64})` \|$", readme, flags=re.MULTILINE))
    assert set(rows) == {"conversation_trace.jsonl", "synthetic_trace.jsonl"}
    for name, digest in rows.items():
        assert hashlib.sha256((MOONCAKE_TRACES / name).read_bytes()).hexdigest() == digest, name


def test_the_licence_and_the_source_travel_with_the_data() -> None:
    licence = (MOONCAKE_TRACES / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in licence and "Version 2.0" in licence
    readme = (MOONCAKE_TRACES / "README.md").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in readme and "FAST25-release/traces" in readme and "Apache" in readme
