"""KvAffinity: subscriptions per instance, queries and decisions.

Unit tests drive it with a recording subscriber factory and the real index; integration
tests run a real ZMQ publisher in a spawned process and the real StreamSubscriber.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from motor_adapter.affinity import KvAffinity, compat_endpoints
from motor_adapter.scoring import POLICY_AFFINITY, POLICY_LOAD_BALANCE, Candidate, KvAffinityConfig
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.wire import MEDIUM_GPU, BlockRemoved, BlockStored, EventBatch
from tests.conftest import free_port_block, free_tcp_endpoint

BS = 128
CFG = KvAffinityConfig(block_size=BS)


def prompt(blocks: int, start: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def stored(tokens: list[int], first_hash: int) -> BlockStored:
    blocks = len(tokens) // BS
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + blocks)),
        parent_block_hash=None,
        token_ids=tokens[: blocks * BS],
        block_size=BS,
        medium=MEDIUM_GPU,
    )


# --------------------------------------------------------------------------- unit: fakes


class RecordingSubscriber:
    """Stands in for StreamSubscriber: records its arguments and its lifecycle."""

    def __init__(self, instance_id: str, endpoint: str, index: PrefixIndex, **kwargs: Any) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.index = index
        self.kwargs = kwargs
        self.started = False
        self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def health(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "connected": self.started and not self.stopped}


@pytest.fixture
def made() -> list[RecordingSubscriber]:
    return []


@pytest.fixture
def affinity(made: list[RecordingSubscriber]) -> Iterator[KvAffinity]:
    def factory(*args: Any, **kwargs: Any) -> RecordingSubscriber:
        sub = RecordingSubscriber(*args, **kwargs)
        made.append(sub)
        return sub

    with KvAffinity(CFG, subscriber_factory=factory) as aff:
        yield aff


@pytest.mark.unit
def test_compat_endpoints_are_base_plus_rank() -> None:
    assert compat_endpoints("tcp://10.0.0.1:5557", 3) == [
        "tcp://10.0.0.1:5557",
        "tcp://10.0.0.1:5558",
        "tcp://10.0.0.1:5559",
    ]
    assert compat_endpoints("tcp://[::1]:7000", 2) == ["tcp://[::1]:7000", "tcp://[::1]:7001"]
    for bad, text in [("ipc:///tmp/x", "tcp://"), ("tcp://host", "numeric port"), ("tcp://h:65535", "65535")]:
        with pytest.raises(ValueError, match=text):
            compat_endpoints(bad, 2)
    with pytest.raises(ValueError, match=">= 1"):
        compat_endpoints("tcp://h:1", 0)


@pytest.mark.unit
def test_one_subscriber_per_endpoint(affinity: KvAffinity, made: list[RecordingSubscriber]) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:6667", topic=b"kv")
    assert len(made) == 1
    sub = made[0]
    assert (sub.instance_id, sub.endpoint, sub.index, sub.started) == (
        "p0",
        "tcp://127.0.0.1:5557",
        affinity.index,
        True,
    )
    assert sub.kwargs["replay_endpoint"] == "tcp://127.0.0.1:6667"
    assert sub.kwargs["dp_rank_override"] is None
    assert sub.kwargs["topic"] == b"kv"
    assert affinity.instances() == ["p0"]
    assert affinity.health() == {"p0": [{"endpoint": "tcp://127.0.0.1:5557", "connected": True}]}


@pytest.mark.unit
def test_compat_mode_subscribes_per_rank_with_override(affinity: KvAffinity, made: list[RecordingSubscriber]) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:6667", compat_dp_size=4)
    assert [s.endpoint for s in made] == [f"tcp://127.0.0.1:{5557 + r}" for r in range(4)]
    assert [s.kwargs["replay_endpoint"] for s in made] == [f"tcp://127.0.0.1:{6667 + r}" for r in range(4)]
    assert [s.kwargs["dp_rank_override"] for s in made] == [0, 1, 2, 3]
    assert len(affinity.health()["p0"]) == 4


@pytest.mark.unit
def test_re_adding_same_source_is_a_no_op_and_another_replaces(
    affinity: KvAffinity, made: list[RecordingSubscriber]
) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    affinity.index.apply_batch("p0", EventBatch(ts=0.0, events=[stored(prompt(2, 0), 1)], dp_rank=1))
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    assert len(made) == 1 and not made[0].stopped
    affinity.add_instance("p0", "tcp://127.0.0.1:5600")
    assert made[0].stopped and made[1].started
    assert affinity.query(prompt(2, 0)) == {"p0": {}}  # the old source's blocks are gone


@pytest.mark.unit
def test_remove_instance_stops_and_clears(affinity: KvAffinity, made: list[RecordingSubscriber]) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557", compat_dp_size=2)
    affinity.add_instance("p1", "tcp://127.0.0.1:5657")
    affinity.index.apply_batch("p0", EventBatch(ts=0.0, events=[stored(prompt(3, 0), 1)], dp_rank=1))
    assert affinity.query(prompt(3, 0))["p0"][1].npu_blocks == 3
    assert affinity.remove_instance("p0")
    assert all(s.stopped for s in made[:2]) and not made[2].stopped
    assert affinity.index.ranks("p0") == []
    assert affinity.instances() == ["p1"]
    assert not affinity.remove_instance("p0")


@pytest.mark.unit
def test_close_stops_everything(made: list[RecordingSubscriber]) -> None:
    def factory(*args: Any, **kwargs: Any) -> RecordingSubscriber:
        made.append(RecordingSubscriber(*args, **kwargs))
        return made[-1]

    aff = KvAffinity(CFG, subscriber_factory=factory)
    aff.add_instance("p0", "tcp://127.0.0.1:5557")
    aff.close()
    assert made[0].stopped and aff.instances() == []
    with pytest.raises(RuntimeError, match="closed"):
        aff.add_instance("p1", "tcp://127.0.0.1:5558")


@pytest.mark.unit
def test_a_failing_start_stops_the_started_ones() -> None:
    made: list[RecordingSubscriber] = []

    def factory(*args: Any, **kwargs: Any) -> RecordingSubscriber:
        if len(made) == 2:
            raise OSError("cannot connect")
        made.append(RecordingSubscriber(*args, **kwargs))
        return made[-1]

    with KvAffinity(CFG, subscriber_factory=factory) as aff:
        with pytest.raises(OSError):
            aff.add_instance("p0", "tcp://127.0.0.1:5557", compat_dp_size=4)
        assert [s.stopped for s in made] == [True, True]
        assert aff.instances() == []


@pytest.mark.unit
def test_select_folds_ranks_and_logs_motors_line(affinity: KvAffinity, caplog: pytest.LogCaptureFixture) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    affinity.add_instance("p1", "tcp://127.0.0.1:5657")
    tokens = prompt(20, 0) + list(range(7))
    affinity.index.apply_batch("p1", EventBatch(ts=0.0, events=[stored(tokens[: 20 * BS], 1)], dp_rank=7))
    affinity.index.apply_batch("p1", EventBatch(ts=0.0, events=[stored(tokens[: 5 * BS], 1)], dp_rank=3))
    with caplog.at_level(logging.INFO, logger="motor_adapter.decision"):
        decision = affinity.select([Candidate("p0", 0.0), Candidate("p1", 100.0)], tokens, req_id="r9")
    assert (decision.instance_id, decision.dp_rank, decision.policy, decision.matched) == (
        "p1",
        7,
        POLICY_AFFINITY,
        2560,
    )
    assert "scheduled role=prefill req_id=r9 instance=p1 policy=kv_cache_affinity matched=2560 hbm=2560" in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        ([], "no token ids"),
        ([1, -2] * 100, "invalid token ids"),
        ([1.5] * 200, "invalid token ids"),
        ([1 << 32] * 200, "invalid token ids"),
        ([None] * 200, "invalid token ids"),
        ("abc", "invalid token ids"),
    ],
)
def test_select_bad_tokens_fall_back(affinity: KvAffinity, tokens: Any, reason: str) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    decision = affinity.select([Candidate("p0", 5.0), Candidate("p1", 1.0)], tokens)
    assert (decision.policy, decision.instance_id, decision.reason) == (POLICY_LOAD_BALANCE, "p1", reason)


@pytest.mark.unit
def test_select_without_instances_and_short_prompts(affinity: KvAffinity) -> None:
    cands = [Candidate("p0", 5.0), Candidate("p1", 1.0)]
    cold = affinity.select(cands, prompt(2, 0))
    assert (cold.policy, cold.reason) == (POLICY_LOAD_BALANCE, "no index data")
    short = affinity.select(cands, list(range(50)))
    assert (short.policy, short.fast_path, short.instance_id) == (POLICY_AFFINITY, True, "p1")


@pytest.mark.unit
def test_followed_but_cold_instances_rank_by_load(affinity: KvAffinity) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    affinity.add_instance("p1", "tcp://127.0.0.1:5657")
    decision = affinity.select([Candidate("p0", 5.0), Candidate("p1", 1.0)], prompt(4, 0))
    assert (decision.policy, decision.instance_id, decision.matched) == (POLICY_AFFINITY, "p1", 0)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_concurrent_readers_see_whole_batches(affinity: KvAffinity) -> None:
    affinity.add_instance("p0", "tcp://127.0.0.1:5557")
    tokens = prompt(8, 0)
    store = EventBatch(ts=0.0, events=[stored(tokens, 1)], dp_rank=3)
    remove = EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=list(range(1, 9)), medium=MEDIUM_GPU)], dp_rank=3)
    seen: list[tuple[int | None, int | None]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set():
                d = affinity.select([Candidate("p0", 0.0)], tokens)
                seen.append((d.matched, d.dp_rank))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(300):
        affinity.index.apply_batch("p0", store if i % 2 == 0 else remove)
    done.set()
    for t in threads:
        t.join(10)
    assert not errors
    assert seen and set(seen) <= {(0, None), (8 * BS, 3)}  # a batch is seen whole or not at all


# --------------------------------------------------------------------------- integration: real ZMQ


def _real_stream() -> Any:
    try:
        return importlib.import_module("motor_adapter.stream")
    except ImportError:
        return None


needs_stream = pytest.mark.skipif(_real_stream() is None, reason="motor_adapter.stream is not there yet")

PROMPT_START = 10_000


def rank_prompt(rank: int) -> list[int]:
    """Rank r holds 3 + r blocks of its own prompt."""
    return prompt(3 + rank, PROMPT_START * (rank + 1))


def publish(endpoints: list[str], dp_ranks: list[int | None], stop: Any, deadline_s: float) -> None:
    """Child process: publishes every rank's store again and again until told to stop.

    One endpoint: the plugin's instance stream, batches tagged ``dp_ranks[rank]``; one
    endpoint per rank: SGLang without the plugin (``dp_ranks`` all None).

    PUB/SUB drops what is sent before the subscription arrives, so the batches are resent
    (same engine hashes: idempotent for the index) until the test has seen them.
    """
    import zmq

    from sglang_kvpub.wire import BatchEncoder, live_frames

    ctx = zmq.Context()
    socks = []
    try:
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            socks.append(sock)
        encoder = BatchEncoder("map")
        seqs = [0] * len(socks)
        end = time.monotonic() + deadline_s
        while not stop.is_set() and time.monotonic() < end:
            for rank in range(4):
                i = rank if len(socks) > 1 else 0  # one instance stream, or one socket per rank
                event = stored(rank_prompt(rank), 1000 * (rank + 1))
                batch = EventBatch(ts=time.time(), events=[event], dp_rank=dp_ranks[rank])
                seqs[i] += 1
                socks[i].send_multipart(live_frames(b"", seqs[i], encoder.encode(batch)))
            stop.wait(0.02)  # pacing of the resend loop, not synchronisation
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _run_publisher(endpoints: list[str], dp_ranks: list[int | None]) -> tuple[Any, Any]:
    mp = multiprocessing.get_context("spawn")
    stop = mp.Event()
    proc = mp.Process(target=publish, args=(endpoints, dp_ranks, stop, 60.0), daemon=True)
    proc.start()
    return proc, stop


def _stop_publisher(proc: Any, stop: Any) -> None:
    stop.set()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _all_ranks_seen(aff: KvAffinity, instance: str) -> bool:
    return all(rank in aff.query(rank_prompt(rank)).get(instance, {}) for rank in range(4))


@pytest.mark.integration
@pytest.mark.timeout(60)
@needs_stream
def test_instance_stream_of_four_ranks_picks_instance_and_rank() -> None:
    endpoint = free_tcp_endpoint()
    proc, stop = _run_publisher([endpoint], [0, 1, 2, 3])
    try:
        with KvAffinity(CFG) as aff:
            aff.add_instance("inst-a", endpoint)
            aff.add_instance("inst-b", free_tcp_endpoint())  # followed, never publishes
            assert _wait_for(lambda: _all_ranks_seen(aff, "inst-a"), 30), aff.health()
            cands = [Candidate("inst-b", 0.0), Candidate("inst-a", 0.0)]
            for rank in range(4):
                tokens = rank_prompt(rank) + list(range(50))
                decision = aff.select(cands, tokens)
                assert (decision.instance_id, decision.dp_rank, decision.policy) == ("inst-a", rank, POLICY_AFFINITY)
                assert decision.matched == decision.hbm == (3 + rank) * BS
            health = aff.health()
            assert len(health["inst-a"]) == 1 and health["inst-a"][0].connected
    finally:
        _stop_publisher(proc, stop)


@pytest.mark.integration
@pytest.mark.timeout(60)
@needs_stream
def test_compat_mode_reads_base_plus_rank_streams() -> None:
    base = free_port_block(4)
    endpoints = [f"tcp://127.0.0.1:{base + r}" for r in range(4)]
    proc, stop = _run_publisher(endpoints, [None] * 4)  # SGLang without the plugin: no dp_rank in batches
    try:
        with KvAffinity(CFG) as aff:
            aff.add_instance("inst-a", endpoints[0], compat_dp_size=4)
            assert _wait_for(lambda: _all_ranks_seen(aff, "inst-a"), 30), aff.health()
            decision = aff.select([Candidate("inst-a", 0.0)], rank_prompt(2))
            assert (decision.dp_rank, decision.matched) == (2, 5 * BS)
            assert len(aff.health()["inst-a"]) == 4
    finally:
        _stop_publisher(proc, stop)
