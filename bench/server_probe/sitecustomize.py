"""bench/server.py's per-step probe, loaded into every process of a benched SGLang server.

Put first on the server's PYTHONPATH by bench/server.py only (the same for the server with
and without the plugin).  In the scheduler process it records, per scheduler step:

- ``step``: thread CPU time of ``Scheduler.get_next_batch_to_run`` +
  ``Scheduler.process_batch_result`` - the part of a step where tree operations, event
  flushes and every per-step plugin hook run (the forward pass, ``run_batch``, is left out:
  identical with and without the plugin, and the largest noise);
- ``plugin``: thread CPU time spent in the plugin's own code since the previous step - its
  publisher, release hooks and tracker - with the SGLang originals its AROUND hooks call
  taken out, so only what the plugin adds is counted;
- ``publisher``: thread CPU time in SGLang's own ``ZmqEventPublisher.publish`` (the plain
  server's per-step publisher cost, which the plugin's publisher replaces).

Samples (microseconds, ``step plugin publisher`` per line) are appended to
``$KVPUB_PROBE_DIR/steps-<pid>.txt`` whenever the scheduler goes idle; the idle hook's
calls and time, and the rank publisher's sender thread's CPU time (batches too big to send
inline go there), go to ``idle-<pid>.txt`` (``calls idle_us sender_us`` per flush).  Nested plugin
calls are counted once (a mode switch, not a stack of timers).

It then runs the next ``sitecustomize`` on sys.path (the CPU stand-ins' one), so both load.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DIR = os.environ.get("KVPUB_PROBE_DIR")
_clock = time.thread_time_ns
_samples: list[tuple[int, int, int]] = []
_pending = [0]


class _State:
    in_plugin = False
    mark = 0
    plugin_ns = 0  # since the last step sample
    publisher_ns = 0
    idle_calls = 0
    idle_ns = 0
    sender_ns = 0  # the rank publisher's sender thread (batches too big to send inline)


_st = _State()
# plugin entry -> [calls, plugin ns, max ns]; an entry called from SGLang code (a touch hook
# inside the original an outer hook wraps) is counted on its own and in the outer one too
_by_entry: dict[str, list[int]] = {}


def _count(name: str, spent: int) -> None:
    entry = _by_entry.get(name)
    if entry is None:
        entry = _by_entry[name] = [0, 0, 0]
    entry[0] += 1
    entry[1] += spent
    if spent > entry[2]:
        entry[2] = spent


def _set_mode(in_plugin: bool) -> bool:
    """Switch between plugin and SGLang time; returns the previous mode."""
    old = _st.in_plugin
    if old != in_plugin:
        now = _clock()
        if old:
            _st.plugin_ns += now - _st.mark
        _st.mark = now
        _st.in_plugin = in_plugin
    return old


def _as_plugin(func: Callable[..., Any]) -> Callable[..., Any]:
    name = func.__qualname__

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        before = _st.plugin_ns
        old = _set_mode(True)
        try:
            return func(*args, **kwargs)
        finally:
            _set_mode(old)
            if not old:
                _count(name, _st.plugin_ns - before)

    return timed


def _as_sglang(func: Callable[..., Any]) -> Callable[..., Any]:
    def untimed(*args: Any, **kwargs: Any) -> Any:
        old = _set_mode(False)
        try:
            return func(*args, **kwargs)
        finally:
            _set_mode(old)

    return untimed


def _around_as_plugin(hook: Callable[..., Any]) -> Callable[..., Any]:
    """An AROUND hook timed as plugin code, the SGLang original it calls excluded."""

    prefix = hook.__qualname__

    @functools.wraps(hook)
    def timed(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before = _st.plugin_ns
        old = _set_mode(True)
        try:
            return hook(_as_sglang(original), *args, **kwargs)
        finally:
            _set_mode(old)
            if not old:
                _count(f"{prefix}:{getattr(original, '__name__', '?')}", _st.plugin_ns - before)

    return timed


def _idle_timed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """The idle hook: counted apart from the steps."""

    @functools.wraps(hook)
    def timed(*args: Any, **kwargs: Any) -> Any:
        before = _st.plugin_ns
        old = _set_mode(True)
        try:
            return hook(*args, **kwargs)
        finally:
            _set_mode(old)
            _st.idle_ns += _st.plugin_ns - before
            _st.idle_calls += 1
            _st.plugin_ns = before

    return timed


def _wrap_scheduler(module: Any) -> None:
    cls = module.Scheduler
    next_batch = cls.get_next_batch_to_run
    process = cls.process_batch_result
    on_idle = cls.on_idle

    def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = _clock()
        batch = next_batch(self, *args, **kwargs)
        if batch is not None:
            _pending[0] = _clock() - start
        return batch

    def process_batch_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = _clock()
        try:
            return process(self, *args, **kwargs)
        finally:
            _samples.append((_pending[0] + _clock() - start, _st.plugin_ns, _st.publisher_ns))
            _pending[0] = _st.plugin_ns = _st.publisher_ns = 0

    def idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = on_idle(self, *args, **kwargs)
        if _samples:
            _flush()
        return result

    cls.get_next_batch_to_run = get_next_batch_to_run
    cls.process_batch_result = process_batch_result
    cls.on_idle = idle


def _wrap_sglang_publisher(module: Any) -> None:
    cls = module.ZmqEventPublisher
    publish = cls.publish

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = _clock()
        try:
            return publish(self, *args, **kwargs)
        finally:
            _st.publisher_ns += _clock() - start

    cls.publish = timed


def _wrap_release_hooks(module: Any) -> None:
    # Wrapped before install_release_hooks reads them (the hooks are registered by reference).
    for name in ("_take_hook", "_touch_hook", "_reset_hook"):
        setattr(module, name, _around_as_plugin(getattr(module, name)))
    module._OUTER_HOOKS = {cls: _around_as_plugin(hook) for cls, hook in module._OUTER_HOOKS.items()}
    module._COMPONENT_OUTER_HOOK = _around_as_plugin(module._COMPONENT_OUTER_HOOK)


def _wrap_reconcile(module: Any) -> None:
    module._idle_hook = _idle_timed(module._idle_hook)


def _wrap_plugin(module: Any) -> None:
    cls = module.KvPubEventPublisher
    cls.publish = _as_plugin(cls.publish)


def _wrap_rank_publisher(module: Any) -> None:
    drain = module.RankPublisher._drain

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = _clock()  # the sender thread's own CPU clock
        try:
            return drain(self, *args, **kwargs)
        finally:
            _st.sender_ns += _clock() - start

    module.RankPublisher._drain = timed


def _wrap_tracker(module: Any) -> None:
    # The Rust core's drift watch absorbs in its own wrapper of the recorder's take.
    module.Tracker.absorb = _as_plugin(module.Tracker.absorb)


_TARGETS: dict[str, Callable[[Any], None]] = {
    "sglang.srt.managers.scheduler": _wrap_scheduler,
    "sglang.srt.disaggregation.kv_events": _wrap_sglang_publisher,
    "sglang_kvpub.engine.release_hooks": _wrap_release_hooks,
    "sglang_kvpub.engine.reconcile": _wrap_reconcile,
    "sglang_kvpub.engine.plugin": _wrap_plugin,
    "sglang_kvpub.core.release_tracker": _wrap_tracker,
    "sglang_kvpub.publish.rank_publisher": _wrap_rank_publisher,
}


def _flush() -> None:
    batch = _samples[:]
    del _samples[: len(batch)]
    assert _DIR is not None
    with open(Path(_DIR) / f"steps-{os.getpid()}.txt", "a") as out:
        out.write("".join(f"{s / 1000:.2f} {p / 1000:.2f} {q / 1000:.2f}\n" for s, p, q in batch))
    with open(Path(_DIR) / f"entries-{os.getpid()}.txt", "w") as out:  # totals so far, diagnostic
        out.write("".join(f"{name} {c} {t / 1000:.1f} {m / 1000:.1f}\n" for name, (c, t, m) in _by_entry.items()))
    with open(Path(_DIR) / f"idle-{os.getpid()}.txt", "a") as out:
        out.write(f"{_st.idle_calls} {_st.idle_ns / 1000:.2f} {_st.sender_ns / 1000:.2f}\n")
    _st.idle_calls = _st.idle_ns = _st.sender_ns = 0


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps what ``_TARGETS`` names right after its module is executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        wrap = _TARGETS.get(fullname)
        if wrap is None:
            return None
        spec = None
        for finder in sys.meta_path:  # the next finder that knows it (an editable install has its own)
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            wrap(module)

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
