"""A ``torchvision`` import hook for CPU-only SGLang processes (tests and the real-server tier).

Why a stand-in: every torchvision wheel on the index is CUDA-linked; with CPU torch its
import fails (``operator torchvision::nms does not exist``), and an unpinned install
replaces torch with the 4.5 GB CUDA build.  SGLang and transformers import torchvision at
module level but never call it for a text-only Llama.  Installed only when no real
torchvision is importable.  Used by bench/sglang_loader.py (in-process) and by
bench/cpu_shims/sitecustomize.py (server subprocesses); nothing in the product uses it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["install_torchvision_stub"]


class _AnyAttrModule(types.ModuleType):
    """A module whose every public attribute is a MagicMock (SGLang only references them)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        from unittest.mock import MagicMock

        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision[.x.y]`` import with a stub package that has a real spec
    (transformers calls ``find_spec("torchvision")`` and imports ``transforms.v2``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AnyAttrModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0+kvpub.stub"  # type: ignore[attr-defined]


def install_torchvision_stub() -> bool:
    """Installs the stub unless a torchvision is importable; True if the stub is active."""
    if any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        return True
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _TorchvisionStub())
    return True
