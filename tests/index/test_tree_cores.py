"""Tree-core facts: prediction, detection, the documented matrix and ``sglang-kvpub check-config``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_kvpub.engine import tree_cores

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/hbm-release.md"])
def test_documented_matrix_is_the_code_matrix(doc: str) -> None:
    text = (ROOT / doc).read_text()
    match = re.search(r"<!-- tree-core-matrix:start -->\n(.*?)\n<!-- tree-core-matrix:end -->", text, re.S)
    assert match is not None, f"{doc} has no tree-core matrix block"
    assert match.group(1) == tree_cores.markdown_matrix()


def test_prediction_follows_sglang_rule() -> None:
    env = tree_cores.BACKEND_ENV
    assert tree_cores.predict_core("cpu", {}) == tree_cores.RUST  # SGLang 0.5.23's default
    assert tree_cores.predict_core("cuda", {env: "rust"}) == tree_cores.RUST
    assert tree_cores.predict_core("npu", {}) == tree_cores.PYTHON  # the Rust core rejects npu
    assert tree_cores.predict_core("cuda", {env: "python"}) == tree_cores.PYTHON
    assert tree_cores.limits(tree_cores.PYTHON) == [] and len(tree_cores.limits(tree_cores.RUST)) == 2
    assert tree_cores.limit_line(tree_cores.PYTHON, "x") is None


def test_core_kind_by_class_without_touching_nodes() -> None:
    class UnifiedTreeCore:
        pass

    class RustUnifiedTreeCore:
        @property
        def root_node(self) -> None:
            raise NotImplementedError("root_node: not yet ported to the Rust tree core")

    RustUnifiedTreeCore.__module__ = "sglang.srt.mem_cache.rust_tree_core.adapter"

    class Cache:
        def __init__(self, core: object) -> None:
            self.tree_core = core

    assert tree_cores.core_kind(Cache(UnifiedTreeCore())) == tree_cores.PYTHON
    assert tree_cores.core_kind(Cache(RustUnifiedTreeCore())) == tree_cores.RUST


@pytest.mark.timeout(60)
def test_check_config_reports_the_core_and_fails_on_bad_keys() -> None:
    cmd = [sys.executable, "-m", "sglang_kvpub.cli", "check-config", "--kv-events-config"]
    env_rust = {tree_cores.BACKEND_ENV: "rust"}
    good = subprocess.run(
        [*cmd, '{"publisher": "zmq", "endpoint": "tcp://*:5557"}', "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**_env(), **env_rust},
    )
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    assert report["tree_core"]["core"] == "rust" and report["dp_dispatch"] == "cache_aware"
    assert any(limit.startswith("reconcile:") for limit in report["tree_core"]["limits"])
    text = subprocess.run(
        [*cmd, '{"publisher": "zmq"}', "--device", "npu"], capture_output=True, text=True, timeout=30, env=_env()
    )
    assert text.returncode == 0 and "tree core: python" in text.stdout and "for full HBM" not in text.stdout
    bad = subprocess.run(
        [*cmd, '{"publisher": "zmq", "dp_dispatch": "magic"}'], capture_output=True, text=True, timeout=30, env=_env()
    )
    assert bad.returncode == 2 and "dp_dispatch" in bad.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != tree_cores.BACKEND_ENV}
