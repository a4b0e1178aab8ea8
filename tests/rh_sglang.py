"""Load SGLang 0.5.23's real tree caches on this CPU-only machine (release-hook tests, bench).

SGLang is installed ``--no-deps`` next to CPU torch.  ``sglang/__init__`` reaches
``sglang.srt.utils.common`` which imports a few third-party modules at top level that the
tree cache never uses (orjson, pybase64, requests, triton, starlette, IPython) and
``transformers`` probes ``torchvision`` (CUDA-only wheels).  Every such module that does
not import here is replaced by a stand-in whose attributes are MagicMocks; torchvision
always is.  The tree cache code itself is SGLang's, unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any
from unittest import mock

STANDIN_CANDIDATES = ("orjson", "pybase64", "requests", "triton", "starlette", "IPython")
ALWAYS_STANDIN = ("torchvision",)

_installed: list[str] | None = None


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "0.28.0"  # type: ignore[attr-defined]  # transformers parses it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        return False
    return True


def prepare() -> list[str]:
    """Install the stand-ins (once); returns the stood-in top-level modules."""
    global _installed
    if _installed is None:
        tops = set(ALWAYS_STANDIN) | {name for name in STANDIN_CANDIDATES if not _importable(name)}
        sys.meta_path.insert(0, _Finder(tops))
        _installed = sorted(tops)
    return _installed


def available() -> str | None:
    """None when SGLang and torch are installed, else why not."""
    for name in ("sglang", "torch"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    return None


def radix_cache_module() -> Any:
    prepare()
    return importlib.import_module("sglang.srt.mem_cache.radix_cache")


def base_prefix_cache_module() -> Any:
    prepare()
    return importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
