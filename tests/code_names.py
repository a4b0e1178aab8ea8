"""What the code defines, read from the code: each CLI's flags from its real argparse parser, the
environment variables it reads, the configuration keys of its settings dataclasses
(tests/docs/test_docs_truth.py checks the docs against them).  Nothing here is a list kept by hand:
a flag, variable or key added to the code is known here at once."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("sglang_kvpub", "motor_adapter", "bench", "scripts", "tests", "docker", ".ci")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _capture_parser() -> Iterator[None]:
    """Any ``parse_args`` raises with its parser: a CLI's real parser without running it."""

    def capture(self: argparse.ArgumentParser, *args: Any, **kw: Any) -> Any:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign,assignment]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved  # type: ignore[method-assign]


def _parser_of(run: Any, argv0: str) -> argparse.ArgumentParser | None:
    old_argv = sys.argv
    sys.argv = [argv0]
    try:
        with _capture_parser(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run()
    except _Captured as captured:
        return captured.parser
    except BaseException:  # a script that does more than parse first: not checked
        return None
    finally:
        sys.argv = old_argv
    return None


def _flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """The parser's flags (key ""), and each subcommand's (key: its name) with the root's."""
    root = {opt for action in parser._actions for opt in action.option_strings}
    found: dict[str, set[str]] = {"": set(root)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for key, flags in _flags(sub).items():
                    found[name if not key else f"{name} {key}"] = flags | root
    return found


def console_scripts() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M)
    assert section is not None, "pyproject.toml has no [project.scripts]"
    return dict(re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', section.group(1), re.M))


@cache
def program_flags() -> dict[str, dict[str, set[str]] | None]:
    """Program (as the docs invoke it) -> its flags by subcommand; None: not checkable here."""
    found: dict[str, dict[str, set[str]] | None] = {}
    for script, target in console_scripts().items():
        module_name, _, attr = target.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except Exception:  # an extra not installed: its flags are not checked
            found[script] = None
            continue
        parser = _parser_of(entry, script)
        found[script] = None if parser is None else _flags(parser)
        found[f"python -m {module_name}"] = found[script]
    for folder in ("bench", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
            found[f"python {folder}/{path.name}"] = _script_flags(path)
    found["python -m sglang.launch_server"] = sglang_flags()
    return found


def _script_flags(path: Path) -> dict[str, set[str]] | None:
    """A script's flags, read from its ``add_argument`` calls (running a bench script to get its
    parser could start servers): None when it defines none (not argparse: unchecked)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    flags = {"-h", "--help"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return {"": flags} if len(flags) > 2 else None


@cache
def sglang_flags() -> dict[str, set[str]] | None:
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # SGLang not installed (CI's README stage): its flags unchecked
        return None
    from sglang_kvpub.engine.plugin import add_plugin_argument

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_plugin_argument(parser)
    return _flags(parser)


def pip_install_flags() -> set[str]:
    """``pip install``'s long options (the docs name a few, ``--no-deps``): from pip's own parser, read
    in a child process - pip's internals import the stdlib's distutils, which then breaks
    setuptools' build of any later JIT extension in this process (SGLang's hash extension)."""
    probe = (
        "import json; from pip._internal.commands import create_command; p = create_command('install').parser; "
        "print(json.dumps(sorted({n for g in [p, *p.option_groups] for o in g.option_list for n in o._long_opts})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:  # pip's internals moved: those flags are then unchecked
        return set()
    return set(json.loads(done.stdout))


def _literals(path: Path) -> set[str]:
    if path.suffix == ".py":
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            return set()
        return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    try:
        return set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", path.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, OSError):
        return set()


@cache
def code_env_names() -> frozenset[str]:
    """Every environment variable name the code can read: its string literals (``"KVPUB_NATIVE"``,
    ``TOKEN_ENV = "..."``), the plugin keys' ``SGLANG_KVPUB_<KEY>``, and names the shell files set."""
    from sglang_kvpub.config import PLUGIN_KEYS, env_name

    names: set[str] = {env_name(key) for key in PLUGIN_KEYS}
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and (path.suffix in {".py", ".sh", ""} or path.name == "Dockerfile"):
                names |= {s for s in _literals(path) if re.fullmatch(r"[A-Z][A-Z0-9_]+", s)}
    return frozenset(names)


@cache
def external_env_names() -> frozenset[str] | None:
    """Upper-case string literals of the installed SGLang and Motor (None: neither installed)."""
    names: set[str] = set()
    roots = []
    for module in ("sglang", "motor"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
    if not roots:
        return None
    for root in roots:
        for path in root.rglob("*.py"):
            try:
                names |= set(re.findall(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']", path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    return frozenset(names)


def plugin_keys() -> set[str]:
    from sglang_kvpub.config import PluginConfig

    return {f.name for f in dataclasses.fields(PluginConfig)}


def adapter_keys() -> set[str]:
    """What ``motor-kv-adapter serve --config`` accepts (``ServiceConfig.from_mapping``)."""
    from motor_adapter.settings import ServiceConfig

    try:
        ServiceConfig.from_mapping({"__probe__": 1}, env={})
    except Exception as exc:  # its message lists the known keys
        known = re.search(r"\(known: ([^)]*)\)", str(exc))
        assert known is not None, str(exc)
        return {k.strip() for k in known.group(1).split(",")}
    raise AssertionError("ServiceConfig accepted an unknown key")


def affinity_keys() -> set[str]:
    from motor_adapter.scoring import KvAffinityConfig

    return {f.name for f in dataclasses.fields(KvAffinityConfig)}
