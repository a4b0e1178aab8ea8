"""bench/server.py's per-step probe, loaded into every process of a benched SGLang server.

Put first on the server's PYTHONPATH by bench/server.py only (the same for the server with
and without the plugin, so its own cost cancels out in the comparison).  In the scheduler
process it wraps ``Scheduler.get_next_batch_to_run`` and ``Scheduler.process_batch_result``
- the two parts of a scheduler step that run tree operations, event flushes and therefore
every per-step plugin hook - and records their thread CPU time per step (the model's
forward pass, ``run_batch``, is left out: identical with and without the plugin, and the
largest noise).  Samples (microseconds, one line per step) are appended to
``$KVPUB_PROBE_DIR/steps-<pid>.txt`` whenever the scheduler goes idle.

It then runs the next ``sitecustomize`` on sys.path (the CPU stand-ins' one), so both load.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path
from typing import Any

_TARGET = "sglang.srt.managers.scheduler"
_DIR = os.environ.get("KVPUB_PROBE_DIR")
_samples: list[int] = []
_pending = [0]


def _wrap(cls: Any) -> None:
    next_batch = cls.get_next_batch_to_run
    process = cls.process_batch_result
    on_idle = cls.on_idle
    clock = time.thread_time_ns

    def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        batch = next_batch(self, *args, **kwargs)
        if batch is not None:
            _pending[0] = clock() - start
        return batch

    def process_batch_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return process(self, *args, **kwargs)
        finally:
            _samples.append(_pending[0] + clock() - start)
            _pending[0] = 0

    def idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = on_idle(self, *args, **kwargs)
        if _samples:
            _flush()
        return result

    cls.get_next_batch_to_run = get_next_batch_to_run
    cls.process_batch_result = process_batch_result
    cls.on_idle = idle


def _flush() -> None:
    batch = _samples[:]
    del _samples[: len(batch)]
    assert _DIR is not None
    with open(Path(_DIR) / f"steps-{os.getpid()}.txt", "a") as out:
        out.write("".join(f"{ns / 1000:.2f}\n" for ns in batch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the scheduler class right after its module is executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _wrap(module.Scheduler)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _chain() -> None:
    """Runs the next sitecustomize.py on sys.path (only one module of that name is imported)."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "sitecustomize.py"
        if candidate.parent != here and candidate.is_file():
            code = compile(candidate.read_text(), str(candidate), "exec")
            exec(code, {"__name__": "sitecustomize_next", "__file__": str(candidate)})
            return


if _DIR:
    sys.meta_path.insert(0, _AfterImport())
_chain()
