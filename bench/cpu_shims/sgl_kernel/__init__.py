"""A CPU stand-in for ``sgl_kernel`` in the real-server test tier (README.md beside this package).

Every attribute and submodule resolves; calling any op raises NotImplementedError naming it.
``copy_all_layer_kv_cache_cpu`` has a plain fallback (the CPU engine moves KV slots with it).
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvpub.cpu.stand.in"


class _Missing:
    """A kernel that does not exist here: resolves, raises when called."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self.__name__}: no CPU build of sgl_kernel exists; this is the test tier's stand-in "
            "(tests/server/shims/README.md)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


def _module_getattr(module_name: str) -> Any:
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module_name}.{name}")

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel.<anything>`` imports as a module of missing kernels."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


sys.meta_path.append(_Submodules())
__getattr__ = _module_getattr(__name__)


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For every KV buffer (base pointer, bytes per slot): slot ``src_loc[i]`` -> ``tgt_loc[i]``."""
    pointers = [int(p) for p in data_ptrs.tolist()]
    widths = [int(s) for s in strides.tolist()]
    pairs = list(zip(src_loc.tolist(), tgt_loc.tolist(), strict=True))
    for base, width in zip(pointers, widths, strict=True):
        for src, tgt in pairs:
            if src != tgt:
                ctypes.memmove(base + int(tgt) * width, base + int(src) * width, width)
