"""PD under faults (marker ``pd``): the rig of ``test_pd_motor.py`` (bench/pd_rig.py), one for
the module, every part a real process.  Each test injects one fault and then checks that every
request it sent was answered (HTTP 200 or an error naming the cause; the module's pytest
timeout is the bound, never a timing assert), that the prefills still serve, and that a held
prompt is served from its rank's cache again.

The prefills run with ``SGLANG_KVPUB_PD_REGISTER_TIMEOUT_S`` raised, so that "the good request
finished while the bad one's registration was still pending" is an ordering the test can
observe on a loaded machine, not a race against SGLang's 5 s.
"""

from __future__ import annotations

import contextlib
import json
import random
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
WRONG_HOST = "127.0.0.3"  # another loopback address, where no prefill runs
SOAK_S = 90  # CI's soak; the bench's slow run is 600 s and more


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
        prefill_env={"SGLANG_KVPUB_PD_REGISTER_TIMEOUT_S": str(REGISTER_TIMEOUT_S)},
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
        threading.Thread(target=_post, args=(rig.pd.decode.spec.base_url, body, to_dec), daemon=True).start()
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
