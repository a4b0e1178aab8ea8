"""The folded view of a real ``sglang.launch_server`` (CPU, --dp-size 2, both tree cores).

A system prefix is cached on both ranks; rank 0 alone evicts it under load while rank 1
keeps it and stores a child of it; then ``/flush_cache`` clears every rank and both ranks
fill again.  After each phase, for every prompt:

- the truth: the instance stream read rank by rank (our decoder), the longest hit over ranks;
- NVIDIA Dynamo's indexer registered ONCE on the folded view (one worker, no rank) must agree;
- the strict positional reader written from Motor 3.1's rules (tests/motor_positional.py)
  on the folded view (array encoding) must agree and decode every batch;
- the negative control: the instance stream read the same way (every batch credited to one
  worker) must be wrong after the one-rank eviction.

The adapter registered for the instance counts the removals by rank and reason
(``motor_kv_adapter_removed_blocks_total``); ``/server_info`` lists both views.

Then the whole instance restarts (the server is stopped and started again on the same ports:
a new process, a new fan-in epoch, every rank's cache empty) and one rank stores again:

- Dynamo's indexer (registered with the view's replay endpoint, as a once-per-endpoint
  router registers an instance) drops every hash of the instance before the restart and
  sees the new stores - it reads the new epoch's higher seq as a gap and replays, and the
  view answers with a snapshot that clears first;
- the positional reader re-registered after the restart (Motor re-registers an instance
  that comes back; it does not check seqs) agrees on the new epoch's batches and on the
  view's three-frame replay from 0;
- ``sglang-kvpub tail --check`` on the instance stream across the restart reports the
  restart and no gap, instance-level or per rank; the same check over the recorded stream
  with one rank batch taken out reports that rank's gap.

Before that restart, rank 1's scheduler is killed (``kill -9``): its cache is gone with it,
and the plugin's rank watch clears the rank on the instance stream (a new rank epoch whose
one batch is ``AllBlocksCleared``).  The view must then remove the hashes only rank 1 held
and keep those rank 0 holds too: Dynamo and the positional reader equal the truth (rank 0's
tree).  That is the one-rank clear a real server reaches: SGLang 0.5.23's ``/flush_cache``
(``FlushCacheReqInput``: a timeout, no rank) goes to every rank, and SGLang cannot restart one
rank.  tests/fanin/test_folded_view.py covers a one-rank restart with real rank publishers and
a real fan-in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from motor_positional import OneWorker, replay_three_frames

from sglang_kvpub import wire
from sglang_kvpub.tools.tail import SeqTracker

from .conftest import PluginRig, free_port_block, plugin_rig, sglang_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

PAGE = 16
DP = 2
MODEL = "tiny-llama"
WORKER = 7
SHARED = sglang_server.prompt_ids(300, 4 * PAGE)
PROMPTS = {
    "shared": [*SHARED, 5],
    "a": SHARED + sglang_server.prompt_ids(301, 3 * PAGE + 3),
    "b": SHARED + sglang_server.prompt_ids(302, 3 * PAGE + 3),
    "c": SHARED + sglang_server.prompt_ids(303, 2 * PAGE + 3),
}
HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None and importlib.util.find_spec("dynamo.indexer") is not None


class RawRecorder:
    """A plain SUB in a thread: every (seq, payload) as it came."""

    def __init__(self, endpoint: str) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, sglang_server.TOPIC.encode())
        self._sub.connect(endpoint)
        self._lock = threading.Lock()
        self._messages: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                _, seq, payload = wire.parse_live_frames(self._sub.recv_multipart())
                with self._lock:
                    self._messages.append((seq, bytes(payload)))

    def messages(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(self._messages)

    def heartbeats(self) -> int:
        return sum(1 for _, p in self.messages() if not wire.BatchDecoder().decode(p).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module", params=["rust", "python"])
def rig(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PluginRig, RawRecorder, RawRecorder, str]]:
    core = request.param
    log_dir = tmp_path_factory.mktemp(f"folded-{core}")
    port = free_port_block(2)
    folded = f"tcp://127.0.0.1:{port}"
    extra = {
        "folded_endpoint": folded,
        "folded_replay_endpoint": f"tcp://127.0.0.1:{port + 1}",
        "folded_event_encoding": "array",
        "rank_order": True,  # each rank's order on the instance stream, checked across the restart
    }
    with plugin_rig(
        model_dir,
        log_dir,
        instance="sglang-folded",
        model_name=MODEL,
        page=PAGE,
        dp_size=DP,
        tree_core=core,
        kv_events_extra=extra,
    ) as made:
        main = RawRecorder(made.server.spec.stream_endpoint)
        view = RawRecorder(folded)
        try:
            yield made, main, view, folded
        finally:
            main.close()
            view.close()


def _apply(worker: OneWorker, event: Any) -> None:
    if isinstance(event, wire.BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": [wire.to_u64(h) for h in event.block_hashes],
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
        }
        if event.parent_block_hash is not None:
            fields["parent"] = wire.to_u64(event.parent_block_hash)
        worker.apply("BlockStored", fields)
    elif isinstance(event, wire.BlockRemoved):
        worker.apply("BlockRemoved", {"block_hashes": [wire.to_u64(h) for h in event.block_hashes]})
    elif isinstance(event, wire.AllBlocksCleared):
        worker.apply("AllBlocksCleared", {})


def truth(messages: list[tuple[int, bytes]]) -> dict[str, int]:
    """The longest hit over the instance's ranks; a new instance epoch starts every rank empty."""
    ranks = {rank: OneWorker(PAGE) for rank in range(DP)}
    decoder = wire.BatchDecoder()
    epoch = None
    for seq, payload in messages:
        if wire.seq_epoch(seq) != epoch:
            epoch = wire.seq_epoch(seq)
            ranks = {rank: OneWorker(PAGE) for rank in range(DP)}
        batch = decoder.decode(payload)
        if batch.dp_rank is not None:
            for event in batch.events:
                _apply(ranks[batch.dp_rank], event)
    return {name: max(w.hit_blocks(ids) for w in ranks.values()) for name, ids in PROMPTS.items()}


def one_worker(messages: list[tuple[int, bytes]], positional: bool) -> OneWorker:
    """Every batch credited to one worker: Motor's positional rules, or our decoder."""
    worker = OneWorker(PAGE)
    decoder = wire.BatchDecoder()
    for _, payload in messages:
        if positional:
            worker.take(payload)
        else:
            worker.batches += 1
            for event in decoder.decode(payload).events:
                _apply(worker, event)
    return worker


def answers(worker: OneWorker) -> dict[str, int]:
    return {name: worker.hit_blocks(ids) for name, ids in PROMPTS.items()}


def settle(made: PluginRig, view: RawRecorder) -> None:
    """The ranks' flushes are through the fan-in (two instance heartbeats after the last
    request), and the folded view has sent two heartbeats since (it beats with the stream)."""
    beats = view.heartbeats()
    made.quiet()
    made.until(lambda: view.heartbeats() >= beats + 2, "two folded heartbeats", 120.0)


def test_folded_view_of_a_real_dp2_server(rig: tuple[PluginRig, RawRecorder, RawRecorder, str], tmp_path: Path) -> None:
    made, main, view, folded = rig
    info = made.server.server_info()["kv_events"]
    views = {p["view"]: p for p in info["publishers"]}
    assert views["instance"]["fanned_in"] is True and views["instance"]["dp_ranks"] == list(range(DP))
    assert views["folded"]["endpoint"] == folded and views["folded"]["dp_rank"] == 0
    assert views["folded"]["event_encoding"] == "array" and views["folded"]["replay_reply_frames"] == 3

    indexer = None
    if HAVE_DYNAMO:
        from conftest import free_tcp_port
        from interop_procs import DynamoIndexer

        indexer = DynamoIndexer(free_tcp_port(), PAGE, tmp_path / "indexer.log")
        indexer.wait_healthy()
        indexer.register(WORKER, folded, views["folded"]["replay_endpoint"])
    try:
        _run_phases(made, main, view, indexer)
        _kill_rank1(made, main, view, indexer)
        _restart_the_instance(made, main, view, indexer)
    finally:
        if indexer is not None:
            indexer.close()


def _dynamo_scores(indexer: Any, want: dict[str, int]) -> dict[str, Any]:
    expected = {p: ({str(WORKER): {"0": n * PAGE}} if n else {}) for p, n in want.items()}
    deadline = time.monotonic() + 60
    while True:
        got = {p: indexer.scores(ids) for p, ids in PROMPTS.items()}
        if got == expected or time.monotonic() > deadline:
            return {"got": got, "expected": expected}
        time.sleep(0.1)  # the indexer applies events asynchronously


def _run_phases(made: PluginRig, main: RawRecorder, view: RawRecorder, indexer: Any) -> None:
    if indexer is not None:  # PUB/SUB drops what precedes the subscription: a probe scores first
        for probe in range(20):
            ids = sglang_server.prompt_ids(900 + probe, 2 * PAGE + 1)
            made.server.generate(ids, dp_rank=0)
            settle(made, view)
            if indexer.scores(ids):
                break
        else:
            raise AssertionError(indexer.log()[-3000:])

    def fill() -> None:
        made.server.generate(PROMPTS["a"], dp_rank=0)
        made.server.generate(PROMPTS["b"], dp_rank=1)

    def evict_rank0_then_child_on_rank1() -> None:
        for n in range(10):  # 10 x 517 tokens > the rank's 4096
            made.server.generate(sglang_server.prompt_ids(400 + n, 32 * PAGE + 5), dp_rank=0)
        made.server.generate(PROMPTS["c"], dp_rank=1)

    phases = [
        ("both ranks hold the prefix", fill),
        ("rank 0 evicts it, rank 1 stores a child", evict_rank0_then_child_on_rank1),
        ("flush_cache clears every rank", made.server.flush_cache),
        ("both ranks fill again", fill),
    ]
    report = []
    for name, phase in phases:
        phase()
        settle(made, view)
        want = truth(main.messages())
        folded_reader = one_worker(view.messages(), positional=True)
        control = one_worker(main.messages(), positional=False)
        row: dict[str, Any] = {
            "phase": name,
            "truth": want,
            "folded_positional": answers(folded_reader),
            "instance_stream_one_worker": answers(control),
            "control_parent_not_found": control.parent_not_found,
            "folded_batches": folded_reader.batches,
            "folded_refused": folded_reader.refused,
        }
        if indexer is not None:
            row["dynamo_folded"] = _dynamo_scores(indexer, want)
        report.append(row)
        print(row)
        assert answers(folded_reader) == want, row
        assert folded_reader.refused == 0 and folded_reader.parent_not_found == 0, row
        if indexer is not None:
            assert row["dynamo_folded"]["got"] == row["dynamo_folded"]["expected"], (row, indexer.log()[-3000:])
    assert report[0]["truth"]["a"] > 4 and report[0]["truth"]["b"] > 4
    assert report[1]["truth"]["b"] > 0, "rank 1 kept its prefix"  # the truth the control misses
    assert report[1]["instance_stream_one_worker"] != report[1]["truth"], report[1]
    # a reader of rank 0 only: rank 1's prompt is invisible on the instance stream, whole on the view
    rank0 = OneWorker(PAGE)
    for _, payload in main.messages():
        batch = wire.BatchDecoder().decode(payload)
        if batch.dp_rank == 0:
            for event in batch.events:
                _apply(rank0, event)
    on_rank0 = [m for m in view.messages() if wire.BatchDecoder().decode(m[1]).dp_rank in (0, None)]
    rank0_after = one_worker(on_rank0, positional=True)
    print({"rank0_only_before": answers(rank0), "rank0_only_after": answers(rank0_after), "truth": want})
    assert answers(rank0)["b"] < want["b"] and answers(rank0_after) == want
    # Motor's replay of the view from seq 0: three-frame replies, a snapshot, the same answers
    replay = made.server.server_info()["kv_events"]["publishers"][1]["replay_endpoint"]
    context: zmq.Context[Any] = zmq.Context()
    try:
        replied = replay_three_frames(context, replay, 0)
    finally:
        context.term()
    replayed = one_worker(replied, positional=True)
    assert replayed.refused == 0 and answers(replayed) == want
    removed = _removed_metric(made)
    print({"removed_blocks_by_rank_and_reason": removed})
    assert removed.get(("0", wire.REASON_CAPACITY), 0) > 0, removed
    assert all(reason != wire.REASON_UNKNOWN for _, reason in removed), removed


def _removed_metric(made: PluginRig) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(made.adapter.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("motor_kv_adapter_removed_blocks_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["engine_dp_rank"].strip('"'), labels["reason"].strip('"'))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _epoch_of(messages: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The messages of the newest instance epoch."""
    newest = wire.seq_epoch(messages[-1][0])
    return [m for m in messages if wire.seq_epoch(m[0]) == newest]


def check_like_tail(messages: list[tuple[int, bytes]]) -> dict[str, Any]:
    """What ``tail --check`` reports for these live messages (its trackers, in its order)."""
    tracker = SeqTracker(sys.stderr)
    ranks = wire.RankOrderCheck()
    for seq, payload in messages:
        restarts = tracker.restarts
        tracker.observe(seq)
        if tracker.restarts != restarts:
            ranks.reset()
        ranks.observe(*wire.read_rank_order(payload))
    return {"instance_gaps": tracker.gaps, "instance_restarts": tracker.restarts, **ranks.as_dict()}


def _kill_rank1(made: PluginRig, main: RawRecorder, view: RawRecorder, indexer: Any) -> None:
    before = truth(main.messages())
    # rank 1 alone holds B's own blocks, both hold the shared prefix: the clear must take B's
    # own blocks away and keep the prefix (rank 0 holds it through A)
    assert before["b"] > before["shared"] > 0 and before["a"] > before["shared"], before
    os.kill(sglang_server.scheduler_pid(made.server.proc.pid, 1), signal.SIGKILL)
    made.until(lambda: truth(main.messages())["b"] == before["shared"], "rank 1 cleared on the instance stream", 300.0)
    settle(made, view)
    want = truth(main.messages())
    folded_reader = one_worker(view.messages(), positional=True)
    row: dict[str, Any] = {
        "phase": "rank 1 killed: the rank watch clears it",
        "truth_before": before,
        "truth": want,
        "folded_positional": answers(folded_reader),
        "folded_refused": folded_reader.refused,
    }
    if indexer is not None:
        row["dynamo_folded"] = _dynamo_scores(indexer, want)
    print(row)
    assert want["a"] == before["a"] and want["shared"] == before["shared"], row  # rank 0's tree is untouched
    assert answers(folded_reader) == want and folded_reader.refused == 0, row
    assert folded_reader.parent_not_found == 0, row
    if indexer is not None:
        assert row["dynamo_folded"]["got"] == row["dynamo_folded"]["expected"], (row, indexer.log()[-3000:])


def _restart_the_instance(made: PluginRig, main: RawRecorder, view: RawRecorder, indexer: Any) -> None:
    before = truth(main.messages())
    assert before["a"] > 0, before  # rank 0 holds A: the restart must take it away
    out_path, err_path = made.log_dir / "tail.out", made.log_dir / "tail.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        tail = subprocess.Popen(
            [sys.executable, "-m", "sglang_kvpub.cli", "tail", made.server.spec.stream_endpoint, "--check"],
            stdout=out,
            stderr=err,
        )
    try:  # tail prints every batch, heartbeats included: once it printed, it is subscribed
        made.until(lambda: out_path.stat().st_size > 0 or tail.poll() is not None, "tail subscribed", 60.0)
        assert tail.poll() is None, err_path.read_text()
        old_epoch = wire.seq_epoch(main.messages()[-1][0])
        made.server.stop()
        made.server.start(timeout_s=900.0)
        made.server.generate(PROMPTS["b"], dp_rank=1)
        settle(made, view)
    finally:
        tail.send_signal(signal.SIGINT)
        try:
            tail.wait(60)
        finally:
            if tail.poll() is None:
                tail.kill()
                tail.wait(10)
    new_epoch = wire.seq_epoch(main.messages()[-1][0])
    assert new_epoch > old_epoch  # a seq-checking reader sees a gap, not an old seq
    want = truth(main.messages())
    live = one_worker(_epoch_of(view.messages()), positional=True)
    context: zmq.Context[Any] = zmq.Context()
    try:
        replay = made.server.server_info()["kv_events"]["publishers"][1]["replay_endpoint"]
        replayed = one_worker(replay_three_frames(context, replay, 0), positional=True)
    finally:
        context.term()
    check_lines = [line for line in err_path.read_text().splitlines() if line.startswith("check: ")]
    row: dict[str, Any] = {
        "phase": "the whole instance restarted, rank 1 stores B again",
        "truth_before": before,
        "truth": want,
        "folded_positional_new_epoch": answers(live),
        "folded_replay_from_0": answers(replayed),
        "folded_batches_new_epoch": live.batches,
        "folded_refused": live.refused + replayed.refused,
        "tail_check": json.loads(check_lines[-1][len("check: ") :]) if check_lines else None,
    }
    if indexer is not None:
        row["dynamo_folded"] = _dynamo_scores(indexer, want)
    print(row)
    # A's own blocks were rank 0's before the restart: only the prefix it shares with B, stored again, is left
    assert want["shared"] > 0 and want["a"] == want["shared"] < before["a"] and want["b"] > want["shared"], row
    assert answers(live) == want and answers(replayed) == want and row["folded_refused"] == 0, row
    if indexer is not None:
        assert row["dynamo_folded"]["got"] == row["dynamo_folded"]["expected"], (row, indexer.log()[-3000:])
    check = row["tail_check"]
    assert check is not None, err_path.read_text()[-3000:]
    assert check["instance_gaps"] == 0 and check["instance_restarts"] == 1 and check["gaps"] == {}, row
    # the recorded stream read the same way: no gap; one rank batch taken out: that rank's gap
    recorded = main.messages()
    assert check_like_tail(recorded)["gaps"] == {} and check_like_tail(recorded)["instance_gaps"] == 0
    dropped, rank = _a_rank_batch_between_two(recorded)
    report = check_like_tail(recorded[:dropped] + recorded[dropped + 1 :])
    print({"one_rank_batch_dropped": report, "dp_rank": rank})
    assert report["gaps"] == {rank: 1} and report["instance_gaps"] == 1, report


def _a_rank_batch_between_two(messages: list[tuple[int, bytes]]) -> tuple[int, int]:
    """The index of the newest rank batch with a batch of its rank before and after it in
    the same instance epoch (a checker places a rank at its first batch after a restart, so
    only such a batch's loss shows as that rank's gap), and its rank."""
    groups: dict[tuple[int, int], list[int]] = {}  # (instance epoch, dp_rank) -> indices, in order
    for index, (seq, payload) in enumerate(messages):
        rank, order = wire.read_rank_order(payload)
        if rank is not None and order is not None:
            groups.setdefault((wire.seq_epoch(seq), rank), []).append(index)
    candidates = [(indices[-2], rank) for (_, rank), indices in groups.items() if len(indices) >= 3]
    assert candidates, "no rank sent three batches"
    return max(candidates)
