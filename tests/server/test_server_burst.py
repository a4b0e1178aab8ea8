"""A real ``sglang.launch_server`` (CPU, --dp-size 2, ``--plugin sglang_kvpub``) given a burst of
identical long prompts at once - a GRPO group: each rank that serves the group computes the
prompt once and the others wait for it (docs/dispatch.md, "Pending prefixes"), counted from
SGLang's own ``cached_tokens`` (its ``#cached-token``)."""

from __future__ import annotations

import re
import threading
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
        extra_args=("--schedule-policy", "lpm"),
    )
    try:
        yield made
    finally:
        made.stop()


def _burst(server: sglang_server.Server, ids: list[int]) -> list[dict[str, Any]]:
    """``GROUP`` requests of ``ids`` released at once from as many threads; their meta_info."""
    start = threading.Barrier(GROUP)
    out: list[dict[str, Any] | BaseException] = [RuntimeError("not sent")] * GROUP

    def member(i: int) -> None:
        start.wait()
        try:
            out[i] = server.generate(ids)["meta_info"]
        except BaseException as exc:  # reported below, with the server's log
            out[i] = exc

    threads = [threading.Thread(target=member, args=(i,)) for i in range(GROUP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [o for o in out if isinstance(o, BaseException)]
    assert not failed, f"{failed}\n{server.log_tail(40)}"
    return [o for o in out if isinstance(o, dict)]


def test_a_group_sent_together_is_prefilled_once_per_serving_rank(server: sglang_server.Server) -> None:
    ids = sglang_server.prompt_ids(49, LONG)
    served = _burst(server, ids)
    full = (LONG // PAGE) * PAGE
    ranks = Counter(m["dp_rank"] for m in served)
    computed = Counter(m["dp_rank"] for m in served if m["cached_tokens"] < full)
    waited = [m for m in served if m["cached_tokens"] == full]
    # Each rank that served the group computed the prompt once; every other member was served
    # from the cache that prefill filled.
    assert computed == Counter(set(ranks.elements())), (served, server.log_tail(30))
    assert len(waited) == GROUP - len(ranks) >= GROUP - DP, served
    # The dispatcher sent the members to the ranks prefilling it: every decision after the first
    # on a rank matched the whole prompt (pending or published), none recomputed it elsewhere.
    line = r"dp_dispatch policy=cache_aware dp_rank=(\d) reason=(\w+) isl=600 matched=(\d+)"
    decisions = re.findall(line, server.log_text())
    assert len(decisions) >= GROUP, decisions
    recomputed = [d for d in decisions[-GROUP:] if d[2] == "0"]
    assert len(recomputed) == len(ranks), decisions
