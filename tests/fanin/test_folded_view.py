"""The folded view: the instance as one cache for routers that read one endpoint.

Real parts: two :class:`RankPublisher` s feed a real :class:`FanIn` over the default Unix
packet channel; consumers are plain ZMQ SUB / DEALER sockets on loopback.  Consumers:

- the truth: our decoder, batches kept per ``dp_rank``; an instance's answer for a prompt is
  the longest hit over its ranks;
- a strict positional reader written from Motor 3.1's kv-conductor rules
  (tests/motor_positional.py), registered once for the instance (``dp_rank`` 0), reading
  the folded view and - the negative control - the instance stream as it is without the
  view (``rank_order`` off: a 3-element batch it can parse);
- a reader of rank 0 only (a gateway that subscribed to the rank-0 publisher), before (the
  instance stream's rank-0 batches) and after (the folded view);
- NVIDIA Dynamo's indexer (``python -m dynamo.indexer``), registered once on the folded view.

Scenario: rank 0 and rank 1 share a system prefix; one rank evicts it while the other
still holds it, then a child of it is stored; a rank's cache is cleared; a rank restarts.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_tcp_port
from motor_positional import OneWorker, replay_three_frames

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.instance_fold import InstanceFold
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher

pytestmark = pytest.mark.integration

BS = 4
DP = 2
DEADLINE_S = 30.0
HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None and importlib.util.find_spec("dynamo.indexer") is not None


def prompt(seed: int, blocks: int, prefix: list[int] | None = None) -> list[int]:
    head = list(prefix or [])
    return head + [1000 * seed + i for i in range(blocks * BS - len(head))]


SHARED = prompt(1, 3)
A = prompt(2, 5, SHARED)
B = prompt(3, 5, SHARED)
C = prompt(4, 4, SHARED)
D = prompt(5, 3)
PROMPTS = {"shared": SHARED, "a": A, "b": B, "c": C, "d": D}


def store(tokens: list[int], first: int, last: int) -> wire.BlockStored:
    keys = sequence_keys(tokens, BS)  # content-derived engine ids: equal on every rank, as SGLang's
    return wire.BlockStored(
        block_hashes=keys[first:last],
        parent_block_hash=keys[first - 1] if first else None,
        token_ids=tokens[first * BS : last * BS],
        block_size=BS,
        medium=wire.MEDIUM_GPU,
    )


def remove(tokens: list[int], *blocks: int, reason: str | None = wire.REASON_CAPACITY) -> wire.BlockRemoved:
    keys = sequence_keys(tokens, BS)
    return wire.BlockRemoved([keys[b] for b in blocks], wire.MEDIUM_GPU, reason)


# --------------------------------------------------------------------------- the fold itself


def test_fold_stores_once_removes_at_last_holder_and_clears_only_a_ranks_own() -> None:
    fold = InstanceFold()
    first = fold.fold(0, [store(A, 0, 5)])
    assert [type(e) for e in first] == [wire.BlockStored] and len(first[0].block_hashes) == 5
    # rank 1 stores the shared prefix and its own tail in one event: only the tail is new,
    # stored under the last shared block
    second = fold.fold(1, [store(B, 0, 5)])
    keys_b = sequence_keys(B, BS)
    assert len(second) == 1
    assert second[0].block_hashes == keys_b[3:5] and second[0].parent_block_hash == keys_b[2]
    assert list(second[0].token_ids) == B[3 * BS :]
    # rank 0 evicts all of A: the shared blocks stay (rank 1 holds them), A's tail goes
    gone = fold.fold(0, [remove(A, 4, 3, 2, 1, 0)])
    assert [e.block_hashes for e in gone] == [sequence_keys(A, BS)[4:2:-1]]
    assert gone[0].reason == wire.REASON_CAPACITY
    assert fold.fold(0, [remove(A, 0)]) == [] and fold.unknown_removals == 1
    # the same hash on another medium is another block
    host = fold.fold(0, [msgspec.structs.replace(store(SHARED, 0, 1), medium=wire.MEDIUM_CPU)])
    assert len(host) == 1 and host[0].medium == wire.MEDIUM_CPU
    # rank 1's clear: everything only it held, newest first; the host block (rank 0's) stays
    cleared = fold.fold(1, [wire.AllBlocksCleared()])
    assert [(e.medium, e.reason) for e in cleared] == [(wire.MEDIUM_GPU, wire.REASON_CLEARED)]
    assert cleared[0].block_hashes == list(reversed(keys_b))
    assert fold.counts() == {wire.MEDIUM_CPU: 1}
    assert fold.holders(keys_b[0], wire.MEDIUM_CPU) == [0]


# --------------------------------------------------------------------------- a live instance


class Collector:
    """A plain SUB: every (seq, payload) in arrival order."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.messages: list[tuple[int, bytes]] = []

    def pump(self, until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not until():
            assert time.monotonic() < deadline, "stream condition not reached"
            if self.socket.poll(50):
                while True:
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    _, seq, payload = wire.parse_live_frames(frames)
                    self.messages.append((seq, payload))

    def last_seq(self) -> int:
        return self.messages[-1][0] if self.messages else -1


class Instance:
    def __init__(self, tmp_path: Path, encoding: str, rank_order: bool) -> None:
        self.config = PluginConfig(
            endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            folded_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            folded_replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            event_encoding=encoding,  # type: ignore[arg-type]
            heartbeat_s=0.2,
            load_report_s=0.05,
            rank_order=rank_order,
        )
        self.channel = f"unixpkt://{tmp_path}/kvpub-channel"
        self.fanin = FanIn(self.config, DP, channel_endpoint=self.channel)
        ticks = iter(range(1 << 30))  # rank loads on the instance stream: never on the folded view
        self.fanin.set_load_source(lambda: wire.RankLoads([wire.RankLoad(0, float(next(ticks)))], {}, 0.05))
        self.fanin.start()
        self.context: zmq.Context[Any] = zmq.Context()
        self.main = Collector(self.context, self.config.endpoint)
        assert self.config.folded_endpoint is not None
        self.folded = Collector(self.context, self.config.folded_endpoint)
        self.ranks = [RankPublisher(self.config, rank, BS, self.channel) for rank in range(DP)]
        self.sent = 0
        for collector in (self.main, self.folded):  # both subscriptions are up
            collector.pump(lambda c=collector: bool(c.messages))  # type: ignore[misc]

    def publish(self, rank: int, *events: wire.Event) -> None:
        self.ranks[rank].publish(wire.EventBatch(ts=time.time(), events=list(events)))

    def restart_rank(self, rank: int) -> None:
        """The rank's process is replaced: a new rank epoch, its cache empty."""
        self.ranks[rank].shutdown()
        self.ranks[rank] = RankPublisher(self.config, rank, BS, self.channel)

    def settle(self) -> None:
        """Every rank's batches so far are on both streams: each rank stores a fresh probe
        block; once the instance stream carries every probe, the folded view is caught up
        to the fan-in's folded seq."""
        self.probes += 1
        probes = {rank: [900_000 + 100 * self.probes + 10 * rank + i for i in range(BS)] for rank in range(DP)}
        for rank, tokens in probes.items():
            self.publish(rank, store(tokens, 0, 1))
        wanted = {(rank, sequence_keys(tokens, BS)[0]) for rank, tokens in probes.items()}
        decoder = wire.BatchDecoder()

        def seen() -> bool:
            for _, payload in self.main.messages[self._scanned :]:
                batch = decoder.decode(payload)
                for event in batch.events:
                    if isinstance(event, wire.BlockStored) and batch.dp_rank is not None:
                        wanted.discard((batch.dp_rank, event.block_hashes[0]))
            self._scanned = len(self.main.messages)
            return not wanted

        self.main.pump(seen)
        folded_seq = self.fanin.stats()["folded"]["seq"]
        self.folded.pump(lambda: self.folded.last_seq() >= folded_seq)

    probes = 0
    _scanned = 0

    def close(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        self.fanin.stop()
        self.main.socket.close(linger=0)
        self.folded.socket.close(linger=0)
        self.context.term()


# --------------------------------------------------------------------------- consumers


def _apply_contract(worker: OneWorker, event: Any) -> None:
    if isinstance(event, wire.BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": list(event.block_hashes),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
        }
        if event.parent_block_hash is not None:
            fields["parent"] = event.parent_block_hash
        worker.apply("BlockStored", fields)
    elif isinstance(event, wire.BlockRemoved):
        worker.apply("BlockRemoved", {"block_hashes": list(event.block_hashes)})
    elif isinstance(event, wire.AllBlocksCleared):
        worker.apply("AllBlocksCleared", {})


def per_rank(messages: list[tuple[int, bytes]]) -> dict[int, OneWorker]:
    """The truth: the instance stream read rank by rank (our decoder, dp_rank honoured)."""
    ranks = {rank: OneWorker(BS) for rank in range(DP)}
    decoder = wire.BatchDecoder()
    for _, payload in messages:
        batch = decoder.decode(payload)
        if batch.dp_rank is not None:
            for event in batch.events:
                _apply_contract(ranks[batch.dp_rank], event)
    return ranks


def one_worker(messages: list[tuple[int, bytes]], only_rank: int | None = None) -> OneWorker:
    """A once-per-endpoint reader (Motor's rules): every batch credited to one worker;
    ``only_rank``: a reader of that rank's batches only (a gateway on the rank-0 publisher)."""
    worker = OneWorker(BS)
    raw = msgspec.msgpack.Decoder()
    for _, payload in messages:
        if only_rank is not None:
            batch = raw.decode(payload)
            if isinstance(batch, list) and len(batch) >= 3 and batch[2] not in (only_rank, None):
                continue
        worker.take(payload)
    return worker


def contract_reader(messages: list[tuple[int, bytes]]) -> OneWorker:
    """Our decoder on the folded view (map or array), every batch credited to one worker."""
    worker = OneWorker(BS)
    decoder = wire.BatchDecoder()
    for _, payload in messages:
        for event in decoder.decode(payload).events:
            _apply_contract(worker, event)
    return worker


def answers(worker: OneWorker) -> dict[str, int]:
    return {name: worker.hit_blocks(tokens) for name, tokens in PROMPTS.items()}


def truth(messages: list[tuple[int, bytes]]) -> dict[str, int]:
    ranks = per_rank(messages)
    return {name: max(w.hit_blocks(tokens) for w in ranks.values()) for name, tokens in PROMPTS.items()}


def _shared(i: Instance) -> None:
    i.publish(0, store(A, 0, 3), store(A, 3, 5))
    i.publish(1, store(B, 0, 5))


def _evict_on_one_rank(i: Instance) -> None:
    i.publish(0, remove(A, 4, 3, 2, 1, 0))
    i.publish(1, store(C, 3, 4))


def _clear_one_rank(i: Instance) -> None:
    i.publish(0, store(A, 0, 5))
    i.publish(1, wire.AllBlocksCleared())
    i.publish(1, store(B, 0, 5))


def _restart_one_rank(i: Instance) -> None:
    i.restart_rank(0)
    i.publish(0, store(D, 0, 3))


PHASES: list[tuple[str, Callable[[Instance], None]]] = [
    ("both ranks hold the shared prefix", _shared),
    ("rank 0 evicts all of A, rank 1 stores a child of the prefix", _evict_on_one_rank),
    ("rank 1's cache is cleared and refilled", _clear_one_rank),
    ("rank 0 restarts", _restart_one_rank),
]


@pytest.fixture
def make_instance(tmp_path: Path) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(encoding: str, rank_order: bool) -> Instance:
        made.append(Instance(tmp_path, encoding, rank_order))
        return made[-1]

    yield make
    for inst in made:
        inst.close()


@pytest.mark.timeout(180)
def test_positional_reader_of_the_folded_view_agrees_with_the_truth_the_instance_stream_does_not(
    make_instance: Callable[..., Instance],
) -> None:
    inst = make_instance("array", False)  # the instance stream as it is without per-rank order
    report: list[dict[str, Any]] = []
    for name, phase in PHASES:
        phase(inst)
        inst.settle()
        want = truth(inst.main.messages)
        folded = one_worker(inst.folded.messages)
        control = one_worker(inst.main.messages)
        report.append(
            {
                "phase": name,
                "truth": want,
                "folded": answers(folded),
                "instance_stream": answers(control),
                "rank0_only_before": answers(one_worker(inst.main.messages, only_rank=0)),
                "rank0_only_after": answers(one_worker(inst.folded.messages, only_rank=0)),
                "control_parent_not_found": control.parent_not_found,
            }
        )
        assert answers(folded) == want, report[-1]
        assert folded.parent_not_found == 0 and folded.refused == 0
        assert answers(one_worker(inst.folded.messages, only_rank=0)) == want
    print(report)  # the figures of the closing note (pytest -s)
    # the negative control: once-per-endpoint reading of the instance stream is wrong ...
    wrong = [r["phase"] for r in report if r["instance_stream"] != r["truth"]]
    assert wrong == [name for name, _ in PHASES[1:]], report
    assert report[1]["instance_stream"]["b"] == 0 and report[1]["control_parent_not_found"] >= 1
    assert report[2]["instance_stream"]["a"] < report[2]["truth"]["a"]  # rank 1's clear wiped rank 0's A
    assert report[3]["instance_stream"]["b"] < report[3]["truth"]["b"]  # rank 0's restart wiped rank 1's B
    # ... and a reader of rank 0 only misses what rank 1 holds
    assert report[0]["rank0_only_before"]["b"] < report[0]["truth"]["b"]
    # every folded batch decodes under the positional rules; none is longer than 3 elements
    folded = one_worker(inst.folded.messages)
    assert folded.batches == len(inst.folded.messages) and folded.refused == 0
    # Motor's replay of the folded view from seq 0 (another epoch: a snapshot), 3-frame replies
    assert inst.config.folded_replay_endpoint is not None
    replies = replay_three_frames(inst.context, inst.config.folded_replay_endpoint, 0)
    replayed = one_worker(replies)
    assert replayed.refused == 0 and answers(replayed) == report[-1]["truth"]
    assert replies[0][0] <= inst.folded.last_seq()  # the snapshot's seq: the view's last at the request
    # a replay inside the buffer gives the live batches again
    tail = replay_three_frames(inst.context, inst.config.folded_replay_endpoint, inst.folded.messages[-5][0])
    assert [seq for seq, _ in tail[:5]] == [seq for seq, _ in inst.folded.messages[-5:]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_folded_view_in_both_encodings_carries_no_rank_extras(
    make_instance: Callable[..., Instance], encoding: str
) -> None:
    inst = make_instance(encoding, True)
    for _, phase in PHASES:
        phase(inst)
        inst.settle()
        assert answers(contract_reader(inst.folded.messages)) == truth(inst.main.messages)
    for _, payload in inst.folded.messages:
        head = msgspec.msgpack.decode(payload)
        assert len(head) == 3 and head[2] in (0, None)  # no rank loads, no rank order: [ts, events, 0|nil]
        for event in head[1]:
            assert isinstance(event, dict if encoding == "map" else list)
    positional = one_worker(inst.folded.messages)
    if encoding == "array":
        assert positional.refused == 0
    else:  # Motor reads positional arrays only: map events make each batch with events unreadable
        assert positional.refused == sum(1 for _, p in inst.folded.messages if msgspec.msgpack.decode(p)[1])
    # the instance stream with per-rank order: a strict 3-element reader refuses its rank batches
    assert one_worker(inst.main.messages).refused > 0


def _best_blocks(scores: dict[str, dict[str, int]]) -> int:
    """The longest hit (blocks) over every worker's ranks in a Dynamo answer."""
    return max((tokens // BS for ranks in scores.values() for tokens in ranks.values()), default=0)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAVE_DYNAMO, reason="NVIDIA Dynamo's indexer (ai-dynamo-runtime 1.6.1) is not installed")
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_dynamo_indexer_on_the_folded_view_as_one_worker_agrees_with_the_truth(
    make_instance: Callable[..., Instance], tmp_path: Path, encoding: str
) -> None:
    """Dynamo registered once on the folded view: one worker, rank 0, the truth's answers.
    Beside it, Dynamo registered once on the instance stream: it keys by each batch's
    dp_rank, so it is right per rank (the best of its ranks is the truth) - a consumer that
    knows dp_rank needs no folded view."""
    from interop_procs import DynamoIndexer

    inst = make_instance(encoding, False)
    worker, control = 7, 8
    specs = {"folded": f"{worker}={inst.config.folded_endpoint}", "instance": f"{control}={inst.config.endpoint}"}
    indexers = {name: DynamoIndexer(free_tcp_port(), BS, tmp_path / f"{name}.log", s) for name, s in specs.items()}
    try:
        for indexer in indexers.values():
            indexer.wait_healthy()
        probe = 0
        while True:  # PUB/SUB drops what precedes the subscription: wait until a probe scores
            tokens = [800_000 + probe * BS + i for i in range(BS)]
            inst.publish(0, store(tokens, 0, 1))
            inst.settle()
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not all(i.scores(tokens) for i in indexers.values()):
                time.sleep(0.02)  # polling another process's state
            if all(i.scores(tokens) for i in indexers.values()):
                break
            probe += 1
            assert probe < 40, [i.log()[-2000:] for i in indexers.values()]
        report = []
        for name, phase in PHASES:
            phase(inst)
            inst.settle()
            want = truth(inst.main.messages)
            expected = {p: ({str(worker): {"0": n * BS}} if n else {}) for p, n in want.items()}
            deadline = time.monotonic() + DEADLINE_S
            while True:
                got = {p: indexers["folded"].scores(tokens) for p, tokens in PROMPTS.items()}
                per_rank = {p: indexers["instance"].scores(tokens) for p, tokens in PROMPTS.items()}
                best = {p: _best_blocks(scores) for p, scores in per_rank.items()}
                if (got == expected and best == want) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # the indexers apply events asynchronously
            report.append({"phase": name, "truth": want, "dynamo_folded": got, "dynamo_instance_per_rank": per_rank})
            assert got == expected, (report, indexers["folded"].log()[-3000:])
            assert best == want, report
            assert all(set(s.get(str(control), {})) <= {"0", "1"} for s in per_rank.values()), report
        print(report)
    finally:
        for indexer in indexers.values():
            indexer.close()
