"""`pip install 'sglang-kvpub[motor]'` carries everything the adapter needs at run time.

A Motor host installs the router half with the `motor` extra and nothing else (README, "In
production").  Every third-party module the adapter's code imports - at module level or lazily
inside a function - must come from a distribution in the dependency closure of
`sglang-kvpub[motor]`, and so must the modules a dependency loads on the adapter's behalf
without requiring them itself (transformers renders chat templates with jinja2 but does not
depend on it: a Motor host without it could not tokenize a chat request).

This runs in CI's stage 1 too: the README's own install (`.[motor,test]`) in a clean venv.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from motor_adapter.tokenize import encode_request, load_tokenizer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OUR_PACKAGES = {"motor_adapter", "sglang_kvpub"}
# What runs in the router's process: the adapter, and the parts of the plugin package it imports
# (the engine edge, publish and tools run beside SGLang, not on a Motor host).
ROUTER_CODE = ("motor_adapter", "sglang_kvpub/core", "sglang_kvpub/wire", "sglang_kvpub/transport")
# Modules the adapter's code imports that are NOT part of the router's runtime, with the reason.
NOT_RUNTIME = {
    # motor_adapter/tools/motor_coordinator.py starts Motor's own coordinator for tests and benches;
    # on a Motor host Motor is already there.
    "motor": "Motor itself (tools/motor_coordinator.py: the test and bench launcher)",
}
# Loaded by a dependency on the adapter's behalf, without that dependency requiring it.
LOADED_FOR_US = {"jinja2": "transformers' apply_chat_template (motor_adapter/tokenize.py: chat requests)"}


def _imported_top_level(package: Path) -> dict[str, str]:
    """Top-level module names imported anywhere in a package's source -> the first file importing it."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def _third_party(names: dict[str, str]) -> dict[str, str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return {n: where for n, where in names.items() if n not in stdlib and n not in OUR_PACKAGES}


def _closure(dist: str, extras: frozenset[str]) -> set[str]:
    """Normalised names of `dist` and every distribution it needs with `extras`, transitively."""
    names: set[str] = set()
    done: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(dist, extras)]
    while todo:
        name, want = todo.pop()
        key = _normalise(name)
        if (key, want) in done:
            continue
        done.add((key, want))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # excluded by a marker on this platform, or optional: nothing needs it here
        names.add(key)
        for text in requires:
            req = Requirement(text)
            envs = [{"extra": e} for e in want] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return names


def _distributions_of(module: str) -> set[str]:
    return {_normalise(d) for d in md.packages_distributions().get(module, [])}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_scan_sees_the_adapters_lazy_imports() -> None:
    """The scan must find imports made inside functions (transformers is imported lazily)."""
    imported = _third_party(_imported_top_level(ROOT / "motor_adapter"))
    assert {"aiohttp", "transformers", "zmq", "msgspec"} <= set(imported)


def test_every_runtime_import_of_the_adapter_comes_with_the_motor_extra() -> None:
    needed = _closure("sglang-kvpub", frozenset({"motor"}))
    imported: dict[str, str] = {}
    for folder in ROUTER_CODE:
        imported = {**_third_party(_imported_top_level(ROOT / folder)), **imported}
    missing = []
    for module, where in sorted({**imported, **dict.fromkeys(LOADED_FOR_US, "a dependency")}.items()):
        if module in NOT_RUNTIME:
            continue
        dists = _distributions_of(module)
        if not dists & needed:
            missing.append(f"{module} (imported by {where}; from {sorted(dists) or 'no installed distribution'})")
    assert not missing, "not installed by `pip install 'sglang-kvpub[motor]'`: " + "; ".join(missing)


def test_jinja2_is_declared_by_the_motor_extra_itself() -> None:
    """transformers does not require jinja2: only our extra can bring it."""
    declared = [Requirement(r) for r in md.requires("sglang-kvpub") or []]
    motor = {r.name.lower() for r in declared if r.marker is not None and r.marker.evaluate({"extra": "motor"})}
    assert {"aiohttp", "transformers", "jinja2", "msgpack"} <= motor
    assert "jinja2" not in _closure("transformers", frozenset())


def test_a_chat_request_tokenizes_with_the_motor_extra(tmp_path: Path) -> None:
    """What a Motor host does with `messages`: render the model's chat template, then encode."""
    assert importlib.util.find_spec("jinja2") is not None
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|user|>": 1, "<|assistant|>": 2, "hello": 3, "router": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}<|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"unk_token": "<unk>", "chat_template": template}), encoding="utf-8"
    )
    tok = load_tokenizer(str(tmp_path))
    ids = encode_request(tok, {"messages": [{"role": "user", "content": "hello router"}]})
    assert ids == [1, 3, 4, 2]
