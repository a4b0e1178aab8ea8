"""A small asyncio client of etcd v3's JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``).

etcd serves its v3 API as JSON over HTTP on the client port (keys and values base64,
64-bit integers as strings). Speaking it over aiohttp - the HTTP stack the adapter
already runs on - needs no gRPC, no protobuf and no other client library, which keeps the
router's install free of the grpcio/protobuf versions Motor's own packages pin.

Only what the registry needs: put, range, delete, a compare-and-delete transaction, lease
grant/keepalive/revoke, and a watch stream. Every unary call has a timeout; the watch is
one long response whose end (etcd gone) the caller notices and reconnects after. Several
endpoints may be given: a call that cannot reach one tries the next.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Union

import aiohttp

__all__ = ["EtcdError", "EtcdGateway", "Header", "KeyValue", "WatchCompacted", "WatchEvent", "prefix_end"]

log = logging.getLogger(__name__)

_MAX_LINE = 64 << 20  # one watch response (a batch of events) larger than this is refused


class EtcdError(Exception):
    """etcd could not be reached in time, or answered with an error."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: list the prefix again, then watch on."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept {compact_revision})")
        self.compact_revision = compact_revision


@dataclasses.dataclass(frozen=True)
class Header:
    cluster_id: str
    revision: int


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    kv: KeyValue


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Union[str, None]) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _header(data: dict[str, Any]) -> Header:
    raw = data.get("header") or {}
    return Header(str(raw.get("cluster_id", "")), int(raw.get("revision", 0)))


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        _unb64(raw.get("key")), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)), int(raw.get("lease", 0))
    )


class EtcdGateway:
    """One aiohttp session to one etcd cluster (``endpoints``: ``http://host:port`` each)."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._current = 0
        self._session: Union[aiohttp.ClientSession, None] = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no proxy from the environment: etcd is spoken to directly
            self._session = aiohttp.ClientSession(trust_env=False, json_serialize=json.dumps)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any], timeout_s: Union[float, None] = None) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers; :class:`EtcdError` otherwise."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        problems: list[str] = []
        for attempt in range(len(self.endpoints)):
            base = self.endpoints[(self._current + attempt) % len(self.endpoints)]
            try:
                async with self._http().post(base + path, json=body, timeout=timeout) as response:
                    data = await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                problems.append(f"{base}: {type(exc).__name__} {exc}".strip())
                continue
            self._current = (self._current + attempt) % len(self.endpoints)
            if response.status != 200 or not isinstance(data, dict) or ("error" in data and "header" not in data):
                message = data.get("message") or data.get("error") if isinstance(data, dict) else data
                raise EtcdError(f"{base}{path}: HTTP {response.status}: {message}")
            return data
        raise EtcdError("etcd unreachable: " + "; ".join(problems))

    # ------------------------------------------------------------------ kv

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> Header:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _header(await self.call("/v3/kv/put", body))

    async def range_prefix(self, prefix: bytes) -> tuple[list[KeyValue], Header]:
        data = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(kv) for kv in data.get("kvs") or []], _header(data)

    async def delete(self, key: bytes) -> tuple[int, Header]:
        data = await self.call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(data.get("deleted", 0)), _header(data)

    async def delete_if_revision(self, key: bytes, mod_revision: int) -> tuple[bool, Header]:
        """Deletes ``key`` only while its mod_revision is still ``mod_revision`` (one transaction)."""
        body = {
            "compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
        }
        data = await self.call("/v3/kv/txn", body)
        return bool(data.get("succeeded")), _header(data)

    # ------------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> int:
        data = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after this refresh; 0 when it has expired (etcd forgot it)."""
        data = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((data.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    # ------------------------------------------------------------------ watch

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
        """``(revision, events)`` per watch response from ``start_revision`` on, until the stream ends
        (:class:`EtcdError`) or the revision was compacted (:class:`WatchCompacted`)."""
        base = self.endpoints[self._current]
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
                "progress_notify": True,
            }
        }
        # no total timeout (a watch is long); connecting is bounded, and the lease keepalive
        # notices a silent etcd and cancels this generator
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self.timeout_s)
        try:
            async with self._http().post(base + "/v3/watch", json=body, timeout=timeout) as response:
                if response.status != 200:
                    raise EtcdError(f"{base}/v3/watch: HTTP {response.status}")
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    if len(buffer) > _MAX_LINE:
                        raise EtcdError(f"{base}/v3/watch: a response over {_MAX_LINE} bytes")
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        parsed = _watch_line(line)
                        if parsed is not None:
                            yield parsed
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._current = (self._current + 1) % len(self.endpoints)
            raise EtcdError(f"{base}/v3/watch: {type(exc).__name__} {exc}") from exc
        self._current = (self._current + 1) % len(self.endpoints)
        raise EtcdError(f"{base}/v3/watch: the stream ended")


def _watch_line(line: bytes) -> Union[tuple[int, list[WatchEvent]], None]:
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise EtcdError(f"watch: not JSON: {line[:200]!r}") from exc
    if not isinstance(data, dict):
        raise EtcdError(f"watch: not an object: {line[:200]!r}")
    if "error" in data:
        raise EtcdError(f"watch: {data['error']}")
    result = data.get("result") or {}
    compact = int(result.get("compact_revision", 0) or 0)
    if compact:
        raise WatchCompacted(compact)
    if result.get("canceled"):
        raise EtcdError(f"watch canceled: {result.get('cancel_reason', '')}")
    events = [
        WatchEvent("delete" if event.get("type") == "DELETE" else "put", _kv(event.get("kv") or {}))
        for event in result.get("events") or []
    ]
    return _header(result).revision, events
