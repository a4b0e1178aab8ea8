"""A dead DP rank noticed in the controller process (sglang_kvpub/engine/rank_watch.py).

Real parts: real scheduler-like child processes (``multiprocessing``, killed with SIGKILL),
a real ZMQ PULL socket where SGLang's tokenizer manager would be, SGLang's own ``AbortReq``
and ``sock_recv`` to read what arrives there.  The controller is a stand-in with the
attributes SGLang 0.5.23's ``DataParallelController`` has (``scheduler_procs``, ``status``,
``port_args.tokenizer_ipc_name``); the real one is exercised in ``test_server_rank_death.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang_server  # bench/sglang_server.py (tests/server/conftest.py puts bench/ on the path)
import zmq

from sglang_kvpub.engine import rank_watch

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]

# SGLang's io_struct imports torchvision through its configs: on a CPU-only machine the
# tests' stand-ins (bench/cpu_shims) provide it, as they do for the real servers.
_SHIMS = sglang_server.cpu_shim_dir()
if _SHIMS is not None and str(_SHIMS) not in sys.path:
    sys.path.append(str(_SHIMS))
    from torchvision_stub import install_torchvision_stub  # bench/cpu_shims

    install_torchvision_stub()
if os.environ.get("KVPUB_REQUIRE_SGLANG") != "1":
    pytest.importorskip("sglang.srt.managers.io_struct")
from sglang.srt.managers.io_struct import AbortReq, sock_recv  # noqa: E402


def _scheduler(rank: int, ready: Any) -> None:
    import setproctitle

    setproctitle.setproctitle(f"sglang::scheduler_DP{rank}")  # what SGLang's scheduler calls itself
    ready.set()
    threading.Event().wait()


def _proc(rank: int) -> multiprocessing.Process:
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    proc = context.Process(target=_scheduler, args=(rank, ready))
    proc.start()
    ready.wait()  # as SGLang's controller waits for each scheduler's ready message
    return proc


class _Controller(types.SimpleNamespace):
    pass


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[_Controller, Any]]:
    endpoint = f"ipc://{tmp_path / 'tokenizer'}"
    context = zmq.Context()
    tokenizer = context.socket(zmq.PULL)
    tokenizer.bind(endpoint)
    procs = [_proc(0), _proc(1)]
    controller = _Controller(
        scheduler_procs=procs,
        status=[True, True],
        port_args=types.SimpleNamespace(tokenizer_ipc_name=endpoint),
    )
    try:
        yield controller, tokenizer
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        tokenizer.close(0)
        context.term()


def _req(rid: str, routed: int | None = None) -> Any:
    return types.SimpleNamespace(rid=rid, routed_dp_rank=routed, http_worker_ipc=None)


def test_a_killed_rank_ends_its_requests_and_is_skipped_afterwards(rig: tuple[_Controller, Any]) -> None:
    controller, tokenizer = rig
    watch = rank_watch.attach_rank_watch(controller)
    assert watch is not None and sorted(watch.procs) == [0, 1]
    for n in range(3):
        watch.sent(1, _req(f"r1-{n}"))
    watch.sent(0, _req("r0"))
    os.kill(controller.scheduler_procs[1].pid, signal.SIGKILL)
    aborts = [sock_recv(tokenizer) for _ in range(3)]
    assert all(isinstance(a, AbortReq) for a in aborts)
    assert sorted(a.rid for a in aborts) == ["r1-0", "r1-1", "r1-2"]  # rank 0's request untouched
    reason = aborts[0].finished_reason
    assert (
        reason["status_code"] == 503 and "DP rank 1" in reason["message"] and "exited with code -9" in reason["message"]
    )
    assert watch.stats() == {"ranks": 2, "dead": [1], "aborted_in_flight": 3, "refused": 0}
    # The controller's thread, at its next dispatch: SGLang's status says rank 1 is out.
    assert watch.before_dispatch(controller, _req("next")) is False
    assert controller.status == [True, False]
    # A request naming the dead rank is ended, not sent.
    assert watch.before_dispatch(controller, _req("pinned", routed=1)) is True
    refused = sock_recv(tokenizer)
    assert refused.rid == "pinned" and refused.finished_reason["status_code"] == 503
    assert watch.stats()["refused"] == 1


def test_what_is_remembered_per_rank_is_bounded(rig: tuple[_Controller, Any]) -> None:
    controller, _ = rig
    ended: list[str] = []
    watch = rank_watch.RankWatch(
        {0: [controller.scheduler_procs[0]]}, lambda rid, route, msg: ended.append(rid), max_tracked=4
    )
    for n in range(10):
        watch.sent(0, _req(f"r{n}"))
    watch.rank_died(0, "test")
    watch.rank_died(0, "test again")  # once per rank
    assert ended == ["r6", "r7", "r8", "r9"]
    assert watch.stats()["aborted_in_flight"] == 4


def test_no_processes_to_watch_is_said_and_nothing_attached() -> None:
    controller = _Controller(scheduler_procs=[], status=[True])
    assert rank_watch.attach_rank_watch(controller) is None
    assert rank_watch.active(controller) is None


def test_a_request_sent_as_its_rank_dies_is_ended_too(rig: tuple[_Controller, Any]) -> None:
    """The controller checked the rank, the rank died, the request went out: ended on record."""
    controller, _ = rig
    ended: list[str] = []
    watch = rank_watch.RankWatch({0: [controller.scheduler_procs[0]]}, lambda rid, route, msg: ended.append(rid))
    watch.rank_died(0, "test")
    watch.sent(0, _req("late"))
    assert ended == ["late"] and watch.stats()["aborted_in_flight"] == 1


def test_a_pd_request_of_a_dead_rank_has_its_room_registered_as_failed(rig: tuple[_Controller, Any]) -> None:
    """Its decode, if it still asks the bootstrap server for the room's rank, gets FAILED_RANK."""
    import http.server
    import json

    from sglang_kvpub.engine.pd_register import FAILED_RANK

    rooms: dict[int, int] = {}
    arrived = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rooms[int(data["bootstrap_room"])] = int(data["dp_rank"])
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")
            arrived.set()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        controller, _ = rig
        watch = rank_watch.RankWatch(
            {0: [controller.scheduler_procs[0]]}, lambda *a: None, bootstrap_port=server.server_address[1]
        )
        req = types.SimpleNamespace(rid="pd", http_worker_ipc=None, bootstrap_host="127.0.0.1", bootstrap_room=77)
        watch.sent(0, req)
        watch.rank_died(0, "test")
        assert arrived.wait(60)
        assert rooms == {77: FAILED_RANK}
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_watch_is_contained_and_switched_off() -> None:
    from sglang_kvpub.engine import guard

    class Broken(rank_watch.RankWatch):
        def before_dispatch(self, controller: Any, req: Any) -> bool:
            raise RuntimeError("boom")

    controller = _Controller(status=[True])
    watch = Broken({}, lambda *a: None)
    setattr(controller, rank_watch.WATCH_ATTR, watch)
    guard.reset()
    try:
        assert rank_watch.active(controller) is watch
        assert rank_watch.ended_here(watch, controller, _req("x")) is False  # dispatch goes on
        assert guard.disabled(guard.RANK_WATCH) and rank_watch.active(controller) is None
        assert guard.stats()["failures"][guard.RANK_WATCH] == 1
    finally:
        guard.reset()
