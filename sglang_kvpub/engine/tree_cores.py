"""Which radix tree core a rank runs, and what the plugin can guarantee on it.

SGLang 0.5.23 ships three tree shapes (docs/hbm-release.md, "Tree cores"):

- ``legacy``: ``RadixCache`` (and ``PureSWARadixCache`` for all-SWA models), Python nodes.
- ``python``: ``UnifiedRadixCache`` over the Python ``UnifiedTreeCore``, Python nodes.
- ``rust``: ``UnifiedRadixCache`` over ``RustUnifiedTreeCore``.  Nodes live in the Rust
  extension: ``root_node`` and ``node_by_id`` raise NotImplementedError, nothing hands out
  a node's token ids, and the event recorder is a thin reader of the extension's queue
  (``take`` only).  What it does expose: its own ``BlockStored``/``BlockRemoved`` events
  (``take_events``) and O(1) size counters per component.

So on the Rust core the plugin keeps HBM truth through what the core exposes: every
event the core emits goes out, the announced state is followed from those events and
compared with the core's Full device counters when the rank is idle; a difference is
counted and logged, but cannot be repaired (no walkable tree), and a resync after a
fan-in restart cannot re-announce blocks.

``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` picks the core (default ``rust``); SGLang falls
back to Python on devices other than cpu/cuda (NPU), for session caching and custom
components.  :func:`predict_core` mirrors that for the launcher, ``/server_info`` and
``sglang-kvpub check-config``; :func:`core_kind` tells the real one inside a scheduler.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BACKEND_ENV",
    "LEGACY",
    "PYTHON",
    "RUST",
    "FEATURE_NAMES",
    "MATRIX",
    "core_kind",
    "predict_core",
    "limits",
    "limit_line",
    "describe",
    "markdown_matrix",
]

log = logging.getLogger(__name__)

BACKEND_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
LEGACY, PYTHON, RUST = "legacy", "python", "rust"

FEATURE_NAMES = ("fan_in", "block_removed_on_release", "reconcile", "dispatch")

# core -> feature -> (full guarantee?, what holds)
MATRIX: dict[str, dict[str, tuple[bool, str]]] = {
    LEGACY: {
        "fan_in": (True, "yes"),
        "block_removed_on_release": (True, "SGLang's events + plugin release hooks (never twice)"),
        "reconcile": (True, "drift check, repair and resync"),
        "dispatch": (True, "yes"),
    },
    PYTHON: {
        "fan_in": (True, "yes"),
        "block_removed_on_release": (True, "SGLang's events + plugin release hooks (never twice)"),
        "reconcile": (True, "drift check, repair and resync"),
        "dispatch": (True, "yes"),
    },
    RUST: {
        "fan_in": (True, "yes"),
        "block_removed_on_release": (False, "SGLang's own events only (nodes live in Rust: nothing to hook)"),
        "reconcile": (False, "drift detected and logged, not repaired; no resync after a fan-in restart"),
        "dispatch": (True, "yes"),
    },
}


def core_kind(tree: Any) -> str:
    """``legacy`` / ``python`` / ``rust`` for a tree cache or its core (by class, no node access)."""
    core = getattr(tree, "tree_core", None) or tree
    for cls in type(core).__mro__:
        module = cls.__module__ or ""
        if module.startswith("sglang.srt.mem_cache.rust_tree_core"):
            return RUST
        if cls.__name__ == "UnifiedTreeCore":
            return PYTHON
        if cls.__name__ == "RadixCache":
            return LEGACY
    # Unknown class: walkable if it exposes a root without raising.
    try:
        core.root_node  # noqa: B018 - a property that may raise (the Rust adapter does)
    except Exception:
        return RUST
    return LEGACY


def predict_core(device: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The unified core SGLang 0.5.23 will pick for ``device`` (its default rule)."""
    env = os.environ if env is None else env
    backend = env.get(BACKEND_ENV, RUST).strip().lower() or RUST
    if backend != RUST:
        return PYTHON if backend == PYTHON else backend
    if device is not None and device not in ("cpu", "cuda"):
        return PYTHON  # SGLang's fallback: the Rust core supports cpu and cuda only
    return RUST


def limits(core: str) -> list[str]:
    """The features not fully guaranteed on ``core``, as ``"feature: what holds"``."""
    return [f"{name}: {what}" for name, (full, what) in MATRIX.get(core, {}).items() if not full]


def limit_line(core: str, where: str) -> str | None:
    """The one start line about ``core``'s limits, or None when everything holds."""
    missing = limits(core)
    if not missing:
        return None
    return (
        f"sglang_kvpub: {core} tree core ({where}): " + "; ".join(missing) + f"; for full HBM-release truth set "
        f"{BACKEND_ENV}=python"
    )


def describe(core: str) -> dict[str, Any]:
    """The ``tree_core`` block of ``/server_info`` kv_events and of ``check-config``."""
    row = MATRIX.get(core)
    if row is None:
        return {"core": core, "known": False}
    return {
        "core": core,
        "features": {name: what for name, (_, what) in row.items()},
        "limits": limits(core),
    }


def markdown_matrix() -> str:
    """The core x feature table for docs (kept equal to docs/ and README by a test)."""
    header = "| tree core | " + " | ".join(FEATURE_NAMES) + " |"
    rule = "|---" * (len(FEATURE_NAMES) + 1) + "|"
    rows = [f"| {core} | " + " | ".join(MATRIX[core][f][1] for f in FEATURE_NAMES) + " |" for core in MATRIX]
    return "\n".join([header, rule, *rows])
