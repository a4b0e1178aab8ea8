"""The docs stay true: every metric name, CLI flag, environment variable and configuration key
that README.md, CHANGELOG.md and docs/ name is one the code defines, and every shipped example
(docs/examples/) passes the command the docs give beside it.

What the code defines is read from the code, never listed here: the flags from the real
argparse parsers (every console script of pyproject.toml, ``python bench/X.py`` and
``python scripts/X.py``, SGLang's own ``launch_server`` parser when SGLang is installed, with
the plugin's ``--plugin``), the metric names from the ``/metrics`` of a running adapter, the
environment variables from the string literals of the code, the configuration keys from the
settings dataclasses.  A failing test lists every finding, one a line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import code_names
import pytest
from code_names import (
    adapter_keys,
    affinity_keys,
    code_env_names,
    console_scripts,
    external_env_names,
    pip_install_flags,
    plugin_keys,
    program_flags,
    sglang_flags,
)

ROOT = code_names.ROOT
# Prefixes of the environment variables this project reads: a name with one must be defined here.
OWN_ENV = re.compile(r"\b((?:SGLANG_KVPUB|MOTOR_KV_ADAPTER|KVPUB)_[A-Z0-9_]*[A-Z0-9])\b(?!\*)")
# Operating system and tool variables a command line may set (not this project's, not SGLang's).
OS_ENV = {"PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "TMPDIR"}
OS_ENV_PREFIXES = (
    "XDG_",
    "OMP_",
    "HF_",
    "TRANSFORMERS_",
    "CUDA_",
    "ASCEND_",
    "NCCL_",
    "HCCL_",
    "PIP_",
    "MC_",
    "MALLOC_",
    "GLIBC_",
)
METRIC = re.compile(r"\bmotor_kv_adapter_[a-z0-9_]*[a-z0-9]\b")
# Placeholder file names the docs use for the operator's own copy of a shipped example.
PLACEHOLDERS = {
    "user_config.json": "docs/examples/motor_user_config.json",
    "env.json": "docs/examples/motor_env_config.json",
    "adapter_config.json": "docs/examples/adapter_config.json",
}


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------------ the docs


def code_spans(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, code, is a fenced block's line) for inline code and fenced blocks, a fenced
    line joined with its backslash continuations."""
    in_fence = False
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending.append(line.rstrip()[:-1])
                continue
            pending.append(line)
            yield start, " ".join(p.strip() for p in pending), True
            pending = []
        else:
            for match in re.finditer(r"``?([^`]+)``?", line):
                yield number, match.group(1), False


def _commands(code: str) -> Iterator[list[str]]:
    """Each simple command of a shell line, as words (comments, pipes and redirections cut)."""
    try:
        lexer = shlex.shlex(code, posix=True, punctuation_chars="|&;<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote in prose: not a command
        return
    current: list[str] = []
    for word in words:
        if word and set(word) <= set("|&;<>"):
            if current:
                yield current
            current = []
        else:
            current.append(word)
    if current:
        yield current


# ------------------------------------------------------------------------------------ the checks


def _program(words: list[str]) -> tuple[str, list[str]] | None:
    """The program a command runs (as :func:`program_flags` names it) and the rest of its words."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value prefixes
    if not words:
        return None
    programs = program_flags()
    if words[0] in programs:
        return words[0], words[1:]
    if re.fullmatch(r"python3?", words[0]) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and f"python -m {words[2]}" in programs:
            return f"python -m {words[2]}", words[3:]
        if f"python {words[1]}" in programs:
            return f"python {words[1]}", words[2:]
    return None


def _flag_problem(program: str, rest: list[str], where: str) -> list[str]:
    flags = program_flags()[program]
    if flags is None:
        return []
    sub = ""
    for word in rest:
        if word.startswith("-"):
            break
        if (f"{sub} {word}".strip()) in flags:
            sub = f"{sub} {word}".strip()
        else:
            break
    known = flags.get(sub, flags[""])
    problems = []
    for word in rest:
        flag = word.split("=", 1)[0]
        if re.fullmatch(r"--[a-z0-9][a-z0-9-]*", flag) and flag not in known:
            problems.append(f"{where}: `{program}{' ' + sub if sub else ''}` has no flag {flag}")
    return problems


def flag_findings() -> list[str]:
    problems: list[str] = []
    all_known: set[str] = pip_install_flags()
    checkable = sglang_flags() is not None  # without SGLang's parser a flag alone may be one of its
    for flags in program_flags().values():
        for names in (flags or {}).values():
            all_known |= names
    for path in doc_files():
        for number, code, _fenced in code_spans(path.read_text(encoding="utf-8")):
            where = f"{_rel(path)}:{number}"
            for words in _commands(code):
                found = _program(words)
                if found is not None:
                    problems += _flag_problem(*found, where)
            # a flag named alone in prose: some parser of ours (or SGLang's) must define it
            alone = re.fullmatch(r"(--[a-z0-9][a-z0-9-]*)(?:[ =].*)?", code.strip())
            if alone and checkable and alone.group(1) not in all_known:
                problems.append(f"{where}: flag {alone.group(1)} is defined by no parser of the project or SGLang")
    return sorted(set(problems))


def env_findings() -> list[str]:
    problems: list[str] = []
    own = code_env_names()
    external = external_env_names()
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{_rel(path)}:{number}"
            for name in OWN_ENV.findall(line):
                if name not in own:
                    problems.append(f"{where}: environment variable {name} is read nowhere in the code")
        for number, code, _fenced in code_spans(text):
            where = f"{_rel(path)}:{number}"
            for name in re.findall(r"(?:^|\s|export\s+)([A-Z][A-Z0-9_]+)=", code):
                if name in own or name in OS_ENV or name.startswith(OS_ENV_PREFIXES) or OWN_ENV.fullmatch(name):
                    continue
                if external is not None and name not in external:
                    problems.append(f"{where}: environment variable {name} is read here nor by SGLang or Motor")
    return sorted(set(problems))


def metric_findings(exposition: str) -> list[str]:
    from conftest import metric_names

    exported = metric_names(exposition)
    suffixes = {name[len("motor_kv_adapter_") :] for name in exported}
    config_names = plugin_keys() | adapter_keys() | affinity_keys()  # a key's name is not a metric's
    problems: list[str] = []
    for path in doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{_rel(path)}:{number}"
            for name in METRIC.findall(line):
                if name not in exported:
                    problems.append(f"{where}: metric {name} is not in the adapter's /metrics")
            for short in re.findall(r"`\.\.\._([a-z0-9_]+)", line):
                problems.append(f"{where}: `..._{short}` shortens a metric name: write it whole")
            # a metric named by a shortened name: the operator cannot find it in Prometheus
            for short, labels, value in re.findall(r"`([a-z][a-z0-9]*_[a-z0-9_]*)(\{[^`]*\})?(\s[0-9.]+)?`", line):
                if short in exported or f"motor_kv_adapter_{short}" in exported or short in config_names:
                    continue
                full = sorted(s for s in suffixes if s.endswith(("_" + short, "_" + short + "_total")) or s == short)
                if full and (labels or value or re.search(r"/metrics|metric|[Ww]atch", line)):
                    problems.append(f"{where}: `{short}` shortens the metric motor_kv_adapter_{full[0]}")
    return sorted(set(problems))


def _table_keys(text: str, heading: str) -> list[str]:
    """The first column's backticked names (one or several per row) of the first table under ``heading``."""
    section = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    if section is None:
        return []
    cells = re.findall(r"^\| ((?:`[a-z_][a-z0-9_.]*`(?:, )?)+) \|", section.group(1), re.M)
    return [name for cell in cells for name in re.findall(r"`([a-z_][a-z0-9_.]*)`", cell)]


def config_findings() -> list[str]:
    from sglang_kvpub.config import SGLANG_KEYS, env_name

    problems: list[str] = []
    path = ROOT / "docs" / "config.md"
    text = path.read_text(encoding="utf-8")
    plugin = plugin_keys()
    documented_plugin = set(_table_keys(text, "Plugin keys"))
    documented_sglang = set(_table_keys(text, "SGLang's keys (`--kv-events-config`)"))
    documented_adapter = set(_table_keys(text, "Adapter settings (`motor-kv-adapter serve --config`)"))
    for key in sorted(plugin - set(SGLANG_KEYS) - documented_plugin):
        problems.append(f"docs/config.md: plugin key {key} ({env_name(key)}) is not in its Plugin keys table")
    for key in sorted(documented_plugin - plugin):
        problems.append(f"docs/config.md: Plugin keys table names {key}, which PluginConfig does not have")
    for key in sorted(documented_sglang - set(SGLANG_KEYS)):
        problems.append(f"docs/config.md: SGLang keys table names {key}, which SGLang's KVEventsConfig has not")
    from sglang_kvpub.engine.plugin import ENABLED_ENV

    if ENABLED_ENV not in text:
        problems.append(f"docs/config.md: {ENABLED_ENV} (the plugin's switch outside the launcher) is not documented")
    adapter = adapter_keys()
    for key in sorted(adapter - documented_adapter):
        problems.append(f"docs/config.md: adapter setting {key} is not in its Adapter settings table")
    for key in sorted(documented_adapter - adapter):
        problems.append(f"docs/config.md: Adapter settings table names {key}, which the adapter refuses")
    affinity = affinity_keys()
    for doc in doc_files():
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for key in re.findall(r"\bkv_affinity\.([a-z_][a-z0-9_]*)", line):
                if key not in affinity:
                    problems.append(f"{_rel(doc)}:{number}: kv_affinity.{key} is not a kv_affinity setting")
    return sorted(set(problems))


def _run_documented(words: list[str], env_prefix: dict[str, str]) -> subprocess.CompletedProcess[str]:
    program, rest = words[0], words[1:]
    target = console_scripts()[program]
    module_name = target.partition(":")[0]
    argv = [sys.executable, "-m", module_name, *[PLACEHOLDERS.get(w, w) for w in rest]]
    env = {**os.environ, **env_prefix}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def example_findings() -> tuple[list[str], set[str]]:
    """Runs every documented ``check-config`` of a shipped example (or of the operator's copy of
    one: user_config.json, env.json); returns the problems and the examples so checked."""
    problems: list[str] = []
    checked: set[str] = set()
    seen: set[str] = set()
    for path in doc_files():
        for number, code, _fenced in code_spans(path.read_text(encoding="utf-8")):
            for words in _commands(code):
                env_prefix = {}
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    name, _, value = words[0].partition("=")
                    env_prefix[name] = "127.0.0.1" if value.startswith("<") else value
                    words = words[1:]
                if len(words) < 3 or words[0] not in console_scripts() or words[1] != "check-config":
                    continue
                if words[0] != "motor-kv-adapter" or "..." in " ".join(words):
                    continue  # elided command lines show a shape, not a run
                files = [PLACEHOLDERS.get(w, w) for w in words[2:] if w.endswith(".json")]
                if not files or not all((ROOT / f).is_file() and f.startswith("docs/examples/") for f in files):
                    continue
                key = " ".join(f"{k}={v}" for k, v in env_prefix.items()) + " " + " ".join(words)
                if key in seen:
                    continue
                seen.add(key)
                result = _run_documented(words, env_prefix)
                checked.update(files)
                where = f"{_rel(path)}:{number}"
                if result.returncode != 0:
                    last = (result.stdout + result.stderr).strip().splitlines()
                    problems.append(f"{where}: `{key.strip()}` exits {result.returncode}: {' | '.join(last[-3:])}")
    return problems, checked


def example_files_findings() -> list[str]:
    """The examples no command runs are read as what consumes them reads them."""
    from motor_adapter.registration import parse_registration
    from motor_adapter.settings import ServiceConfig

    problems: list[str] = []
    for path in sorted((ROOT / "docs" / "examples").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        try:
            if path.name.startswith("register_"):
                parse_registration(data)  # what POST /register does with it
            elif path.name == "adapter_config.json":
                ServiceConfig.from_mapping(data, env={})  # what `serve --config` does with it
        except Exception as exc:  # every refusal is a finding
            problems.append(f"docs/examples/{path.name}: refused: {exc}")
    return problems


# ------------------------------------------------------------------------------------- the tests

pytestmark = pytest.mark.integration


def _none(findings: list[str]) -> None:
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings)


def test_every_flag_the_docs_name_is_defined() -> None:
    _none(flag_findings())


def test_every_environment_variable_the_docs_name_is_read() -> None:
    _none(env_findings())


def test_every_metric_the_docs_name_is_exported(exported_metrics: str) -> None:
    from sglang_kvpub.core import hashing

    if hashing.NATIVE is None:
        pytest.skip("without the C helpers the adapter exports no /query prefix-memo metrics (docs/native.md)")
    _none(metric_findings(exported_metrics))


def test_every_config_key_the_docs_name_is_defined() -> None:
    _none(config_findings())


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # no headings inside code
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def link_findings() -> list[str]:
    """Every relative link of the docs names a file that exists, and an anchor its headings make."""
    problems = []
    for path in doc_files():
        text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{_rel(path)}: link {target} names no file")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{_rel(path)}: link {target} names no heading of {resolved.name}")
    return problems


def test_every_relative_link_resolves() -> None:
    _none(link_findings())


HISTORY = re.compile(r"\b(?:issues? #?\d+|#\d{2,}\b|sessions? \d+|[Ii]ssue \d+'s)")


def history_findings() -> list[str]:
    """Docs say what is, not how it came to be: no issue or session numbers."""
    problems = []
    for path in doc_files():
        if path.name == "CHANGELOG.md":
            continue  # the one place for history
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for found in HISTORY.findall(line):
                problems.append(f"{_rel(path)}:{number}: history in the docs: {found!r}")
    return problems


def test_docs_carry_no_history() -> None:
    _none(history_findings())


# In the code an issue or session number is history wherever it stands, comment or string; an
# upstream project's "#N" is a fact and a CLI's ``--sessions N`` a flag, so neither is matched.
CODE_HISTORY = re.compile(r"(?<![-\w])(?:[Ii]ssues? #?\d+|[Ss]essions? \d+)")
CODE_SUFFIXES = {".py", ".c", ".h", ".sh", ".cfg", ".toml"}


def code_history_findings() -> list[str]:
    """Comments say why, not how the code came to be: no issue or session numbers in the
    packages' source (Python and C) or CI's scripts."""
    files = [
        *(f for package in ("sglang_kvpub", "motor_adapter") for f in sorted((ROOT / package).rglob("*"))),
        *sorted((ROOT / ".ci").glob("*")),
    ]
    problems = []
    for path in files:
        if not path.is_file() or (path.suffix not in CODE_SUFFIXES and path.parent.name != ".ci"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for found in CODE_HISTORY.findall(line):
                problems.append(f"{_rel(path)}:{number}: history in the code: {found!r}")
    return problems


def test_code_carries_no_history() -> None:
    _none(code_history_findings())


def test_the_code_history_check_sees_history_and_spares_facts() -> None:
    """The pattern finds what it is for and leaves upstream references and flags alone."""
    assert CODE_HISTORY.findall("# kept for issue 32's fix; see Issue #21 and session 19")
    for fact in ("# SGLang #34407 asks for it", "bench/routing.py --sessions 1200", "a tissue 3"):
        assert not CODE_HISTORY.findall(fact), fact


def test_every_shipped_example_passes_its_documented_command() -> None:
    problems, checked = example_findings()
    _none(problems + example_files_findings())
    for example in ("docs/examples/motor_user_config.json", "docs/examples/motor_env_config.json"):
        assert example in checked, f"no documented check-config runs {example}"
