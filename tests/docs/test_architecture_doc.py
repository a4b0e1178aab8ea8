"""docs/architecture.md draws and lists every module of both packages, and no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("sglang_kvpub", "motor_adapter")


def _modules() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def _drawing(text: str) -> str:
    """The first fenced block: the drawing of the folders and their modules."""
    match = re.search(r"^```\n(.*?)^```", text, re.S | re.M)
    assert match, "docs/architecture.md has no drawing"
    return match.group(1)


def _listed(text: str) -> set[str]:
    """The paths of the "Every module" table's first column."""
    section = text.split("## Every module", 1)
    assert len(section) == 2, 'docs/architecture.md has no "## Every module" section'
    body = section[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", body, re.M))


def test_the_module_walk_sees_both_packages() -> None:
    modules = _modules()
    assert "sglang_kvpub/wire/contract.py" in modules and "motor_adapter/service.py" in modules


def test_every_module_is_listed_and_every_listed_module_exists() -> None:
    modules, listed = _modules(), _listed(DOC.read_text())
    assert not modules - listed, f"not in docs/architecture.md's module table: {sorted(modules - listed)}"
    assert not listed - modules, f"listed in docs/architecture.md but gone: {sorted(listed - modules)}"


def test_every_module_is_drawn() -> None:
    drawn = set(re.findall(r"\w+", _drawing(DOC.read_text())))
    missing = sorted(module for module in _modules() if Path(module).stem not in drawn)
    assert not missing, f"not in docs/architecture.md's drawing: {missing}"
