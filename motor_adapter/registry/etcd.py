"""``--registry etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: registrations shared by adapter replicas.

TLS and authentication are options of the spec (docs/operations.md)::

    etcd://HOST:2379/PREFIX?tls_ca=/etc/etcd/ca.pem&tls_cert=/etc/etcd/client.pem&tls_key=/etc/etcd/client-key.pem
    etcd://HOST:2379/PREFIX?tls=1&user=motor&password_file=/run/secrets/etcd-password

``tls=1`` or any ``tls_*`` option speaks https (``tls_ca``: the CA that signed etcd's
certificate, else the system's; ``tls_cert`` and ``tls_key`` together: this client's, for
``--client-cert-auth``).  ``user`` authenticates with the password from ``password_file`` or
the environment variable ``MOTOR_KV_ADAPTER_ETCD_PASSWORD`` - never from the spec, which is
logged.

Keys under ``PREFIX`` (default ``/motor-kv-adapter``)::

    PREFIX/registrations/<tenant>/<model>/<instance_id>/<dp_rank>   the /register body, NO lease
    PREFIX/replicas/<replica id>                                   presence, on the replica's lease

What is leased, and why: a lease ends when its holder stops refreshing it (crash, kill -9,
a partition longer than the TTL), and etcd then deletes every key attached to it. Motor
registers an instance once and never again, so a registration must outlive the replica
that accepted it: registration keys carry **no** lease, they go only by ``/unregister``
(on any replica) or when the instance is found dead at restore. The lease is on the
replica's presence key: it tells operators (``/workers``) and the other replicas which
replicas are alive right now, and it vanishes by itself when one dies. Each registration
names its writer (replica id and lease id) so an operator can see where it came from; its
survival never depends on that writer.

Nothing is lost when the writer dies mid-write because the write is one etcd request
(atomic: the record is all there or not at all) and the ``/register`` answer is sent only
after etcd acknowledged it; the other replicas learn it from their watch, independently of
the writer. When etcd does not answer within the bounded wait, the replica still answers
(serving the registration itself), keeps the write in an outbox (latest per key) and writes
it when etcd is back; a replica killed in that window loses it, and the answer said so
(a warning in the ``/register`` answer, ``motor_kv_adapter_registry_pending``).

Every replica watches ``PREFIX/registrations/`` and applies what others wrote; after a
reconnect it flushes its outbox, lists the prefix again (a ``resync``), and watches on from
there. An etcd whose cluster id changed, or whose revision went backwards, was replaced or
wiped: the resync says ``reset`` and the replicas write back what they serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Union
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from motor_adapter.registry.etcd_gateway import EtcdAuth, EtcdError, EtcdGateway, EtcdTls, KeyValue, WatchEvent
from motor_adapter.registry.etcd_security import PASSWORD_ENV, SECURITY_OPTIONS, security_options
from motor_adapter.registry.store import Change, Record, RegistryError, RegKey, StoreUnavailable, replica_id

__all__ = ["DEFAULT_PREFIX", "PASSWORD_ENV", "EtcdStore"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/motor-kv-adapter"
_VALUE_VERSION = 1
_BACKOFF_MIN_S = 0.2
_BACKOFF_MAX_S = 2.0
_Op = tuple[Literal["put", "delete"], Union[Record, None]]


def _quote(part: str) -> str:
    return quote(part, safe="")


class EtcdStore:
    """Registrations in etcd under ``prefix``; one lease per replica, for its presence key only."""

    def __init__(
        self,
        endpoints: list[str],
        prefix: str = DEFAULT_PREFIX,
        *,
        lease_ttl_s: int = 10,
        timeout_s: float = 1.0,
        connect_wait_s: float = 2.0,
        tls: Union[EtcdTls, None] = None,
        auth: Union[EtcdAuth, None] = None,
    ) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.connect_wait_s = connect_wait_s
        self.write_wait_s = timeout_s  # a /register answer waits at most this long for etcd, endpoints tried included
        self.tls = tls
        self.user = auth.user if auth is not None else None
        security = [w for w in ("tls" if tls else "", f"user {self.user}" if self.user else "") if w]
        self.description = f"etcd://{','.join(e.split('://', 1)[1] for e in endpoints)}{prefix}" + (
            f" ({', '.join(security)})" if security else ""
        )
        self.replica = replica_id()
        self._gw = EtcdGateway(endpoints, timeout_s=timeout_s, tls=tls, auth=auth)
        self._reg_prefix = f"{prefix}/registrations/".encode()
        self._replica_key = f"{prefix}/replicas/{_quote(self.replica)}".encode()
        self._lease = 0
        self._connected = False
        self._cluster: Union[str, None] = None
        self._revision = 0  # the newest revision seen (range or watch)
        self._outbox: dict[RegKey, _Op] = {}
        self._changes: asyncio.Queue[Change] = asyncio.Queue()
        self._task: Union[asyncio.Task[None], None] = None
        self._closed = False
        self._replicas = 0
        self.last_error: Union[str, None] = None
        self.reconnects = 0
        self.watch_events = 0
        self._warned: set[bytes] = set()

    @classmethod
    def from_url(cls, url: str, env: Union[Mapping[str, str], None] = None, **options: Any) -> EtcdStore:
        """``etcd://h1:2379[,h2:2379]/prefix[?lease_ttl=10&timeout=1&tls_ca=...&user=...]`` (module docstring)."""
        parts = urlsplit(url)
        hosts = [h.strip() for h in parts.netloc.split(",") if h.strip()]
        if not hosts or any(":" not in h or not h.rsplit(":", 1)[1].isdigit() for h in hosts):
            raise RegistryError(
                f"--registry {url!r}: write etcd://HOST:PORT[,HOST:PORT...]/PREFIX (e.g. etcd://127.0.0.1:2379/motor-kv-adapter)"
            )
        prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else DEFAULT_PREFIX
        known = {
            "lease_ttl": ("lease_ttl_s", int),
            "timeout": ("timeout_s", float),
            "connect_wait": ("connect_wait_s", float),
        }
        security: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name in SECURITY_OPTIONS:
                security[name] = value
                continue
            if name not in known:
                names = ", ".join(sorted([*known, *SECURITY_OPTIONS]))
                raise RegistryError(f"--registry {url!r}: unknown option {name!r} (known: {names})")
            field, kind = known[name]
            try:
                options[field] = kind(value)
            except ValueError as exc:
                raise RegistryError(f"--registry {url!r}: {name} must be a number, got {value!r}") from exc
        if options.get("lease_ttl_s", 10) < 2:
            raise RegistryError(f"--registry {url!r}: lease_ttl must be at least 2 s")
        tls, auth = security_options(url, security, os.environ if env is None else env)
        scheme = "https" if tls is not None else "http"
        return cls([f"{scheme}://{h}" for h in hosts], prefix, tls=tls, auth=auth, **options)

    # ------------------------------------------------------------------ keys and values

    def _key(self, key: RegKey) -> bytes:
        tenant, model, instance_id, dp_rank = key
        return self._reg_prefix + f"{_quote(tenant)}/{_quote(model)}/{_quote(instance_id)}/{dp_rank}".encode()

    def _reg_key(self, raw: bytes) -> Union[RegKey, None]:
        parts = raw[len(self._reg_prefix) :].decode(errors="replace").split("/")
        if len(parts) != 4 or not parts[3].isdigit():
            return None
        return (unquote(parts[0]), unquote(parts[1]), unquote(parts[2]), int(parts[3]))

    def _value(self, record: Record) -> bytes:
        tenant, model, instance_id, dp_rank = record.key
        return json.dumps(
            {
                "version": _VALUE_VERSION,
                "key": {"tenant": tenant, "model": model, "instance_id": instance_id, "dp_rank": dp_rank},
                "body": dict(record.body),
                "writer": record.writer or self.replica,
                "writer_lease": self._lease,
                "written_at": record.written_at or time.time(),
            },
            separators=(",", ":"),
            default=str,
        ).encode()

    def _record(self, kv: KeyValue) -> Union[Record, None]:
        key = self._reg_key(kv.key)
        try:
            data = json.loads(kv.value)
            if key is None or not isinstance(data, dict) or not isinstance(data.get("body"), dict):
                raise ValueError("not a registration record")
            if data.get("version") != _VALUE_VERSION:
                raise ValueError(f"record version {data.get('version')!r}, this adapter reads {_VALUE_VERSION}")
        except ValueError as exc:
            if kv.key not in self._warned:  # foreign or newer keys under our prefix: left alone
                self._warned.add(kv.key)
                log.error("registry %s: key %r is unusable (%s); left in etcd as is", self.description, kv.key, exc)
            return None
        writer, written_at = str(data.get("writer", "")), float(data.get("written_at", 0.0))
        return Record(key, data["body"], writer, written_at, kv.mod_revision)

    # ------------------------------------------------------------------ protocol

    async def open(self) -> list[Record]:
        records: list[Record] = []
        try:
            records, _ = await asyncio.wait_for(self._connect(), self.connect_wait_s)
        except (EtcdError, asyncio.TimeoutError) as exc:
            self._trouble("connect", exc)
            log.error(
                "registry %s: etcd not reachable at start (%s); serving without its registrations and "
                "retrying - they are restored as soon as it answers",
                self.description,
                self.last_error,
            )
        self._task = asyncio.get_running_loop().create_task(self._supervise())
        return records

    async def put(self, record: Record) -> Record:
        if not self._connected:
            self._outbox[record.key] = ("put", record)
            raise StoreUnavailable(f"etcd unreachable ({self.last_error}); queued, written when it answers")
        try:
            header = await asyncio.wait_for(self._gw.put(self._key(record.key), self._value(record)), self.write_wait_s)
        except (EtcdError, asyncio.TimeoutError) as exc:
            self._outbox[record.key] = ("put", record)
            self._trouble("put", exc)
            raise StoreUnavailable(f"etcd did not take it in time ({exc}); queued, retried") from exc
        self._outbox.pop(record.key, None)
        return Record(record.key, record.body, record.writer, record.written_at, header.revision)

    async def delete(self, key: RegKey, *, only_if: Union[Record, None] = None) -> bool:
        if not self._connected:
            self._outbox[key] = ("delete", only_if)
            raise StoreUnavailable(f"etcd unreachable ({self.last_error}); queued, written when it answers")
        try:
            done = await asyncio.wait_for(self._delete(key, only_if), self.write_wait_s)
        except (EtcdError, asyncio.TimeoutError) as exc:
            self._outbox[key] = ("delete", only_if)
            self._trouble("delete", exc)
            raise StoreUnavailable(f"etcd did not take it in time ({exc}); queued, retried") from exc
        self._outbox.pop(key, None)
        return done

    async def _delete(self, key: RegKey, only_if: Union[Record, None]) -> bool:
        if only_if is not None and only_if.revision:
            done, _ = await self._gw.delete_if_revision(self._key(key), only_if.revision)
            return done
        deleted, _ = await self._gw.delete(self._key(key))
        return deleted > 0

    async def _iterate(self) -> AsyncIterator[Change]:
        while True:
            yield await self._changes.get()

    def changes(self) -> Union[AsyncIterator[Change], None]:
        return self._iterate()

    def status(self) -> dict[str, Any]:
        return {
            "backend": "etcd",
            "durable": True,
            "endpoints": list(self.endpoints),
            "tls": self.tls is not None,
            "user": self.user,
            "logins": self._gw.logins,
            "prefix": self.prefix,
            "replica": self.replica,
            "lease": self._lease,
            "lease_ttl_s": self.lease_ttl_s,
            "connected": self._connected,
            "pending": len(self._outbox),
            "revision": self._revision,
            "replicas_alive": self._replicas,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
        }

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._connected and self._lease:
            with contextlib.suppress(EtcdError, asyncio.TimeoutError):
                await asyncio.wait_for(self._gw.revoke(self._lease), 0.5)  # presence goes at once
        if self._outbox:
            log.warning("registry %s: %d change(s) never reached etcd", self.description, len(self._outbox))
        await self._gw.close()

    # ------------------------------------------------------------------ connection

    def _trouble(self, what: str, exc: BaseException) -> None:
        text = f"{what}: {exc or type(exc).__name__}"
        if self._connected or text != self.last_error:
            log.warning("registry %s: %s", self.description, text)
        self.last_error = text
        self._connected = False

    async def _ensure_lease(self) -> None:
        """Keeps the current lease if etcd still knows it; else grants one and re-announces presence."""
        if self._lease and await self._gw.keepalive(self._lease) > 0:
            return
        self._lease = await self._gw.grant(self.lease_ttl_s)
        presence = {"replica": self.replica, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        await self._gw.put(self._replica_key, json.dumps(presence).encode(), lease=self._lease)

    async def _connect(self) -> tuple[list[Record], bool]:
        """Lease and presence, outbox flushed, then the whole prefix listed (the watch starts after it).
        Returns the records and whether etcd was reset meanwhile."""
        await self._ensure_lease()
        await self._flush_outbox()
        kvs, header = await self._gw.range_prefix(self._reg_prefix)
        reset = self._note_header(header.cluster_id, header.revision)
        self._connected = True
        self.last_error = None
        return [r for r in map(self._record, kvs) if r is not None], reset

    def _note_header(self, cluster: str, revision: int) -> bool:
        """Records where etcd is; True when it was reset (another cluster, or its revision went back)."""
        reset = self._cluster is not None and (cluster != self._cluster or revision < self._revision)
        if reset:
            log.warning(
                "registry %s: etcd was replaced or wiped (cluster %s -> %s, revision %d -> %d); "
                "writing back the registrations this replica serves",
                self.description,
                self._cluster,
                cluster,
                self._revision,
                revision,
            )
        self._cluster = cluster
        self._revision = revision
        return reset

    async def _flush_outbox(self) -> None:
        for key, (kind, record) in list(self._outbox.items()):
            if kind == "put":
                assert record is not None
                await self._gw.put(self._key(key), self._value(record))
            else:
                await self._delete(key, record)
            if self._outbox.get(key) == (kind, record):
                del self._outbox[key]
        if not self._outbox:
            log.debug("registry %s: outbox flushed", self.description)

    async def _supervise(self) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._closed:
            if not self._connected:
                try:
                    records, reset = await asyncio.wait_for(self._connect(), self.connect_wait_s)
                except (EtcdError, asyncio.TimeoutError) as exc:
                    self._trouble("reconnect", exc)
                    await asyncio.sleep(backoff)  # etcd gives no event when it is back: retry with backoff
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                backoff = _BACKOFF_MIN_S
                self.reconnects += 1
                log.info("registry %s: connected; %d registration(s) in etcd", self.description, len(records))
                self._changes.put_nowait(Change("resync", revision=self._revision, records=tuple(records), reset=reset))
            await self._follow()

    async def _follow(self) -> None:
        """Watch and keepalive side by side until either fails (etcd gone or unreachable)."""
        loop = asyncio.get_running_loop()
        watch = loop.create_task(self._watch())
        keepalive = loop.create_task(self._keepalive())
        try:
            done, _ = await asyncio.wait({watch, keepalive}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when close() cancels us: neither may outlive the store
            for task in (watch, keepalive):
                task.cancel()
            for task in (watch, keepalive):
                with contextlib.suppress(asyncio.CancelledError, EtcdError, asyncio.TimeoutError, ValueError):
                    await task
        for task in done:
            exc = None if task.cancelled() else task.exception()
            self._trouble("watch" if task is watch else "keepalive", exc or EtcdError("ended"))

    async def _watch(self) -> None:
        async for revision, events in self._gw.watch_prefix(self._reg_prefix, self._revision + 1):
            for event in events:
                self._deliver(event)
            self._revision = max(self._revision, revision)

    def _deliver(self, event: WatchEvent) -> None:
        self.watch_events += 1
        if event.kind == "delete":
            key = self._reg_key(event.kv.key)
            if key is not None:
                self._changes.put_nowait(Change("delete", key=key, revision=event.kv.mod_revision))
            return
        record = self._record(event.kv)
        if record is not None:
            self._changes.put_nowait(Change("put", key=record.key, record=record, revision=record.revision))

    async def _keepalive(self) -> None:
        """Refreshes the lease every third of its TTL; flushes the outbox; counts live replicas."""
        interval = max(0.5, self.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)  # a lease is refreshed on a clock, there is no event for it
            if await self._gw.keepalive(self._lease) <= 0:
                log.warning("registry %s: lease %d expired; taking a new one", self.description, self._lease)
                self._lease = 0
                await self._ensure_lease()
            self._connected = True  # etcd answers again (a put may have timed out meanwhile)
            self.last_error = None
            if self._outbox:
                await self._flush_outbox()
            replicas, _ = await self._gw.range_prefix(f"{self.prefix}/replicas/".encode())
            self._replicas = len(replicas)
