"""The README's own commands, read from the README: what `.ci/run` runs first, in a clean venv.

The README marks each command a new user types with an HTML comment right above its fenced
block (invisible when rendered)::

    <!-- readme-command: install -->
    ```bash
    pip install ...
    ```

`python scripts/readme_commands.py install` prints that block's command (one line);
`--list` prints every marked name.  A missing marker, a marker without a fenced block under it,
or a block of more than one command is an error naming the marker: CI must run exactly what
the README says, so it never guesses.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_MARKER = re.compile(r"^<!-- readme-command: ([a-z0-9_-]+) -->\s*$")


class ReadmeCommandError(ValueError):
    """The README does not mark the command asked for in the expected shape."""


def readme_commands(text: str) -> dict[str, str]:
    """Every marked command of a README text, by name, in the order they appear."""
    lines = text.splitlines()
    commands: dict[str, str] = {}
    for i, line in enumerate(lines):
        match = _MARKER.match(line)
        if match is None:
            continue
        name = match.group(1)
        if name in commands:
            raise ReadmeCommandError(f"README marks readme-command {name!r} twice")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ReadmeCommandError(f"readme-command {name!r}: the line under the marker must open a fenced block")
        body: list[str] = []
        for inner in lines[i + 2 :]:
            if inner.startswith("```"):
                break
            if inner.strip() and not inner.lstrip().startswith("#"):
                body.append(inner.strip())
        else:
            raise ReadmeCommandError(f"readme-command {name!r}: its fenced block is never closed")
        if len(body) != 1:
            raise ReadmeCommandError(
                f"readme-command {name!r}: its block must hold exactly one command, found {len(body)}"
            )
        commands[name] = body[0]
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help="the marker's name: install, main, test")
    parser.add_argument("--list", action="store_true", help="print every marked name")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    try:
        commands = readme_commands(args.readme.read_text(encoding="utf-8"))
        if args.list:
            print("\n".join(commands))
            return 0
        if args.name is None:
            parser.error("name a command (or --list)")
        if args.name not in commands:
            raise ReadmeCommandError(
                f"{args.readme} marks no readme-command {args.name!r} (marked: {', '.join(commands) or 'none'})"
            )
    except (OSError, ReadmeCommandError) as exc:
        print(f"readme_commands: {exc}", file=sys.stderr)
        return 2
    print(commands[args.name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
