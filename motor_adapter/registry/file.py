"""``--registry file:PATH``: registrations in one local JSON file, written through on every change.

The file is small (one ``/register`` body per registered dp) and rewritten whole on each
change: a temporary file in the same directory, fsync, ``os.replace``, fsync of the
directory - so a crash at any point leaves the old file or the new one, never a torn one.
Changes that arrive while a write runs are folded into the next write (group commit).

Format (versioned)::

    {"format": "motor-kv-adapter/registrations", "version": 1, "written_at": <unix s>,
     "writer": "<host-pid-nonce>",
     "registrations": [{"key": {"tenant", "model", "instance_id", "dp_rank"}, "body": {...},
                        "writer": "...", "written_at": <unix s>}],
     "rejected": [<entries a later reader could not use, kept verbatim>]}

A file that is not this format (not JSON, another program's JSON, a newer version) is
refused at start with the file and the fix named; the adapter never overwrites or deletes
it. A second adapter on the same file is refused too (an advisory lock, released by the
kernel when the holder dies, ``kill -9`` included).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Union

import msgspec

from motor_adapter.registry.store import (
    Change,
    Record,
    RegistryError,
    RegKey,
    StoreUnavailable,
    remove_record,
    replica_id,
)

__all__ = ["FORMAT", "VERSION", "FileStore", "read_state_file"]

log = logging.getLogger(__name__)

FORMAT = "motor-kv-adapter/registrations"
VERSION = 1
_WRITE_WAIT_S = 1.0  # a /register answer waits at most this long for the disk (Motor's timeout is 2 s)
_RETRY_S = 2.0  # a failed write is retried this often while changes are unwritten


def _fix(path: Path) -> str:
    aside = f"{path}.bad"
    return (
        f"fix: look at it; then repair it, or move it aside and start with no registrations: "
        f"mv {path} {aside} (Motor registers an instance once: afterwards re-add the instances in Motor, "
        f"or send each with `motor-kv-adapter register`); or point --registry at another file"
    )


def _refuse(path: Path, why: str) -> RegistryError:
    return RegistryError(f"registry state file {path} {why}; it was left untouched.\n  {_fix(path)}")


def _key_of(entry: Mapping[str, Any]) -> RegKey:
    raw = entry["key"]
    key = (raw["tenant"], raw["model"], raw["instance_id"], raw["dp_rank"])
    if not all(isinstance(k, str) for k in key[:3]) or isinstance(key[3], bool) or not isinstance(key[3], int):
        raise TypeError(f"bad key {raw!r}")
    return key


def read_state_file(path: Path) -> tuple[list[Record], list[Any]]:
    """``(records, rejected entries)`` of a state file; :class:`RegistryError` when it is not one."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(path, f"is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _refuse(path, f'is not a motor-kv-adapter registry file (no "format": "{FORMAT}")')
    version = data.get("version")
    if version != VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise _refuse(path, f"was written by a newer motor-kv-adapter (format version {version} > {VERSION})")
        raise _refuse(path, f"has an unknown format version {version!r} (this adapter reads {VERSION})")
    entries = data.get("registrations")
    if not isinstance(entries, list):
        raise _refuse(path, 'has no "registrations" list')
    records: list[Record] = []
    rejected: list[Any] = list(data.get("rejected") or [])
    for entry in entries:
        try:
            body = entry["body"]
            if not isinstance(body, dict):
                raise TypeError("body is not an object")
            records.append(
                Record(
                    _key_of(entry),
                    body,
                    str(entry.get("writer", "")),
                    float(entry.get("written_at", 0.0)),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            log.error("registry state file %s: entry %r is unusable (%s); kept in its rejected list", path, entry, exc)
            rejected.append(entry)
    return records, rejected


def _entry(record: Record) -> dict[str, Any]:
    tenant, model, instance_id, dp_rank = record.key
    return {
        "key": {"tenant": tenant, "model": model, "instance_id": instance_id, "dp_rank": dp_rank},
        "body": record.body,
        "writer": record.writer,
        "written_at": record.written_at,
    }


class FileStore:
    """Registrations in ``path``; one adapter process per file."""

    def __init__(self, path: Path, *, write_wait_s: float = _WRITE_WAIT_S) -> None:
        self.path = Path(os.path.abspath(path))
        self.description = f"file:{self.path}"
        self._write_wait_s = write_wait_s
        self._writer = replica_id()
        self._records: dict[RegKey, Record] = {}
        self._rejected: list[Any] = []
        self._lock_fd: Union[int, None] = None
        self._generation = 0  # bumped by every change
        self._written = 0  # the generation on disk
        self._write_lock = asyncio.Lock()
        self._io_lock = threading.Lock()  # one writer thread at a time, even past a timed-out wait
        self._retry: Union[asyncio.Task[None], None] = None
        self.writes = 0
        self.write_errors = 0
        self.last_write_s: Union[float, None] = None
        self.last_error: Union[str, None] = None
        self._encoder = msgspec.json.Encoder()

    # ------------------------------------------------------------------ protocol

    async def open(self) -> list[Record]:
        return await asyncio.to_thread(self._open)

    def _open(self) -> list[Record]:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise RegistryError(
                f"registry directory {self.path.parent} cannot be created ({exc.strerror or exc}); "
                "fix: create it writable for this user, or choose another place with --registry file:PATH"
            ) from exc
        self._lock()
        if not self.path.exists():
            log.info("registry %s: no state file yet; it is created with the first registration", self.path)
            return []
        records, self._rejected = read_state_file(self.path)
        self._records = {r.key: r for r in records}
        log.info("registry %s: %d registration(s) to restore", self.path, len(records))
        return records

    def _lock(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RegistryError(
                f"registry lock file {lock_path} cannot be opened ({exc.strerror or exc}); "
                "fix: make its directory writable for this user, or choose another --registry file:PATH"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RegistryError(
                f"registry state file {self.path} is in use by another running motor-kv-adapter (pid {holder}); "
                "fix: stop that one first, or give this one its own --registry file:PATH"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    async def put(self, record: Record) -> Record:
        self._records[record.key] = record
        await self._commit()
        return record

    async def delete(self, key: RegKey, *, only_if: Union[Record, None] = None) -> bool:
        if not remove_record(self._records, key, only_if):
            return False
        await self._commit()
        return True

    def changes(self) -> Union[AsyncIterator[Change], None]:
        return None  # one process per file: nobody else writes it

    def status(self) -> dict[str, Any]:
        return {
            "backend": "file",
            "durable": True,
            "path": str(self.path),
            "records": len(self._records),
            "unwritten": self._generation != self._written,
            "writes": self.writes,
            "write_errors": self.write_errors,
            "last_write_s": self.last_write_s,
            "last_error": self.last_error,
        }

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
        if self._generation != self._written:
            with contextlib.suppress(StoreUnavailable):
                await self._commit()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------------ writing

    async def _commit(self) -> None:
        """Waits (bounded) until the file holds at least the current generation."""
        self._generation += 1
        wanted = self._generation
        try:
            await asyncio.wait_for(asyncio.shield(self._write_up_to(wanted)), self._write_wait_s)
        except asyncio.TimeoutError as exc:
            self._schedule_retry()
            raise StoreUnavailable(f"{self.path}: the write took longer than {self._write_wait_s:g} s") from exc
        except OSError as exc:
            self._schedule_retry()
            raise StoreUnavailable(f"{self.path}: {exc.strerror or exc}") from exc

    async def _write_up_to(self, wanted: int) -> None:
        async with self._write_lock:
            if self._written >= wanted:
                return  # a write that started after our change already covered it
            generation = self._generation
            document = self._document()
            await asyncio.to_thread(self._write, document)
            self._written = generation

    def _document(self) -> bytes:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "written_at": time.time(),
            "writer": self._writer,
            "registrations": [_entry(r) for r in sorted(self._records.values(), key=lambda r: r.key)],
        }
        if self._rejected:
            payload["rejected"] = self._rejected
        return self._encoder.encode(payload)

    def _write(self, document: bytes) -> None:
        started = time.perf_counter()
        with self._io_lock:
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    view = memoryview(document)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)  # the rename itself survives a power cut
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                self.write_errors += 1
                self.last_error = f"{exc.strerror or exc}"
                log.error("registry %s: write failed (%s); retrying every %.0f s", self.path, exc, _RETRY_S)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self.writes += 1
        self.last_write_s = time.perf_counter() - started
        self.last_error = None

    def _schedule_retry(self) -> None:
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._retry_loop())

    async def _retry_loop(self) -> None:
        while self._generation != self._written:
            await asyncio.sleep(_RETRY_S)  # a periodic retry: no event says the disk is back
            with contextlib.suppress(OSError):
                await self._write_up_to(self._generation)
        log.info("registry %s: unwritten changes are on disk now", self.path)
