"""The plugin installs the HBM-release hooks and idle-time reconciliation in scheduler processes only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TESTS = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: real SGLang tree classes (loaded through sglang_real),
# SGLang's real HookRegistry, the plugin enabled through its env var.
_CHILD = """
import json, sys, types
sys.path[:0] = [{tests!r}, {root!r}]
import sglang_real
sglang_real.load_radix_cache()
if {scheduler}:
    sys.modules.setdefault("sglang.srt.managers.scheduler", types.ModuleType("sglang.srt.managers.scheduler"))
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_kvpub.engine import plugin
plugin.register()
print(json.dumps(sorted(HookRegistry._hooks)))
"""


def _registered_targets(scheduler: bool) -> list[str]:
    env = {**os.environ, "SGLANG_KVPUB_ENABLED": "1"}
    code = _CHILD.format(tests=str(TESTS), root=str(TESTS.parent), scheduler=scheduler)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def test_scheduler_process_gets_release_hooks_and_reconciliation() -> None:
    from sglang_kvpub.engine.reconcile import IDLE_TARGET

    targets = _registered_targets(scheduler=True)
    assert IDLE_TARGET in targets
    release = [t for t in targets if t.startswith("sglang.srt.mem_cache.")]
    assert any(t.endswith(".take") for t in release), targets
    assert len(release) >= 3


def test_other_processes_do_not_hook_the_tree() -> None:
    from sglang_kvpub.engine.reconcile import IDLE_TARGET

    targets = _registered_targets(scheduler=False)
    assert IDLE_TARGET not in targets
    assert not [t for t in targets if t.startswith("sglang.srt.mem_cache.")]
