"""Loading the real SGLang 0.5.23 modules on this CPU-only test machine (used by test_plugin.py).

SGLang is installed ``--no-deps``; two ways in, both run SGLang's own code unchanged:

- ``light()``: ``sglang`` and ``sglang.srt.utils`` become bare packages (their heavy
  ``__init__`` skipped), so ``sglang.srt.plugins`` and ``sglang.srt.disaggregation.kv_events``
  import with only msgspec/pyzmq/pydantic/psutil (well under a second, no torch).
- ``full()``: the real ``sglang/__init__`` with CPU torch; the few third-party modules
  ``sglang.srt.utils.common`` imports at top level but never uses on the paths tested here
  (orjson, pybase64, requests, triton, starlette, IPython) are stand-ins *only when not
  installed*.  Enough for ``sglang.launch_server``, ``prepare_server_args`` and
  ``describe_kv_events_publisher``.

Subprocess scripts do ``sys.path.insert(0, TESTS_DIR); import plugin_sglang_env as e; e.full()``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any
from unittest import mock

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
FULL_STANDINS = ("orjson", "pybase64", "requests", "triton", "starlette", "IPython")


def sglang_dir() -> str | None:
    spec = importlib.util.find_spec("sglang")
    return None if spec is None or spec.origin is None else os.path.dirname(spec.origin)


def light(server_args_placeholder: bool = False) -> None:
    """Bare ``sglang`` packages; optionally a placeholder ``sglang.srt.server_args``.

    The real server_args needs torch (seconds per process).  Rank-process tests that never
    parse arguments use the placeholder so the plugin's CLI hooks have a cheap target.
    """
    root = sglang_dir()
    if root is None:
        raise ImportError("sglang is not installed")
    for name, sub in (("sglang", ""), ("sglang.srt.utils", "srt/utils")):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = module
    if server_args_placeholder:
        placeholder = types.ModuleType("sglang.srt.server_args")
        placeholder.ServerArgs = _PlaceholderServerArgs  # type: ignore[attr-defined]
        sys.modules["sglang.srt.server_args"] = placeholder


class _PlaceholderServerArgs:
    @staticmethod
    def add_cli_args(parser: Any) -> None:
        raise AssertionError("placeholder: argument parsing is not part of this test")

    @classmethod
    def from_cli_args(cls, args: Any) -> Any:
        raise AssertionError("placeholder: argument parsing is not part of this test")


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def full() -> list[str]:
    """Stand-ins for the missing modules of FULL_STANDINS; returns which were stood in."""
    missing = {name for name in FULL_STANDINS if importlib.util.find_spec(name) is None}
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    return sorted(missing)


def full_loads() -> bool:
    """Whether ``full()`` can reach sglang.srt.server_args here (checked in a subprocess by tests)."""
    return sglang_dir() is not None and importlib.util.find_spec("torch") is not None
