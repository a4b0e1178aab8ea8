"""Where registrations outlive the adapter: the ``RegistryStore`` protocol and its memory backend.

Motor registers an instance once, when it adds it (one POST, 2 s timeout, no retry), so a
registration the adapter forgets is gone until someone re-adds the instance. A store keeps
every registration as the ``/register`` body that created it (re-read through the same
parser at start, so a restored registration is exactly what a new ``/register`` of that
body would be), keyed like the service keys them: ``(tenant, model, instance_id, dp_rank)``.

Backends, chosen by ``--registry`` (or env ``MOTOR_KV_ADAPTER_REGISTRY``), opened by
:func:`motor_adapter.registry.spec.open_store`:

* ``file:PATH`` - :mod:`motor_adapter.registry.file`: one local JSON file, atomic replace
  (the default, under ``$XDG_STATE_HOME/motor-kv-adapter/``);
* ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` - :mod:`motor_adapter.registry.etcd`: shared by
  replicas, each of which watches the prefix;
* ``memory`` - nothing outlives the process (tests, development).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, Union

__all__ = [
    "REGISTRY_ENV",
    "Change",
    "MemoryStore",
    "Record",
    "RegKey",
    "RegistryError",
    "RegistryStore",
    "StoreUnavailable",
    "default_state_file",
    "default_registry_spec",
    "remove_record",
    "replica_id",
]

REGISTRY_ENV = "MOTOR_KV_ADAPTER_REGISTRY"
RegKey = tuple[str, str, str, int]  # (tenant, model, instance_id, dp_rank): ``Registration.key``


class RegistryError(Exception):
    """The store cannot be used as configured; the message names the file or URL and the fix.

    Raised at start: the adapter refuses to run rather than forget registrations.
    """


class StoreUnavailable(Exception):
    """A write did not complete within its bounded wait; the store keeps it and retries."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One registration as stored: the ``/register`` body and who wrote it when."""

    key: RegKey
    body: Mapping[str, Any]
    writer: str = ""  # the replica (host-pid-nonce) that accepted the /register
    written_at: float = 0.0  # wall clock, for operators
    revision: int = 0  # the store's revision of this record (etcd mod_revision; 0 when unknown)

    def same_body(self, other: Union[Record, None]) -> bool:
        return other is not None and dict(self.body) == dict(other.body)


@dataclasses.dataclass(frozen=True)
class Change:
    """A change another writer made (etcd watch): ``put``/``delete`` of one key, or ``resync``:
    ``records`` is now the whole set (after a reconnect the store lists what it holds)."""

    kind: Literal["put", "delete", "resync"]
    key: Union[RegKey, None] = None
    record: Union[Record, None] = None
    revision: int = 0
    records: tuple[Record, ...] = ()
    reset: bool = False  # resync only: the store lost what it held (replaced or wiped): write back


class RegistryStore(Protocol):
    """Registrations that outlive the process. Every method is bounded in time."""

    description: str  # for logs, /workers and metrics: "file:/...", "etcd://...", "memory"

    async def open(self) -> list[Record]:
        """The stored registrations. Raises :class:`RegistryError` when the store must not be
        used (a bad file); an unreachable shared store returns what it can (nothing) and
        delivers the rest later as a ``resync`` :class:`Change`."""

    async def put(self, record: Record) -> Record:
        """Writes ``record`` through; returns it with its revision. Raises
        :class:`StoreUnavailable` when not done in time (kept and retried by the store)."""

    async def delete(self, key: RegKey, *, only_if: Union[Record, None] = None) -> bool:
        """Removes ``key`` (only while it still holds ``only_if``'s revision/body, when given).
        False when it was not there (or changed meanwhile). Raises :class:`StoreUnavailable`."""

    def changes(self) -> Union[AsyncIterator[Change], None]:
        """Other writers' changes, in store order; None for a store nobody else writes."""

    def status(self) -> dict[str, Any]:
        """Connection and queue figures for ``/workers`` and ``/metrics``."""

    async def close(self) -> None: ...


def remove_record(records: dict[RegKey, Record], key: RegKey, only_if: Union[Record, None]) -> bool:
    """Deletes ``key`` from ``records`` - only if it still has ``only_if``'s body, when given;
    whether it did (the conditional delete every store implements)."""
    current = records.get(key)
    if current is None or (only_if is not None and not current.same_body(only_if)):
        return False
    del records[key]
    return True


class MemoryStore:
    """No durability at all (``--registry memory``): what tests and development runs use."""

    description = "memory"

    def __init__(self) -> None:
        self._records: dict[RegKey, Record] = {}

    async def open(self) -> list[Record]:
        return list(self._records.values())

    async def put(self, record: Record) -> Record:
        self._records[record.key] = record
        return record

    async def delete(self, key: RegKey, *, only_if: Union[Record, None] = None) -> bool:
        return remove_record(self._records, key, only_if)

    def changes(self) -> Union[AsyncIterator[Change], None]:
        return None

    def status(self) -> dict[str, Any]:
        return {"backend": "memory", "durable": False, "records": len(self._records)}

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------- choosing one


def _state_home(env: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME``, else ``~/.local/state`` (the XDG base directory default)."""
    value = env.get("XDG_STATE_HOME", "")
    if value and os.path.isabs(value):  # the spec says to ignore a relative value
        return Path(value)
    return Path(env.get("HOME") or Path.home()) / ".local" / "state"


def default_state_file(port: int, env: Union[Mapping[str, str], None] = None) -> Path:
    """``$XDG_STATE_HOME/motor-kv-adapter/registrations-<port>.json``: one file per adapter port,
    so restarting the same command finds its own registrations."""
    return _state_home(os.environ if env is None else env) / "motor-kv-adapter" / f"registrations-{port}.json"


def default_registry_spec(port: int, env: Union[Mapping[str, str], None] = None) -> str:
    env = os.environ if env is None else env
    return env.get(REGISTRY_ENV) or f"file:{default_state_file(port, env)}"


def replica_id() -> str:
    """``host-pid-nonce``: tells the writers of a shared store apart, across restarts too."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
