"""``--registry`` spec -> store: the one place that knows every backend (so none imports another)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from motor_adapter.registry.store import MemoryStore, RegistryError, RegistryStore

__all__ = ["open_store"]


def open_store(spec: str, *, options: Union[Mapping[str, Any], None] = None) -> RegistryStore:
    """The store ``spec`` names (not opened yet). Raises :class:`RegistryError` for a bad spec."""
    options = dict(options or {})
    text = spec.strip()
    if text == "memory":
        return MemoryStore()
    if text.startswith("file:"):
        from motor_adapter.registry.file import FileStore

        path = text[len("file:") :]
        if path.startswith("//"):  # file:///abs/path
            path = path[2:]
        if not path:
            raise RegistryError(f"--registry {spec!r}: no path; write file:/var/lib/motor-kv-adapter/reg.json")
        return FileStore(Path(path).expanduser())
    if text.startswith("etcd://"):
        from motor_adapter.registry.etcd import EtcdStore

        return EtcdStore.from_url(text, **options)
    raise RegistryError(
        f"--registry {spec!r} is not understood; use file:PATH (durable, local), "
        "etcd://HOST:PORT/PREFIX (shared by replicas) or memory (nothing survives a restart)"
    )
