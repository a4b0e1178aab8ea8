"""Registrations that outlive the process: write-through, restore at start, replicas' changes.

:class:`DurableRegistrations` sits between the HTTP handlers and a
:class:`~motor_adapter.registry.store.RegistryStore`:

* after each successful ``/register`` the body is written through (bounded wait: the
  answer says ``"durable": false`` with a warning when the store did not take it in time;
  the store keeps it and retries); after each ``/unregister`` the removed keys are deleted;
* at start the stored registrations are registered again (no ``/register`` needed), at most
  ``restore_window`` at a time waiting for their stream's first answer, so restoring N
  registrations never asks N engines for a snapshot at once; each subscription rebuilds
  its index from the engine's snapshot or replay, as for a new registration;
* a restored registration whose stream can prove it is alive (it has a replay endpoint, or
  it is a fanned-in stream with heartbeats) and says nothing for ``dead_after_s`` is taken
  for an instance removed while the adapter was down: it is dropped, and the drop is
  written through (etcd: only if nobody changed that key meanwhile);
* with a shared store (etcd) the other replicas' changes are applied as they come, in the
  store's order; a resync (after a reconnect) makes the local set equal to the store's.

The store is never asked while a query runs; registration answers wait for it only up to
the store's bounded wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, Union

import msgspec

from motor_adapter import metrics
from motor_adapter.registration import Registration, RegistrationError, Unregistration, parse_registration
from motor_adapter.registry.store import Change, Record, RegistryStore, RegKey, StoreUnavailable

__all__ = ["DurableRegistrations", "MAX_STORED_BODY"]

log = logging.getLogger(__name__)

MAX_STORED_BODY = 64 << 10  # a registration body is ~0.5 KiB; beyond this it is served but not stored
_POLL_S = 0.05  # stream health has no change notification: polled while a restore waits
_PROBATION_TICK_S = 0.5
_GONE_MAX = 1 << 16


def _json_safe(body: Any) -> dict[str, Any]:
    """A plain-JSON copy of a decoded body (msgpack may carry bytes the parser ignored)."""
    data = msgspec.json.decode(msgspec.json.encode(body))
    assert isinstance(data, dict)
    return data


def _exact(key: RegKey) -> Unregistration:
    tenant, model, instance_id, dp_rank = key
    return Unregistration(instance_id=instance_id, dp_rank=dp_rank, model=model, tenant=tenant)


def _names(unreg: Unregistration, key: RegKey) -> bool:
    """Whether ``unreg`` removes ``key`` (as ``AdapterState.unregister`` matches registrations)."""
    tenant, model, instance_id, dp_rank = key
    return (
        instance_id == unreg.instance_id
        and tenant == unreg.tenant
        and (unreg.dp_rank is None or dp_rank == unreg.dp_rank)
        and (unreg.model is None or model == unreg.model)
    )


def _checkable(reg: Registration) -> bool:
    """Whether silence means dead: a replay endpoint answers sync requests, a fanned-in stream
    sends heartbeats; a plain engine without replay says nothing while idle."""
    return reg.stream is not None and (reg.replay_endpoint is not None or bool(reg.fanned_in))


class _Metrics:
    def __init__(self) -> None:
        reg = metrics.Registry()
        self.registry = reg
        self.writes = reg.counter("motor_kv_adapter_registry_writes_total", "Registry writes by operation and result")
        self.write_seconds = reg.histogram(
            "motor_kv_adapter_registry_write_seconds", "Time a registration answer waited for the registry"
        )
        self.restored = reg.counter(
            "motor_kv_adapter_registry_restored_total", "Stored registrations registered again at start, by result"
        )
        self.dropped = reg.counter(
            "motor_kv_adapter_registry_dropped_total", "Restored registrations dropped: stream silent past dead_after_s"
        )
        self.remote = reg.counter(
            "motor_kv_adapter_registry_remote_changes_total", "Changes applied from other replicas, by kind"
        )


class DurableRegistrations:
    """The registry side of an :class:`~motor_adapter.service.AdapterState` (one per process)."""

    def __init__(
        self,
        state: Any,  # AdapterState (not imported: service imports this module)
        store: RegistryStore,
        *,
        dead_after_s: float = 60.0,
        restore_window: int = 8,
        sync_wait_s: float = 1.0,
    ) -> None:
        self.state = state
        self.store = store
        self.dead_after_s = dead_after_s
        self.restore_window = max(1, restore_window)
        self.sync_wait_s = sync_wait_s
        self.lock = asyncio.Lock()  # orders every registration change (HTTP handlers take it too)
        self.metrics = _Metrics()
        self._known: dict[RegKey, Record] = {}  # what the store holds for what we serve
        self._unrestored: dict[RegKey, str] = {}  # stored but not served (why), left in the store
        self._probation: dict[RegKey, tuple[Registration, Record, float]] = {}
        # removed here: the store revision we knew then; an older put coming back from the watch is stale
        self._gone: dict[RegKey, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._window: Union[asyncio.Semaphore, None] = None
        self._restoring = 0
        self.restore_started: Union[float, None] = None
        self.restore_done: Union[float, None] = None

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> None:
        """Opens the store (a :class:`RegistryError` fails the start) and restores in the background."""
        records = await self.store.open()
        self._window = asyncio.Semaphore(self.restore_window)
        self._known = {r.key: r for r in records}
        loop = asyncio.get_running_loop()
        self.restore_started = time.monotonic()
        self._tasks.append(loop.create_task(self._restore(records, probation=True)))
        if records and self.dead_after_s > 0:
            self._tasks.append(loop.create_task(self._watch_probation()))
        changes = self.store.changes()
        if changes is not None:
            self._tasks.append(loop.create_task(self._follow(changes)))
        if records:
            log.info("registry %s: restoring %d registration(s)", self.store.description, len(records))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.store.close()

    # ------------------------------------------------------------------ HTTP write-through

    async def registered(self, body: Any, reg: Registration, result: dict[str, Any]) -> dict[str, Any]:
        """After ``state.register(reg)`` succeeded (caller holds :attr:`lock`): stores ``body``."""
        self._probation.pop(reg.key, None)  # a fresh registration is alive by definition
        self._unrestored.pop(reg.key, None)
        stored = _json_safe(body)
        size = len(msgspec.json.encode(stored))
        if size > MAX_STORED_BODY:
            log.warning("register %s dp %d: a %d-byte body is not stored", reg.instance_id, reg.dp_rank, size)
            return self._not_durable(result, f"registry: the body is over {MAX_STORED_BODY} bytes and is not stored")
        record = Record(reg.key, stored, written_at=time.time())
        current = self._known.get(reg.key)
        if current is not None and current.same_body(record) and not self._pending():
            return {**result, "durable": self._durable()}
        self._known[reg.key] = record
        started = time.perf_counter()
        try:
            written = await self.store.put(record)
        except StoreUnavailable as exc:
            self.metrics.writes.inc(op="put", result="queued")
            log.warning("register %s dp %d: %s", reg.instance_id, reg.dp_rank, exc)
            return self._not_durable(result, f"registry: not stored yet: {exc}")
        finally:
            self.metrics.write_seconds.observe(time.perf_counter() - started)
        if self._known.get(reg.key) is record:
            self._known[reg.key] = written
        self.metrics.writes.inc(op="put", result="ok")
        return {**result, "durable": self._durable()}

    async def unregistered(self, unreg: Unregistration) -> int:
        """After ``state.unregister(unreg)`` (caller holds :attr:`lock`): deletes what is no longer
        served, and the stored registrations ``unreg`` names that could not be restored (the way to
        clear one). Returns how many of the latter went."""
        served = {r.key for r in self.state.registrations()}
        for key in [k for k in self._known if k not in served]:
            self._forget(key)
            await self._delete(key, None)
        stale = [k for k in self._unrestored if _names(unreg, k)]
        for key in stale:
            del self._unrestored[key]
            await self._delete(key, None)
        return len(stale)

    def _forget(self, key: RegKey) -> None:
        record = self._known.pop(key, None)
        self._probation.pop(key, None)
        if record is not None and record.revision:
            if len(self._gone) >= _GONE_MAX:
                self._gone.clear()  # only guards against a stale echo: bounded
            self._gone[key] = record.revision

    async def _delete(self, key: RegKey, only_if: Union[Record, None]) -> None:
        started = time.perf_counter()
        try:
            await self.store.delete(key, only_if=only_if)
        except StoreUnavailable as exc:
            self.metrics.writes.inc(op="delete", result="queued")
            log.warning("unregister %s dp %d: %s", key[2], key[3], exc)
            return
        finally:
            self.metrics.write_seconds.observe(time.perf_counter() - started)
        self.metrics.writes.inc(op="delete", result="ok")

    def _durable(self) -> bool:
        return bool(self.store.status().get("durable"))

    def _pending(self) -> bool:
        status = self.store.status()
        return bool(status.get("pending") or status.get("unwritten"))

    @staticmethod
    def _not_durable(result: dict[str, Any], warning: str) -> dict[str, Any]:
        return {**result, "durable": False, "warnings": [*result.get("warnings", []), warning]}

    # ------------------------------------------------------------------ restore

    def _restore(self, records: Iterable[Record], *, probation: bool) -> Coroutine[Any, Any, None]:
        """Counts the records as restoring now (the probation watch looks at it), restores them later."""
        pending = list(records)
        self._restoring += len(pending)

        async def restore() -> None:
            try:
                await asyncio.gather(*(self._restore_one(r, probation) for r in pending))
            finally:
                self._restoring -= len(pending)
            if probation:
                self.restore_done = time.monotonic()

        return restore()

    async def _restore_one(self, record: Record, probation: bool) -> None:
        assert self._window is not None
        async with self._window:
            async with self.lock:
                if self._known.get(record.key) is not record:
                    return  # changed or removed meanwhile (another replica, or a /register)
                reg = await self._register(record, "restore")
            if reg is None:
                return
            self.metrics.restored.inc(result="ok")
            if probation and self.dead_after_s > 0 and _checkable(reg):
                self._probation[reg.key] = (reg, record, time.monotonic())
            elif probation and reg.stream is not None and not _checkable(reg):
                log.info(
                    "restored %s dp %d: its stream has no replay endpoint and no heartbeats, so it cannot be "
                    "checked for life; kept until unregistered",
                    reg.instance_id,
                    reg.dp_rank,
                )
            if reg.stream is not None:
                await self._await_first_answer(reg)  # holds a window slot: paces the engines' snapshots

    async def _register(self, record: Record, why: str) -> Union[Registration, None]:
        """``state.register`` of a stored body (caller holds the lock); None when it cannot be served."""
        try:
            reg = parse_registration(record.body)
            if reg.key != record.key:
                raise RegistrationError(f"the body now reads as {reg.key}, stored as {record.key}")
            await asyncio.to_thread(self.state.register, reg)
        except Exception as exc:  # a bad record or a refused subscription: kept in the store, never dropped
            detail = getattr(exc, "detail", None) or str(exc)
            self._known.pop(record.key, None)
            self._unrestored[record.key] = f"{type(exc).__name__}: {detail}"
            self.metrics.restored.inc(result="error")
            log.error(
                "%s of stored registration %s failed (%s); it stays in %s - fix it, or /unregister it",
                why,
                record.key,
                self._unrestored[record.key],
                self.store.description,
            )
            return None
        self._unrestored.pop(record.key, None)
        return reg

    def _heard(self, reg: Registration, health: Union[Mapping[Any, Any], None] = None) -> bool:
        """The stream of ``reg`` answered: a batch, a snapshot, a replay reply or a heartbeat.
        ``health``: one ``state.stream_health()`` taken for several checks."""
        health = self.state.stream_health() if health is None else health
        healths = health.get((reg.model, reg.tenant, reg.block_size, reg.stream), [])
        return any(
            getattr(h, "batches", 0) or getattr(h, "snapshots", 0) or getattr(h, "connected", False) for h in healths
        )

    async def _await_first_answer(self, reg: Registration) -> None:
        deadline = time.monotonic() + self.sync_wait_s
        while time.monotonic() < deadline and not self._heard(reg):
            await asyncio.sleep(_POLL_S)

    # ------------------------------------------------------------------ found dead at restore

    async def _watch_probation(self) -> None:
        while self._restoring or self._probation:
            now = time.monotonic()
            health = self.state.stream_health() if self._probation else {}
            for key, (reg, record, since) in list(self._probation.items()):
                if self._heard(reg, health):
                    del self._probation[key]
                    log.info("restored %s dp %d: stream %s is alive", reg.instance_id, reg.dp_rank, reg.stream)
                elif now - since > self.dead_after_s:
                    await self._drop_dead(key, reg, record)
            await asyncio.sleep(_PROBATION_TICK_S)  # silence is a matter of time: checked on a clock

    async def _drop_dead(self, key: RegKey, reg: Registration, record: Record) -> None:
        async with self.lock:
            if self._probation.pop(key, None) is None or self._known.get(key) is not record:
                return  # re-registered or changed meanwhile
            await asyncio.to_thread(self.state.unregister, _exact(key))
            self._forget(key)
            self.metrics.dropped.inc()
            log.warning(
                "dropped restored registration %s dp %d: its stream %s stayed silent for %.0f s after the restart "
                "(the instance was probably removed while the adapter was down); if it is alive, re-add it in "
                "Motor or run `motor-kv-adapter register`",
                reg.instance_id,
                reg.dp_rank,
                reg.stream,
                self.dead_after_s,
            )
            await self._delete(key, record)

    # ------------------------------------------------------------------ other replicas

    async def _follow(self, changes: Any) -> None:
        async for change in changes:
            try:
                await self._apply(change)
            except Exception:  # one bad change must not stop following the others
                log.exception("registry %s: applying a %s change failed", self.store.description, change.kind)

    async def _apply(self, change: Change) -> None:
        self.metrics.remote.inc(kind=change.kind)
        if change.kind == "resync":
            await self._resync(change)
            return
        assert change.key is not None
        async with self.lock:
            current = self._known.get(change.key)
            if change.kind == "put":
                assert change.record is not None
                await self._apply_put(current, change.record)
            elif current is not None and 0 < current.revision <= change.revision:
                await asyncio.to_thread(self.state.unregister, _exact(change.key))
                self._forget(change.key)
                self._gone.pop(change.key, None)
                log.info("registration %s removed on another replica", change.key)
            elif current is None:
                self._unrestored.pop(change.key, None)
                self._gone.pop(change.key, None)

    async def _apply_put(self, current: Union[Record, None], record: Record) -> None:
        if current is not None and current.revision >= record.revision > 0:
            return  # older than what we hold
        if current is None and record.revision <= self._gone.get(record.key, 0):
            return  # the echo of a put we have since unregistered; its delete follows
        if current is not None and current.same_body(record):
            self._known[record.key] = record  # our own write coming back, or a no-op
            return
        self._known[record.key] = record
        self._probation.pop(record.key, None)
        if await self._register(record, "registration from another replica") is not None:
            log.info("registration %s from replica %s applied", record.key, record.writer or "?")

    async def _resync(self, change: Change) -> None:
        """The store's whole set after a reconnect: ours becomes equal to it (``reset``: we write back)."""
        wanted = {r.key: r for r in change.records}
        if change.reset:  # etcd lost them: what we serve goes back in, nothing is removed here
            async with self.lock:
                lost = [r for k, r in self._known.items() if k not in wanted]
            for record in lost:
                with contextlib.suppress(StoreUnavailable):
                    wanted[record.key] = await self.store.put(record)
        async with self.lock:
            for key in [k for k, r in self._known.items() if k not in wanted and r.revision > 0]:
                await asyncio.to_thread(self.state.unregister, _exact(key))
                self._forget(key)
                log.info("registration %s was removed while etcd was out of reach; removed here too", key)
            new = []
            for key, record in wanted.items():
                current = self._known.get(key)
                self._known[key] = record
                if current is None or not current.same_body(record):
                    new.append(record)
        if new:
            await self._restore(new, probation=False)

    # ------------------------------------------------------------------ views

    def status(self) -> dict[str, Any]:
        return {
            **self.store.status(),
            "registrations": len(self._known),
            "restoring": self._restoring,
            "restore_s": (
                None
                if self.restore_done is None or self.restore_started is None
                else round(self.restore_done - self.restore_started, 3)
            ),
            "on_probation": [list(k) for k in self._probation],
            "unrestored": {"/".join(map(str, k)): why for k, why in self._unrestored.items()},
        }

    def render_metrics(self) -> str:
        status = self.store.status()
        extra: list[metrics.Gauge] = []

        def gauge(name: str, help_text: str, value: float) -> None:
            g = metrics.Gauge(name, help_text)
            g.set(value, backend=str(status.get("backend", "?")))
            extra.append(g)

        gauge("motor_kv_adapter_registry_registrations", "Registrations held in the registry", len(self._known))
        gauge(
            "motor_kv_adapter_registry_pending",
            "Changes the registry has not written yet (etcd unreachable, disk error)",
            float(status.get("pending", 0) or (1 if status.get("unwritten") else 0)),
        )
        gauge(
            "motor_kv_adapter_registry_connected",
            "1 while the registry's store answers",
            float(bool(status.get("connected", True))),
        )
        gauge(
            "motor_kv_adapter_registry_unrestored",
            "Stored registrations that could not be served",
            len(self._unrestored),
        )
        gauge(
            "motor_kv_adapter_registry_on_probation", "Restored registrations not yet heard from", len(self._probation)
        )
        if "replicas_alive" in status:
            gauge(
                "motor_kv_adapter_registry_replicas", "Replicas holding a live lease", float(status["replicas_alive"])
            )
        return self.metrics.registry.render(extra)
