"""The same real server WITHOUT the plugin (SGLang's default Rust tree core): the baseline.

What a router sees without ``--plugin sglang_kvpub``: one stream per DP rank on
``base + rank``, each carrying its own rank only, and SGLang's round robin sends a repeated
prompt to the other rank (no cached tokens) - the two things the plugin changes
(tests/server/test_server_plugin.py).  Installed but not enabled, the plugin adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from npu.npu_engine import StreamRecorder

from sglang_kvpub import wire

from .conftest import sglang_server, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

PAGE = 16
DP = 2


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sglang_server.Server]:
    server = start_server(model_dir, tmp_path_factory.mktemp("server-plain"), plugin=False, tree_core="rust")
    try:
        yield server
    finally:
        server.stop()


def test_per_rank_streams_and_no_plugin_hooks(plain: sglang_server.Server) -> None:
    kv = plain.server_info()["kv_events"]
    assert kv["publisher"] == "zmq" and "fanned_in" not in kv and kv["dp_size"] == DP
    base = plain.spec.kv_port
    recorders = {rank: StreamRecorder(f"tcp://127.0.0.1:{base + rank}", sglang_server.TOPIC) for rank in range(DP)}
    try:
        for rank in range(DP):
            plain.generate(sglang_server.prompt_ids(300 + rank, 4 * PAGE + 1), dp_rank=rank)
        for rank, recorder in recorders.items():

            def own_rank_only(stream: list[tuple[int, wire.EventBatch]], rank: int = rank) -> None:
                ranks = {b.dp_rank for _, b in stream if b.events}
                assert ranks == {rank}, ranks

            recorder.wait_for(own_rank_only, timeout=60)
    finally:
        for recorder in recorders.values():
            recorder.close()
    log = plain.log_text()
    assert "sglang_kvpub" not in log.replace("--plugin sglang_kvpub", "")


def test_round_robin_sends_the_repeat_to_the_other_rank(plain: sglang_server.Server) -> None:
    ids = sglang_server.prompt_ids(11, 600)
    first = plain.generate(ids)["meta_info"]
    second = plain.generate(ids)["meta_info"]
    assert second["dp_rank"] != first["dp_rank"]
    assert second["cached_tokens"] == 0  # the prefix sits on the other rank
