"""A PD prefill request's DP rank, registered with the bootstrap server off the scheduler thread.

With any load-balance method but ``follow_bootstrap_room`` (the plugin's PD mode makes
``auto`` ``round_robin``, core/load_balance.py), SGLang 0.5.23's prefill sender registers
each request's rank with the bootstrap server named in the request
(``CommonKVSender._register_prefill_dp_rank``: ``POST /register_dp_rank``, 5 s timeout)
from the prefill scheduler's own thread.  One slow or wrong bootstrap address then stalls
every other request of that scheduler for up to 5 s.  The decode needs nothing more than
the registration to have landed by the time it asks (``/query_dp_ranks``, retried every
decode step until it answers), so the POST need not happen on the scheduler thread.

The plugin's AROUND hook on that method hands it to a :class:`Registrar` instead: one lane
(a thread with a bounded queue and one kept-alive connection) per bootstrap address, so
a bad address delays only the requests that name it.  A registration that fails (no
answer within the timeout, refused, an HTTP error, the queue full) fails its request at
once through SGLang's own path (``record_failure`` + ``KVPoll.Failed``): the prefill
aborts it with the cause as the error, instead of holding its KV until SGLang's
bootstrap timeout (300 s).  When the address does not answer at all, the requests queued
behind on that lane fail with the same cause rather than each waiting for its own
timeout.  Failures are counted per cause and logged once per cause.

The decode of a failed request asks the same bootstrap server for the room's rank and,
finding none, would ask again every step until its client gives up.  So the lane then
registers the room with :data:`FAILED_RANK`, a rank no prefill has: the decode's
receiver finds no bootstrap entry for it (``/route`` answers 404) and SGLang's decode
aborts the request ("Decode handshake failed ... prefill_dp_rank: -2").  These notices
are posted before the lane's next registration, bounded apart from the registrations
(:data:`MAX_NOTICES`); one the address does not take is counted (``decode_not_told``).

The scheduler thread's part is an enqueue (microseconds; :meth:`Registrar.stats`
``scheduler_us_per_request``), where SGLang's POST took ``post_ms_per_request``.
See docs/dispatch.md ("The rank registration").
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

__all__ = [
    "TARGET_REGISTER",
    "TIMEOUT_ENV",
    "MAX_PENDING_ENV",
    "FAILED_RANK",
    "Registrar",
    "registrar",
    "register_hook",
    "install_register_hook",
]

log = logging.getLogger(__name__)

TARGET_REGISTER = "sglang.srt.disaggregation.common.conn.CommonKVSender._register_prefill_dp_rank"
CONN_MODULE = "sglang.srt.disaggregation.common.conn"

TIMEOUT_S = 5.0  # SGLang's own timeout for this POST
TIMEOUT_ENV = "SGLANG_KVPUB_PD_REGISTER_TIMEOUT_S"  # overrides it (seconds)
MAX_PENDING = 1024  # registrations waiting over all lanes
MAX_PENDING_ENV = "SGLANG_KVPUB_PD_REGISTER_MAX_PENDING"  # overrides it
MAX_LANES = 16  # distinct bootstrap addresses with a registration in flight
MAX_NOTICES = 1024  # failed rooms waiting to be announced to their decode, over all lanes
FAILED_RANK = -2  # registered for a failed room: no prefill rank has it, so the decode fails it
IDLE_EXIT_S = 30.0  # a lane's thread ends after this long without work
STATS_EVERY_S = 10.0  # at most one stats line per this period, while registrations happen

OnFailure = Callable[[str], None]


@dataclasses.dataclass
class _Job:
    room: int
    rank: int
    on_failure: OnFailure


class _Lane:
    """One bootstrap address: a thread, its queue, its connection."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.jobs: collections.deque[_Job] = collections.deque()
        self.notices: collections.deque[int] = collections.deque()  # failed rooms for the decode
        self.connection: http.client.HTTPConnection | None = None
        self.thread: threading.Thread | None = None


class Registrar:
    """Posts ``/register_dp_rank`` per bootstrap address on lane threads; never blocks the caller."""

    def __init__(
        self,
        *,
        timeout_s: float = TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        max_lanes: int = MAX_LANES,
        max_notices: int = MAX_NOTICES,
        idle_exit_s: float = IDLE_EXIT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_lanes = max_lanes
        self.max_notices = max_notices
        self.idle_exit_s = idle_exit_s
        self._lock = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._unstarted: list[_Lane] = []
        self._starter: threading.Thread | None = None
        self._pending = 0
        self._notices = 0
        self.submitted = 0
        self.registered = 0
        self.failed: collections.Counter[str] = collections.Counter()
        self.decode_told = 0  # failed rooms registered with FAILED_RANK
        self.decode_not_told: collections.Counter[str] = collections.Counter()  # per cause
        self.scheduler_s = 0.0  # time the callers spent in submit()
        self.scheduler_max_s = 0.0
        # The same as this thread's CPU time: what a loaded machine's preemptions do not inflate.
        self.scheduler_cpu_s = 0.0
        self.post_s = 0.0  # time the POSTs took on the lanes
        self.posts = 0
        self._logged: set[str] = set()
        self._last_stats_line = 0.0

    # ------------------------------------------------------------------ caller side

    def submit(self, address: str, room: int, rank: int, on_failure: OnFailure) -> None:
        """Queues one registration (``address``: ``host:port`` of the bootstrap server)."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        refused = None
        with self._lock:
            self.submitted += 1
            lane = self._lanes.get(address)
            if self._pending >= self.max_pending:
                refused = f"{self._pending} registrations already waiting (bound {self.max_pending})"
            elif lane is None and len(self._lanes) >= self.max_lanes:
                refused = f"{len(self._lanes)} bootstrap addresses already in flight (bound {self.max_lanes})"
            else:
                if lane is None:
                    lane = self._lanes[address] = _Lane(address)
                    self._unstarted.append(lane)  # its thread is started by the starter, not here
                lane.jobs.append(_Job(room, rank, on_failure))
                self._pending += 1
                self._lock.notify_all()
                if self._starter is None:  # only when start() was not called first
                    self._start_starter()
            elapsed = time.perf_counter() - start
            self.scheduler_cpu_s += time.thread_time() - cpu_start
            self.scheduler_s += elapsed
            self.scheduler_max_s = max(self.scheduler_max_s, elapsed)
        if refused is not None:
            self._fail([_Job(room, rank, on_failure)], address, "queue_full", refused)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            done = self.submitted or 1
            return {
                "submitted": self.submitted,
                "registered": self.registered,
                "failed": dict(self.failed),
                "decode_told": self.decode_told,
                "decode_not_told": dict(self.decode_not_told),
                "pending": self._pending,
                "notices": self._notices,
                "lanes": len(self._lanes),
                "scheduler_us_per_request": round(self.scheduler_s / done * 1e6, 2),
                "scheduler_us_max": round(self.scheduler_max_s * 1e6, 1),
                "scheduler_cpu_us_per_request": round(self.scheduler_cpu_s / done * 1e6, 2),
                "post_ms_per_request": round(self.post_s / (self.posts or 1) * 1e3, 3),
            }

    def start(self) -> None:
        """Starts the thread that starts the lanes; called where SGLang installs the hook,
        before the scheduler serves, so no request pays for a thread start."""
        with self._lock:
            if self._starter is None:
                self._start_starter()

    def _start_starter(self) -> None:
        self._starter = threading.Thread(target=self._start_lanes, name="kvpub-register", daemon=True)
        self._starter.start()

    # ------------------------------------------------------------------ lanes

    def _start_lanes(self) -> None:
        """Starts each new lane's thread: starting a thread waits for it to run, which under
        the GIL can take milliseconds, so the caller (a scheduler) never does it."""
        while True:
            with self._lock:
                while not self._unstarted:
                    self._lock.wait()
                lanes, self._unstarted = self._unstarted, []
                for lane in lanes:
                    lane.thread = threading.Thread(
                        target=self._run, args=(lane,), name=f"kvpub-register-{lane.address}", daemon=True
                    )
                    lane.thread.start()

    def _run(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                deadline = time.monotonic() + self.idle_exit_s
                while not lane.jobs and not lane.notices:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        del self._lanes[lane.address]
                        if lane.connection is not None:
                            lane.connection.close()
                        return
                    self._lock.wait(left)
                if lane.notices:  # a decode waits on each: before the next registration
                    room = lane.notices.popleft()
                    self._notices -= 1
                    job = None
                else:
                    job = lane.jobs.popleft()
                    self._pending -= 1
            if job is None:
                self._notify(lane, room)
                continue
            cause, detail, unreachable = self._post(lane, job.room, job.rank)
            if cause is None:
                with self._lock:
                    self.registered += 1
                self._maybe_log_stats()
                continue
            failed = [job]
            if unreachable:  # the ones behind it would wait for the same silence
                with self._lock:
                    failed += list(lane.jobs)
                    self._pending -= len(lane.jobs)
                    lane.jobs.clear()
            self._fail(failed, lane.address, cause, detail)

    def _notify(self, lane: _Lane, room: int) -> None:
        """Registers a failed room with FAILED_RANK, so that its decode fails it too."""
        cause, detail, unreachable = self._post(lane, room, FAILED_RANK)
        with self._lock:
            if cause is None:
                self.decode_told += 1
                first_told = self.decode_told == 1
        if cause is None:
            self._maybe_log_stats(force=first_told)
            return
        with self._lock:
            dropped = 1
            if unreachable:  # the rest would wait for the same silence
                dropped += len(lane.notices)
                self._notices -= len(lane.notices)
                lane.notices.clear()
            self.decode_not_told[cause] += dropped
            first = f"notice:{cause}" not in self._logged
            self._logged.add(f"notice:{cause}")
        if first:
            log.error(
                "sglang_kvpub: telling the decode through the bootstrap server %s that a registration "
                "failed did not work, %s, %s; such a decode waits until its client gives up "
                "(logged once per kind; counted as decode_not_told)",
                lane.address,
                cause,
                detail,
            )

    def _tell_decode(self, address: str, rooms: list[int]) -> None:
        """Queues a notice per failed room on its address's lane (bounded)."""
        with self._lock:
            lane = self._lanes.get(address)
            if lane is None:
                if len(self._lanes) >= self.max_lanes:
                    self.decode_not_told["no_lane"] += len(rooms)
                    return
                lane = self._lanes[address] = _Lane(address)
                self._unstarted.append(lane)
                if self._starter is None:
                    self._start_starter()
            room_left = max(0, self.max_notices - self._notices)
            lane.notices.extend(rooms[:room_left])
            self._notices += min(room_left, len(rooms))
            if len(rooms) > room_left:
                self.decode_not_told["notices_full"] += len(rooms) - room_left
            self._lock.notify_all()

    def _post(self, lane: _Lane, room: int, rank: int) -> tuple[str | None, str, bool]:
        """(cause or None, detail, whether the address is unreachable)."""
        body = json.dumps({"bootstrap_room": room, "dp_rank": rank})
        start = time.perf_counter()
        try:
            if lane.connection is None:
                host, port = _split(lane.address)
                lane.connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            lane.connection.request(
                "POST", "/register_dp_rank", body=body, headers={"Content-Type": "application/json"}
            )
            response = lane.connection.getresponse()
            text = response.read(512).decode("utf-8", "replace")
            if response.status != 200:
                return "http_error", f"HTTP {response.status}: {text.strip()[:200]}", False
            return None, "", False
        except (TimeoutError, OSError, http.client.HTTPException, ValueError) as exc:
            if lane.connection is not None:
                lane.connection.close()
                lane.connection = None
            cause = "timeout" if isinstance(exc, TimeoutError) else "unreachable"
            return cause, f"{type(exc).__name__}: {exc}", True
        finally:
            with self._lock:
                self.post_s += time.perf_counter() - start
                self.posts += 1

    def _fail(self, jobs: list[_Job], address: str, cause: str, detail: str) -> None:
        message = (
            f"sglang_kvpub: registering the prefill DP rank with the bootstrap server {address} "
            f"failed ({cause}: {detail}); the decode could not find this request's rank"
        )
        with self._lock:
            self.failed[cause] += len(jobs)
            first = cause not in self._logged
            self._logged.add(cause)
        if first:
            log.error("%s (logged once per cause; counted in the registration stats)", message)
        self._maybe_log_stats(force=first)
        for job in jobs:
            try:
                job.on_failure(message)
            except Exception as exc:  # the request is SGLang's: never let it kill the lane
                log.warning("sglang_kvpub: failing bootstrap room %d: %r", job.room, exc)
        self._tell_decode(address, [job.room for job in jobs])

    def _maybe_log_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_line < STATS_EVERY_S:
            return
        self._last_stats_line = now
        log.info("sglang_kvpub: bootstrap registrations %s", json.dumps(self.stats(), sort_keys=True))


def _split(address: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(f"//{address}")
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"bootstrap address {address!r} is not host:port")
    return parsed.hostname, parsed.port


_registrar: Registrar | None = None
_registrar_lock = threading.Lock()


def registrar() -> Registrar:
    """This process's registrar (one per scheduler process)."""
    global _registrar
    with _registrar_lock:
        if _registrar is None:
            _registrar = Registrar(
                timeout_s=_positive_from_env(TIMEOUT_ENV, TIMEOUT_S),
                max_pending=int(_positive_from_env(MAX_PENDING_ENV, MAX_PENDING)),
            )
        return _registrar


def _positive_from_env(name: str, default: float) -> float:
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        log.warning("sglang_kvpub: %s=%r is not a positive number; using %s", name, raw, default)
        return default
    return value


def _fail_room(kv_mgr: Any, room: int) -> OnFailure:
    def on_failure(message: str) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        kv_mgr.record_failure(room, message)
        kv_mgr.update_status(room, KVPoll.Failed)  # no-op once the room concluded or was cleared

    return on_failure


def register_hook(original: Callable[..., Any], sender: Any) -> Any:
    """AROUND ``CommonKVSender._register_prefill_dp_rank``: queue it, return at once."""
    from sglang_kvpub.engine import guard

    # Registered only where the plugin is enabled (plugin.register).
    if guard.disabled(guard.PD_REGISTER):
        return original(sender)
    try:
        room = int(sender.bootstrap_room)
        registrar().submit(
            str(sender.bootstrap_server_url), room, int(sender.kv_mgr.attn_dp_rank), _fail_room(sender.kv_mgr, room)
        )
    except Exception as exc:
        guard.fail(guard.PD_REGISTER, exc)
        return original(sender)
    return None


def install_register_hook(registry: Any, hook_type: Any) -> bool:
    """Registers the hook in a process that has SGLang's PD connection module loaded."""
    import sys

    if CONN_MODULE not in sys.modules:
        return False
    registry.register(TARGET_REGISTER, register_hook, hook_type.AROUND)
    registrar().start()
    return True
