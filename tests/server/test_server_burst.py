"""A real ``sglang.launch_server`` (CPU, --dp-size 2, ``--plugin sglang_kvpub``) given a burst of
identical long prompts - a GRPO group, each member sent while the first is still being
prefilled: each rank that serves the group computes the prompt once and the others wait for it
(docs/dispatch.md, "Pending prefixes"), counted from SGLang's own ``cached_tokens`` (its
``#cached-token``).  Members that reach one rank in the same scheduler step are prefilled side
by side by SGLang (any schedule policy), so each is sent once the one before was dispatched
and, when that one computes the prompt, once its rank's prefill began."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import sglang_server, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PAGE = 16
DP = 2
GROUP = 6  # members of the group, sent together
LONG = 600  # tokens per member: 37 full pages + 8


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sglang_server.Server]:
    made = start_server(
        model_dir,
        tmp_path_factory.mktemp("server-burst"),
        plugin=True,
        page_size=PAGE,
        dp_size=DP,
        max_total_tokens=4096,
        kv_events_extra={"heartbeat_s": 0.2, "dispatch_log": "info"},
    )
    try:
        yield made
    finally:
        made.stop()


PREFILL = r"DP{rank}\] Prefill batch, #new-seq: \d+, #new-token: [1-9]\d{{2}}"  # one rank computing >= 100
DECISION = r"dp_dispatch policy=cache_aware dp_rank=(\d) reason=(\w+) isl=600 matched=(\d+)"


def _decisions(server: sglang_server.Server) -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = re.findall(DECISION, server.log_text())
    return found


def _prefills(server: sglang_server.Server, rank: int) -> int:
    return len(re.findall(PREFILL.format(rank=rank), server.log_text()))


def _burst(server: sglang_server.Server, ids: list[int]) -> list[dict[str, Any]]:
    """``GROUP`` requests of ``ids``, each sent as soon as the controller dispatched the one
    before (its decision line) - or, when the one before computes the prompt on its rank
    (matched 0), once that rank's prefill began (its ``Prefill batch`` line): a busy host can
    otherwise leave both in that rank's waiting queue for one step.  Their meta_info."""
    out: list[dict[str, Any] | BaseException] = [RuntimeError("not sent")] * GROUP
    before = len(_decisions(server))

    def member(i: int) -> None:
        try:
            out[i] = server.generate(ids)["meta_info"]
        except BaseException as exc:  # reported below, with the server's log
            out[i] = exc

    threads = [threading.Thread(target=member, args=(i,)) for i in range(GROUP)]
    for i, t in enumerate(threads):
        batches = [_prefills(server, rank) for rank in range(DP)]
        t.start()
        deadline = time.monotonic() + 120.0
        while len(_decisions(server)) < before + i + 1:  # polling the controller's log with a deadline
            assert time.monotonic() < deadline, server.log_tail(30)
            time.sleep(0.02)
        rank, _, matched = _decisions(server)[before + i]
        while matched == "0" and _prefills(server, int(rank)) <= batches[int(rank)]:  # its prefill began
            assert time.monotonic() < deadline, server.log_tail(30)
            time.sleep(0.02)
    for t in threads:
        t.join()
    failed = [o for o in out if isinstance(o, BaseException)]
    assert not failed, f"{failed}\n{server.log_tail(40)}"
    return [o for o in out if isinstance(o, dict)]


def test_a_group_sent_during_the_first_prefill_is_prefilled_once_per_serving_rank(server: sglang_server.Server) -> None:
    ids = sglang_server.prompt_ids(49, LONG)
    served = _burst(server, ids)
    full = (LONG // PAGE) * PAGE
    ranks = Counter(m["dp_rank"] for m in served)
    computed = Counter(m["dp_rank"] for m in served if m["cached_tokens"] < full)
    waited = [m for m in served if m["cached_tokens"] == full]
    counts = [(m["dp_rank"], m["cached_tokens"]) for m in served]
    print(f"burst of {GROUP}: (dp_rank, cached_tokens) {counts}")  # the figures, in the -s output
    # Each rank that served the group computed the prompt once; every other member was served
    # from the cache that prefill filled.
    assert computed == Counter(set(ranks.elements())), (served, server.log_tail(30))
    assert len(waited) == GROUP - len(ranks) >= GROUP - DP, served
    # The dispatcher sent the members to the ranks prefilling it: every decision after the first
    # on a rank matched the whole prompt (pending or published), none recomputed it elsewhere.
    decisions = _decisions(server)
    assert len(decisions) >= GROUP, decisions
    recomputed = [d for d in decisions[-GROUP:] if d[2] == "0"]
    assert len(recomputed) == len(ranks), decisions
