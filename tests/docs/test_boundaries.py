"""The package boundaries of docs/architecture.md, read from the source (every import statement,
lazy and ``TYPE_CHECKING`` ones included): who may import what, and no import cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sglang_kvpub", "motor_adapter")
# Engine-neutral code: none of these anywhere in it, not even lazily.
HEAVY = ("sglang", "torch", "zmq", "aiohttp")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement of ``module`` names (``from a import b``: a and a.b)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _project_module(name: str) -> str | None:
    """The longest project module ``name`` starts with (a name inside a module -> that module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


IMPORTS = {module: sorted(set(_imported_names(module, path))) for module, path in MODULES.items()}
GRAPH = {
    module: {dep for dep in map(_project_module, names) if dep is not None and dep != module}
    for module, names in IMPORTS.items()
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _offences(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{module} imports {name}"
        for module, names in IMPORTS.items()
        if any(_within(module, p) for p in packages)
        for name in names
        if any(_within(name, f) for f in forbidden)
    ]


def test_the_walk_sees_the_packages_and_their_imports() -> None:
    # Guards the checks below against passing on an empty or mis-parsed tree.
    for package in ("sglang_kvpub.core", "sglang_kvpub.wire", "sglang_kvpub.engine", "motor_adapter.service"):
        assert package in MODULES
    assert "sglang_kvpub.core.index" in GRAPH["sglang_kvpub.core.dispatch"]
    assert any(_within(name, "sglang") for name in IMPORTS["sglang_kvpub.engine.dispatch_hook"])
    assert "zmq" in IMPORTS["motor_adapter.stream"]


def test_core_and_wire_import_no_engine_transport_or_web_library() -> None:
    assert _offences(("sglang_kvpub.core", "sglang_kvpub.wire"), HEAVY) == []


def test_the_simulators_cache_model_stays_out_of_the_production_core() -> None:
    # bench/routing.py and the demo's simulator model a rank's cache; neither half runs it
    assert "sglang_kvpub.tools.sim_cache" in MODULES
    assert not any(_within(name, "sglang_kvpub.core.sim_cache") for name in MODULES)
    users = {module for module, deps in GRAPH.items() if "sglang_kvpub.tools.sim_cache" in deps}
    assert users and all(_within(module, "sglang_kvpub.tools") for module in users), users


def test_core_imports_only_core_and_the_wire_contract() -> None:
    outside = [
        f"{module} imports {dep}"
        for module, deps in GRAPH.items()
        if _within(module, "sglang_kvpub.core")
        for dep in deps
        if not (_within(dep, "sglang_kvpub.core") or _within(dep, "sglang_kvpub.wire") or dep == "sglang_kvpub")
    ]
    assert outside == []


def test_the_wire_contract_imports_nothing_of_the_project() -> None:
    outside = [
        f"{module} imports {dep}"
        for module, deps in GRAPH.items()
        if _within(module, "sglang_kvpub.wire")
        for dep in deps
        if not (_within(dep, "sglang_kvpub.wire") or dep == "sglang_kvpub")
    ]
    assert outside == []


def test_motor_adapter_never_imports_the_engine_edge_sglang_or_torch() -> None:
    assert _offences(("motor_adapter",), ("sglang_kvpub.engine", "sglang_kvpub.plugin", "sglang", "torch")) == []


def test_only_the_engine_package_imports_sglang() -> None:
    outside_engine = [
        f"{module} imports {name}"
        for module, names in IMPORTS.items()
        if not _within(module, "sglang_kvpub.engine")
        for name in names
        if _within(name, "sglang")
    ]
    assert outside_engine == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_project_modules() -> None:
    assert _cycles(GRAPH) == []
