"""CI's stage 1 runs exactly the README's commands, read from the README (scripts/readme_commands.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "readme_commands.py"
_spec = importlib.util.spec_from_file_location("readme_commands", SCRIPT)
assert _spec is not None and _spec.loader is not None
readme_commands = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_commands)


def test_the_readme_marks_install_main_and_test() -> None:
    commands = readme_commands.readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert list(commands) == ["install", "main", "test"]
    assert commands["install"].startswith("pip install -c constraints.txt ")
    assert "[motor" in commands["install"]
    assert commands["main"] == "sglang-kvpub demo"
    assert commands["test"].startswith("python -m pytest ")


def test_ci_runs_the_readme_commands_before_anything_else() -> None:
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    stage1 = run.index("scripts/readme_commands.py")
    assert stage1 < run.index("pip_install -c constraints.txt")  # before the full tiers' installs
    assert "for name in install main test" in run


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- readme-command: install -->\nno fence\n", "must open a fenced block"),
        ("<!-- readme-command: install -->\n```bash\npip install x\n", "never closed"),
        ("<!-- readme-command: install -->\n```bash\npip install x\npip install y\n```\n", "exactly one command"),
        ("<!-- readme-command: a -->\n```\nx\n```\n<!-- readme-command: a -->\n```\ny\n```\n", "twice"),
    ],
)
def test_a_badly_marked_command_is_an_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(readme_commands.ReadmeCommandError, match=message):
        readme_commands.readme_commands(text)


def test_comments_in_the_block_are_not_commands() -> None:
    text = "<!-- readme-command: test -->\n```bash\n# the tests\npython -m pytest -q\n```\n"
    assert readme_commands.readme_commands(text) == {"test": "python -m pytest -q"}


def test_the_cli_prints_one_command_or_names_what_is_missing(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, str(SCRIPT), "main"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == "sglang-kvpub demo"
    readme = tmp_path / "README.md"
    readme.write_text("<!-- readme-command: install -->\n```bash\npip install x\n```\n", encoding="utf-8")
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "test", "--readme", str(readme)], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "marks no readme-command 'test' (marked: install)" in bad.stderr
