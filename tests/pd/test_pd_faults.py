"""PD under faults (marker ``pd``): the rig of ``test_pd_motor.py`` (bench/pd_rig.py), one for
the module, every part a real process.  Each test injects one fault and then checks that every
request it sent was answered (HTTP 200 or an error naming the cause; the module's pytest
timeout is the bound, never a timing assert), that the prefills still serve, and that a held
prompt is served from its rank's cache again.

The prefills run with ``SGLANG_KVPUB_PD_REGISTER_TIMEOUT_S`` raised, so that "the good request
finished while the bad one's registration was still pending" is an ordering the test can
observe on a loaded machine, not a race against SGLang's 5 s.

The fault that restarts a server (the decode) is also marked ``slow``: CI's PD budget runs
the others; by hand ``pytest -m pd tests/pd/test_pd_faults.py``.  The prefill rank killed
runs last: it leaves one instance a rank short.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import e2e_rig
import pd_load
import pd_rig
import pytest
import sglang_server
from npu.npu_engine import StreamRecorder

pytestmark = [pytest.mark.pd, pytest.mark.timeout(1800)]

PAGE = 128
WORDS = 300
REGISTER_TIMEOUT_S = 600  # longer than any request here takes: the silent address fails when closed
MAX_PENDING = 2  # the registrations' queue, small enough for a test to fill it
WRONG_HOST = "127.0.0.3"  # another loopback address, where no prefill runs
SOAK_S = 60  # CI's soak; the bench's slow run is 600 s and more


@dataclass
class Rig:
    pd: pd_rig.PdRig
    recorders: list[StreamRecorder]
    tokenizer: Any
    held: dict[str, tuple[int, int]] = field(default_factory=dict)  # prompt -> (instance, rank)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("pd-faults")
    model = sglang_server.make_model_dir(work / "model")
    spec = pd_load.soak_spec(
        work,
        model,
        prefill_env={
            "SGLANG_KVPUB_PD_REGISTER_TIMEOUT_S": str(REGISTER_TIMEOUT_S),
            "SGLANG_KVPUB_PD_REGISTER_MAX_PENDING": str(MAX_PENDING),
        },
        adapter_registry=f"file:{work / 'registrations.json'}",  # what an operator runs: kept across a restart
    )
    with pd_rig.PdRig(spec) as pd:
        from transformers import AutoTokenizer

        recorders = [StreamRecorder(s.spec.stream_endpoint, "kv-events") for s in pd.prefills]
        try:
            yield Rig(pd, recorders, AutoTokenizer.from_pretrained(str(model)))
        finally:
            for recorder in recorders:
                recorder.close()


@dataclass
class Answer:
    status: int = 0
    body: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def _post(url: str, payload: dict[str, Any], answer: Answer, timeout_s: float = 900.0) -> None:
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer.status, answer.body = int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        answer.status, answer.body = int(exc.code), exc.read().decode(errors="replace")
    except OSError as exc:
        answer.status, answer.body = -1, repr(exc)
    finally:
        answer.done.set()


def _pd_body(rig: Rig, prompt: str, host: str, rank: int) -> dict[str, Any]:
    """What Motor's pd_dual_dispatch sends, pinned to one prefill rank (``routed_dp_rank``)."""
    body = {"model": rig.pd.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    body |= {"bootstrap_host": host, "bootstrap_port": rig.pd.bootstrap_port, "routed_dp_rank": rank}
    body["bootstrap_room"] = random.randint(0, 2**63 - 1)
    return body


def _send(rig: Rig, prefill: int, body: dict[str, Any], *, to_decode: bool) -> tuple[Answer, Answer | None]:
    """The prefill's half (max_tokens 1) and, if ``to_decode``, the decode's, each in a thread."""
    to_prefill = Answer()
    url = rig.pd.prefills[prefill].spec.base_url
    threading.Thread(target=_post, args=(url, {**body, "max_tokens": 1}, to_prefill), daemon=True).start()
    to_dec = None
    if to_decode:
        to_dec = Answer()
        decode_body = {k: v for k, v in body.items() if k != "routed_dp_rank"}  # the decode has one rank
        threading.Thread(target=_post, args=(rig.pd.decode.spec.base_url, decode_body, to_dec), daemon=True).start()
    return to_prefill, to_dec


@contextlib.contextmanager
def silent_bootstrap(host: str, port: int) -> Iterator[threading.Event]:
    """A listener on the bootstrap port at ``host`` that accepts and never answers (a wrong or
    stalled bootstrap server); gone (its connections reset) when the block ends."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    sock.settimeout(0.1)
    accepted = threading.Event()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(sock.accept()[0])
                accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join()
        sock.close()
        for conn in held:
            conn.close()


def _registration_stats(server: sglang_server.Server) -> list[dict[str, Any]]:
    marker = "sglang_kvpub: bootstrap registrations "
    return [json.loads(line.split(marker, 1)[1]) for line in server.log_text().splitlines() if marker in line]


def test_a_silent_bootstrap_address_stalls_no_other_request_and_fails_its_own(rig: Rig) -> None:
    """A request naming a bootstrap address that accepts and never answers, then a good
    request on the same prefill rank: the good one completes while the bad one's
    registration is still pending; closing the address fails the bad one with the cause."""
    pd = rig.pd
    bad_prompt, good_prompt = e2e_rig.prompt_text(4701, WORDS), e2e_rig.prompt_text(4702, WORDS)
    with silent_bootstrap(WRONG_HOST, pd.bootstrap_port) as accepted:
        bad, _ = _send(rig, 0, _pd_body(rig, bad_prompt, WRONG_HOST, 0), to_decode=False)
        assert accepted.wait(600), "the prefill never tried to register the bad request's rank"
        host = pd.prefills[0].spec.host
        good_prefill, good_decode = _send(rig, 0, _pd_body(rig, good_prompt, host, 0), to_decode=True)
        assert good_decode is not None
        assert good_prefill.done.wait(600) and good_decode.done.wait(600)
        assert (good_prefill.status, good_decode.status) == (200, 200), (good_prefill.body, good_decode.body)
        # The order that matters: the good request is done, the bad one still waits on its
        # registration (the silent address has not answered and is still there).
        assert not bad.done.is_set(), bad.body
    # The address is gone: the pending registration fails, the request ends with the cause.
    assert bad.done.wait(600)
    assert bad.status != 200, bad.body
    assert f"bootstrap server {WRONG_HOST}:{pd.bootstrap_port}" in bad.body, bad.body
    # Gone from the start: a new request to it fails as well (refused), counted, logged once.
    again, _ = _send(rig, 0, _pd_body(rig, e2e_rig.prompt_text(4703, WORDS), WRONG_HOST, 0), to_decode=False)
    assert again.done.wait(600) and again.status != 200, again.body
    log = pd.prefills[0].log_text()
    failed = [s["failed"] for s in _registration_stats(pd.prefills[0])]
    assert failed and sum(failed[-1].values()) >= 1, failed
    for cause in ("unreachable", "timeout"):
        once = [line for line in log.splitlines() if "logged once per cause" in line and f"({cause}:" in line]
        assert len(once) <= 1, once
    # The prefill still serves, through Motor.
    done = pd.complete(good_prompt)
    assert done.status == 200 and done.completion_tokens > 0, (done.status, done.body)
    _outcome(
        "bootstrap server silent, then gone",
        good=(good_prefill.status, good_decode.status),
        bad=(bad.status, bad.body[:200]),
        gone=(again.status, again.body[:120]),
        registrations=_registration_stats(pd.prefills[0])[-1],
    )


def test_a_registration_refused_at_the_right_bootstrap_server_fails_both_halves(rig: Rig) -> None:
    """The registrations' queue is full (a silent address holds it), the request names the
    right bootstrap server: its prefill half fails at once with the cause, and its decode
    half - which finds its rank through that server - fails too instead of waiting for its
    client, both while the silent address's requests still wait."""
    pd = rig.pd
    host = pd.prefills[0].spec.host
    with silent_bootstrap(WRONG_HOST, pd.bootstrap_port) as accepted:
        first, _ = _send(rig, 0, _pd_body(rig, e2e_rig.prompt_text(4750, 20), WRONG_HOST, 0), to_decode=False)
        assert accepted.wait(600), "the prefill never tried to register the first bad request's rank"
        # MAX_PENDING wait behind it; one more is refused: the queue is then full.
        fill = [
            _send(rig, 0, _pd_body(rig, e2e_rig.prompt_text(4751 + n, 20), WRONG_HOST, 0), to_decode=False)[0]
            for n in range(MAX_PENDING + 1)
        ]
        pd.wait_for(lambda: any(a.done.is_set() for a in fill), "one request refused by the full queue", 600)
        refused = [a for a in fill if a.done.is_set()]
        assert len(refused) == 1 and "queue_full" in refused[0].body, [(a.status, a.body[:200]) for a in refused]
        waiting = [a for a in fill if not a.done.is_set()]
        # The request with the right bootstrap server, both halves.
        prefill_half, decode_half = _send(
            rig, 0, _pd_body(rig, e2e_rig.prompt_text(4760, WORDS), host, 0), to_decode=True
        )
        assert decode_half is not None
        assert prefill_half.done.wait(600) and decode_half.done.wait(600)
        # Both answered while the silent address's requests still wait: neither waited on them.
        assert not first.done.is_set() and not any(a.done.is_set() for a in waiting)
    assert prefill_half.status != 200 and "queue_full" in prefill_half.body, prefill_half.body
    assert decode_half.status != 200, decode_half.body
    assert "Decode handshake failed" in decode_half.body and "prefill_dp_rank: -2" in decode_half.body, decode_half.body
    # The silent address gone: its requests end with the cause.
    for answer in (first, *waiting):
        assert answer.done.wait(600) and answer.status != 200, answer.body
    pd.wait_for(
        lambda: any(s["decode_told"] >= 1 for s in _registration_stats(pd.prefills[0])),
        "the stats line of the decode told",
        300,
    )
    stats = next(s for s in reversed(_registration_stats(pd.prefills[0])) if s["decode_told"] >= 1)
    # The prefill and the decode still serve, through Motor.
    done = pd.complete(e2e_rig.prompt_text(4761, WORDS))
    assert done.status == 200 and done.completion_tokens > 0, (done.status, done.body)
    _outcome(
        "registration refused (queue full) at the right bootstrap server",
        prefill=(prefill_half.status, _from(prefill_half.body, "sglang_kvpub:", 200)),
        decode=(decode_half.status, _from(decode_half.body, "Could not fetch", 120)),
        registrations=stats,
    )


# --------------------------------------------------------------------------- the checks after a fault


def _ids(rig: Rig, prompt: str) -> list[int]:
    ids: list[int] = rig.tokenizer(prompt)["input_ids"]
    return ids


def _quiet(rig: Rig) -> None:
    """Every instance stream sent two heartbeats after what it carried when called: the last
    request's events (and its idle flush) passed the fan-in.  Counted by position, so a
    restarted prefill (a new epoch, seqs from 0) is waited for too."""
    starts = [len(r.snapshot()) for r in rig.recorders]
    rig.pd.wait_for(
        lambda: all(
            sum(1 for _, b in r.snapshot()[start:] if not b.events) >= 2
            for r, start in zip(rig.recorders, starts, strict=True)
        ),
        "two heartbeats on every instance stream",
        120,
    )


def _hold(rig: Rig, prompt: str) -> tuple[int, int]:
    """Serves ``prompt`` cold through Motor and waits until the adapter names its holder."""
    _quiet(rig)
    done = rig.pd.complete(prompt)
    assert done.status == 200 and done.completion_tokens > 0, (done.status, done.body, rig.pd.tails())
    holder = done.served
    assert holder is not None, done.prefills
    ids = _ids(rig, prompt)
    rig.pd.wait_for(lambda: rig.pd.held_on(ids, *holder), "the adapter's hit on the held prompt", 120)
    rig.held[prompt] = holder
    return holder


def _truthful(rig: Rig, prompts: list[str]) -> list[pd_rig.PdCompletion]:
    """Each prompt again through Motor: the hit Motor was given equals SGLang's #cached-token on
    the rank that served it (the adapter's index equals each rank's tree: nothing stale)."""
    answers = []
    for prompt in prompts:
        _quiet(rig)
        done = rig.pd.complete(prompt)
        assert done.status == 200 and done.completion_tokens > 0, (done.status, done.body, rig.pd.tails())
        served = done.served
        assert served is not None and done.scores, (done.scores, done.prefills)
        score = done.scores[-1]
        assert score.instance == served[0], (done.scores, done.prefills)
        assert score.matched == done.cached_tokens, (prompt[:20], score.answer, done.prefills, done.dispatches)
        answers.append(done)
    return answers


def _served_from_cache(rig: Rig, prompt: str) -> None:
    """The next repeat of a held prompt: on its holder, every full page from cache."""
    holder = rig.held[prompt]
    ids = _ids(rig, prompt)
    rig.pd.wait_for(lambda: rig.pd.held_on(ids, *holder), "the adapter's hit on the held prompt again", 300)
    (done,) = _truthful(rig, [prompt])
    full = len(ids) // PAGE * PAGE
    assert done.served == holder and done.cached_tokens == full, (holder, done.prefills, done.scores)


def _in_flight(rig: Rig, prompts: list[str]) -> list[tuple[threading.Thread, list[Any]]]:
    """Requests through Motor, each in a thread; every answer lands in its list."""
    started = []

    def post(body: dict[str, Any], out: list[Any]) -> None:
        try:
            out.append(rig.pd.post_completion(body, 900.0))
        except OSError as exc:  # the connection itself ended: the client's error
            out.append((-1, repr(exc), 0.0))

    for prompt in prompts:
        out: list[Any] = []
        body = {"model": rig.pd.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        thread = threading.Thread(target=post, args=(body, out), daemon=True)
        thread.start()
        started.append((thread, out))
    return started


def _answered(flights: list[tuple[threading.Thread, list[Any]]]) -> list[int]:
    """Every request got an answer (the module timeout bounds the wait); their statuses."""
    statuses = []
    for thread, out in flights:
        thread.join()
        assert out, "a request was never answered"
        status, body, _ = out[0]
        assert status == 200 or body, (status, body)  # an error says something
        statuses.append(int(status))
    return statuses


def _no_plugin_failure(rig: Rig) -> None:
    for server in rig.pd.prefills:
        info = server.server_info()
        failures = info["kv_events"]["plugin_failures"]
        assert failures == dict.fromkeys(failures, 0), failures


# --------------------------------------------------------------------------- load, then faults


def test_a_steady_stream_keeps_memory_flat_hits_truthful_and_the_room_table_bounded(rig: Rig) -> None:
    """The short soak of CI (the slow one: ``python bench/pd_load.py soak --seconds 600``)."""
    soak = pd_load.Soak(rig.pd, prompts=6, words=WORDS)
    line = soak.run(SOAK_S, warmup=8, before_each=lambda: _quiet(rig))
    print(json.dumps(line))
    assert line["errors"] == 0 and line["hit_mismatches"] == 0, line
    assert line["hits"] > 0, line
    assert abs(line["rss_growth_max"]) <= 0.10, line
    assert line["room_table"]["stale"] == 0, line


def test_the_adapter_killed_and_restarted_answers_the_same(rig: Rig) -> None:
    pd = rig.pd
    prompt = e2e_rig.prompt_text(4710, WORDS)
    _hold(rig, prompt)
    streams = pd.adapter_text().count("instance stream with dp_size")
    pd.restart_adapter()
    # Restored from its registry file, subscribed to both streams again (snapshot + live tail).
    pd.wait_for(
        lambda: pd.adapter_text().count("instance stream with dp_size") >= streams + len(pd.prefills),
        "the restarted adapter on both instance streams",
    )
    _served_from_cache(rig, prompt)
    _no_plugin_failure(rig)
    _outcome("adapter kill -9 and restart", held_prompt="served from its rank's cache")


def test_motor_coordinator_restarted_routes_by_cache_again(rig: Rig) -> None:
    pd = rig.pd
    prompt = e2e_rig.prompt_text(4720, WORDS)
    _hold(rig, prompt)
    flights = _in_flight(rig, [e2e_rig.prompt_text(4721, WORDS)])
    pd.coordinator.stop()  # its in-flight request ends with its connection
    statuses = _answered(flights)
    pd.coordinator.start()
    pd.coordinator.add_instance(pd._instances_event())
    _served_from_cache(rig, prompt)
    _outcome("Motor coordinator restart", in_flight=statuses, held_prompt="served from its rank's cache")


@pytest.mark.slow  # restarts a server: by hand, outside CI's PD budget
def test_the_decode_killed_mid_transfer_fails_its_requests_and_nothing_stale_remains(rig: Rig) -> None:
    pd = rig.pd
    held = e2e_rig.prompt_text(4730, WORDS)
    _hold(rig, held)
    prompts = [e2e_rig.prompt_text(4731 + n, WORDS) for n in range(3)]
    marks = [len(s.log_text()) for s in pd.prefills]
    flights = _in_flight(rig, prompts)
    # Mid-transfer: a prefill has computed the first of them, whose KV now goes to the decode
    # (the decode holds the others in its queues).
    pd.wait_for(
        lambda: any("Prefill batch" in s.log_text()[m:] for s, m in zip(pd.prefills, marks, strict=True)),
        "a prefill at work on the decode's requests",
        600,
    )
    pd.decode.kill9()
    statuses = _answered(flights)
    pd.decode.start(timeout_s=pd.spec.start_timeout_s)
    pd.coordinator.add_instance(pd._instances_event())
    # The prefills' KV of the aborted transfers: the index equals each rank's tree.
    again = _truthful(rig, prompts)
    _served_from_cache(rig, held)
    _no_plugin_failure(rig)
    _outcome(
        "decode kill -9 mid-transfer",
        in_flight=statuses,
        after_restart=[(d.scores[-1].matched, d.cached_tokens) for d in again],
    )


def test_a_prefill_rank_killed_ends_its_requests_and_the_instance_serves_on(rig: Rig) -> None:
    """One prefill rank's scheduler ``kill -9`` with a request in flight on it.  SGLang 0.5.23's
    DP controller does not watch its schedulers; the plugin's watch (engine/rank_watch.py)
    does: the request in flight ends with a 503 naming the dead rank, the rank's blocks are
    cleared on the instance stream, a request naming that rank ends at once, and the
    instance keeps serving on its live rank.  Last in the module:
    it leaves that instance one rank short (a supervisor restarts it; /health fails when it
    probes the dead rank)."""
    pd = rig.pd
    held = e2e_rig.prompt_text(4740, WORDS)
    holder = _hold(rig, held)
    victim = 1 - holder[0]  # the other instance: the held prompt's instance keeps serving
    server = pd.prefills[victim]
    assert server.proc is not None
    rank1 = sglang_server.scheduler_pid(server.proc.pid, 1)
    host = server.spec.host
    # A prompt held on the rank about to die, known to the adapter there.
    on_rank1 = e2e_rig.prompt_text(4739, WORDS)
    first, first_decode = _send(rig, victim, _pd_body(rig, on_rank1, host, 1), to_decode=True)
    assert first_decode is not None and first.done.wait(600) and first_decode.done.wait(600)
    assert (first.status, first_decode.status) == (200, 200), (first.body, first_decode.body)
    ids1 = _ids(rig, on_rank1)
    pd.wait_for(lambda: pd.held_on(ids1, victim, 1), "the adapter's hit on the dead-to-be rank", 300)
    to_prefill, to_decode = _send(rig, victim, _pd_body(rig, e2e_rig.prompt_text(4741, WORDS), host, 1), to_decode=True)
    assert to_decode is not None
    os.kill(rank1, signal.SIGKILL)
    assert to_prefill.done.wait(600), "the request in flight on the dead rank was never answered"
    assert to_prefill.status == 503 and "DP rank 1 of this instance is dead" in to_prefill.body, to_prefill.body
    # Its cache is gone with it: the instance stream cleared the rank, the adapter dropped it.
    pd.wait_for(lambda: pd.held_on(ids1, victim, None) is None, "the dead rank's blocks dropped", 300)
    # A request naming the dead rank ends at once, with the same cause.
    pinned, _ = _send(rig, victim, _pd_body(rig, e2e_rig.prompt_text(4742, 20), host, 1), to_decode=False)
    assert pinned.done.wait(600) and pinned.status == 503, pinned.body
    assert "DP rank 1 of this instance is dead" in pinned.body, pinned.body
    # The instance serves on: requests through Motor, to either instance, all answered.
    served = [pd.complete(e2e_rig.prompt_text(4743 + n, WORDS)) for n in range(4)]
    assert all(d.status == 200 and d.completion_tokens > 0 for d in served), [(d.status, d.body) for d in served]
    _served_from_cache(rig, held)
    deaths = [line for line in server.log_text().splitlines() if "sglang_kvpub: DP rank 1 is dead" in line]
    assert len(deaths) == 1, deaths  # logged once
    _outcome(
        "prefill rank kill -9",
        in_flight=(to_prefill.status, _from(to_prefill.body, "sglang_kvpub:", 160)),
        pinned_to_dead_rank=pinned.status,
        decode_half_answered=to_decode.done.is_set(),
        decode_half=(to_decode.status, _from(to_decode.body, "with exception", 200))
        if to_decode.done.is_set()
        else None,
        after=[d.status for d in served],
        dead_rank_blocks="dropped by the adapter",
        watch=deaths[0].split("rank watch ", 1)[-1][:160],
    )


def _from(body: str, marker: str, length: int) -> str:
    """The part of an error body that names the cause."""
    at = body.find(marker)
    return body[at : at + length] if at >= 0 else body[:length]


def _outcome(fault: str, **fields: Any) -> None:
    """The fault's outcome line (``pytest -s``)."""
    print(json.dumps({"fault": fault, **fields}, default=str), flush=True)
