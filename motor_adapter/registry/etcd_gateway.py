"""etcd v3 through its JSON gateway with ``etcd3gw``, kept off the event loop.

etcd serves its v3 API as JSON over HTTP on the client port (keys and values base64, 64-bit
integers as strings).  ``etcd3gw`` speaks it: its client holds one ``requests`` session per
endpoint (TLS: the CA, the client certificate and key), builds the URLs and maps HTTP and
connection failures to its exceptions.  The registry needs each answer whole - the header's
cluster id and revision tell it when etcd was replaced or wiped - which etcd3gw's put/get
helpers drop, so the calls go through its client's ``post``.  Authentication (user and
password) is etcd's ``/v3/auth/authenticate``: its token goes into the session's
``Authorization`` header and is taken again when etcd says it expired.

etcd3gw is synchronous (``requests``): every call runs in this gateway's own small thread
pool, so the adapter's aiohttp loop never waits on a socket.  The watch is one long
response read in a thread of that pool, line by line, by this module rather than by
etcd3gw's watcher, which drops what the registry acts on (a compacted start revision, the
stream's end, the response revision) and, when the stream ends, leaves its iterator waiting
forever.  Several endpoints may be given: a call that cannot reach one tries the next.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, Union
from urllib.parse import urlsplit

import requests
from etcd3gw import exceptions as etcd3gw_errors
from etcd3gw.client import Etcd3Client

__all__ = [
    "EtcdAuth",
    "EtcdError",
    "EtcdGateway",
    "EtcdTls",
    "Header",
    "KeyValue",
    "WatchCompacted",
    "WatchEvent",
    "prefix_end",
]

log = logging.getLogger(__name__)

_MAX_LINE = 64 << 20  # one watch response (a batch of events) larger than this is refused
_POOL_THREADS = 4  # unary calls in flight at once, plus the watch's reader
_T = TypeVar("_T")
# What etcd says when a token expired (simple tokens live 5 min) or a member never issued it.
_TOKEN_REFUSED = ("invalid auth token", "user name is empty")


class EtcdError(Exception):
    """etcd could not be reached in time, or answered with an error."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: list the prefix again, then watch on."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept {compact_revision})")
        self.compact_revision = compact_revision


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: ``ca`` verifies its certificate (None: the system's CAs); ``cert`` and
    ``key`` are this client's, for an etcd started with ``--client-cert-auth``."""

    ca: Union[str, None] = None
    cert: Union[str, None] = None
    key: Union[str, None] = None


@dataclasses.dataclass(frozen=True)
class EtcdAuth:
    """etcd's user authentication; the password never appears in a log or a status."""

    user: str
    password: str = dataclasses.field(repr=False)


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


class _Endpoint:
    """One etcd member: its etcd3gw client (own session: TLS, no proxy from the environment)."""

    def __init__(self, url: str, timeout_s: float, tls: Union[EtcdTls, None], auth: Union[EtcdAuth, None]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"etcd endpoint {url!r}: write http://HOST:PORT or https://HOST:PORT")
        session = requests.Session()
        session.trust_env = False  # etcd is spoken to directly, never through a proxy from the environment
        if tls is not None:
            session.verify = tls.ca if tls.ca else True
            if tls.cert and tls.key:
                session.cert = (tls.cert, tls.key)
        self.url = url
        self.auth = auth
        self.client = Etcd3Client(
            host=parts.hostname,
            port=parts.port,
            protocol=parts.scheme,
            timeout=timeout_s,
            api_path="/v3/",  # etcd >= 3.4: no discovery round trip
            session=session,
        )
        self._token_lock = threading.Lock()
        self._authenticated = False
        self.logins = 0  # tokens taken (the first, then one per expiry)

    def close(self) -> None:
        self.client.session.close()

    def authenticate(self) -> None:
        if self.auth is None:
            return
        with self._token_lock:
            self.client.session.headers.pop("Authorization", None)
            body = {"name": self.auth.user, "password": self.auth.password}
            try:
                data = self.client.post(self.client.get_url("/auth/authenticate"), json=body)
            except etcd3gw_errors.Etcd3Exception as exc:
                if isinstance(exc, (etcd3gw_errors.ConnectionFailedError, etcd3gw_errors.ConnectionTimeoutError)):
                    raise
                raise EtcdError(
                    f"{self.url}: etcd refused user {self.auth.user!r} ({_detail(exc)}): check the registry's "
                    "user and password (password_file or MOTOR_KV_ADAPTER_ETCD_PASSWORD)"
                ) from None
            token = data.get("token") if isinstance(data, dict) else None
            if not token:
                raise EtcdError(f"{self.url}: etcd gave no auth token for user {self.auth.user!r}: is auth enabled?")
            self.client.session.headers["Authorization"] = str(token)
            self._authenticated = True
            self.logins += 1

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """One call; authenticates first (and once more when etcd says the token expired)."""
        if self.auth is not None and not self._authenticated:
            self.authenticate()
        try:
            return self.client.post(self.client.get_url(path), json=body)
        except etcd3gw_errors.Etcd3Exception as exc:
            if self.auth is None or not any(m in _detail(exc).lower() for m in _TOKEN_REFUSED):
                raise
        self.authenticate()
        return self.client.post(self.client.get_url(path), json=body)


def _detail(exc: etcd3gw_errors.Etcd3Exception) -> str:
    text = exc.detail_text if isinstance(exc.detail_text, str) else ""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip() or str(exc)
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or text)
    return text


class EtcdGateway:
    """One client per etcd member (``endpoints``: ``http(s)://host:port`` each), calls off the loop."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 1.0,
        tls: Union[EtcdTls, None] = None,
        auth: Union[EtcdAuth, None] = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._members = [_Endpoint(url, timeout_s, tls, auth) for url in self.endpoints]
        self._current = 0
        self._pool: Union[concurrent.futures.ThreadPoolExecutor, None] = None

    @property
    def logins(self) -> int:
        """Auth tokens taken from etcd so far (0 without a user)."""
        return sum(member.logins for member in self._members)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="etcd")
        return self._pool

    async def _off_loop(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor(), fn)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for member in self._members:
            member.close()

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        problems: list[str] = []
        for attempt in range(len(self._members)):
            at = (self._current + attempt) % len(self._members)
            member = self._members[at]
            try:
                data = member.post(path, body)
            except (etcd3gw_errors.ConnectionFailedError, etcd3gw_errors.ConnectionTimeoutError) as exc:
                problems.append(f"{member.url}: {type(exc).__name__} {_detail(exc)}".strip())
                continue
            except etcd3gw_errors.Etcd3Exception as exc:
                raise EtcdError(f"{member.url}/v3{path}: {_detail(exc)}") from None
            except (requests.RequestException, ValueError) as exc:  # a body that is no JSON, a bad file
                raise EtcdError(f"{member.url}/v3{path}: {type(exc).__name__} {exc}") from None
            self._current = at
            if not isinstance(data, dict) or ("error" in data and "header" not in data):
                message = data.get("message") or data.get("error") if isinstance(data, dict) else data
                raise EtcdError(f"{member.url}/v3{path}: {message}")
            return data
        raise EtcdError("etcd unreachable: " + "; ".join(problems))

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3`` + ``path`` on the first member that answers; :class:`EtcdError` otherwise."""
        return await self._off_loop(lambda: self._call(path, body))

    # ------------------------------------------------------------------ kv

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> Header:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _header(await self.call("/kv/put", body))

    async def range_prefix(self, prefix: bytes) -> tuple[list[KeyValue], Header]:
        data = await self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(kv) for kv in data.get("kvs") or []], _header(data)

    async def delete(self, key: bytes) -> tuple[int, Header]:
        data = await self.call("/kv/deleterange", {"key": _b64(key)})
        return int(data.get("deleted", 0)), _header(data)

    async def delete_if_revision(self, key: bytes, mod_revision: int) -> tuple[bool, Header]:
        """Deletes ``key`` only while its mod_revision is still ``mod_revision`` (one transaction)."""
        body = {
            "compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
        }
        data = await self.call("/kv/txn", body)
        return bool(data.get("succeeded")), _header(data)

    # ------------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> int:
        data = await self.call("/lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after this refresh; 0 when it has expired (etcd forgot it)."""
        data = await self.call("/lease/keepalive", {"ID": str(lease)})
        return int((data.get("result") or {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/lease/revoke", {"ID": str(lease)})

    # ------------------------------------------------------------------ watch

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
        """``(revision, events)`` per watch response from ``start_revision`` on, until the stream ends
        (:class:`EtcdError`) or the revision was compacted (:class:`WatchCompacted`)."""
        member = self._members[self._current]
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
                "progress_notify": True,
            }
        }
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[Union[bytes, BaseException, None]] = asyncio.Queue()

        def emit(item: Union[bytes, BaseException, None]) -> None:
            loop.call_soon_threadsafe(lines.put_nowait, item)

        stream = _WatchStream(member, body, self.timeout_s, emit)
        reader = loop.run_in_executor(self._executor(), stream.run)
        try:
            while True:
                item = await lines.get()
                if item is None:
                    raise EtcdError(f"{member.url}/v3/watch: the stream ended")
                if isinstance(item, BaseException):
                    raise EtcdError(f"{member.url}/v3/watch: {type(item).__name__} {item}") from item
                parsed = _watch_line(item)
                if parsed is not None:
                    yield parsed
        finally:
            # also when the caller cancels (the lease keepalive found etcd silent): the reader ends
            stream.stop()
            self._current = (self._current + 1) % len(self._members)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(reader), self.timeout_s + 1)


class _WatchStream:
    """The watch's long response, read in a pool thread; each line (or the end) handed to ``emit``."""

    def __init__(self, member: _Endpoint, body: dict[str, Any], connect_s: float, emit: Callable[[Any], Any]) -> None:
        self.member = member
        self.body = body
        self.connect_s = connect_s
        self.emit = emit
        self._response: Union[requests.Response, None] = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            self._read()
        except BaseException as exc:
            if not self._stopped.is_set():
                self.emit(exc)
            return
        if not self._stopped.is_set():
            self.emit(None)

    def _read(self) -> None:
        member = self.member
        if member.auth is not None and not member._authenticated:
            member.authenticate()
        client = member.client
        # no read timeout (a watch is long); connecting is bounded, and the lease keepalive
        # notices a silent etcd and stops this stream
        response = client.session.post(
            client.get_url("/watch"), json=self.body, stream=True, timeout=(self.connect_s, None)
        )
        with self._lock:
            self._response = response
            if self._stopped.is_set():
                response.close()
                return
        if response.status_code != 200:
            raise EtcdError(f"HTTP {response.status_code}: {response.text[:200]}")
        buffer = b""
        for chunk in response.iter_content(chunk_size=None):
            if self._stopped.is_set():
                return
            buffer += chunk
            if len(buffer) > _MAX_LINE:
                raise EtcdError(f"a response over {_MAX_LINE} bytes")
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.emit(line)

    def stop(self) -> None:
        """Ends the read from the loop's thread: shuts the socket down, which wakes a blocked read."""
        self._stopped.set()
        with self._lock:
            response = self._response
        if response is None:
            return
        sock = getattr(getattr(response.raw, "_connection", None), "sock", None)
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            response.close()


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
