"""The real SGLang 0.5.23 pieces run here, and our wire module reads what they emit exactly.

Real ``ZmqEventPublisher`` (via ``EventPublisherFactory.create``) -> pyzmq SUB ->
``wire.BatchDecoder``, compared with SGLang's own msgspec decoder; real ``RadixCache``
events (merged multi-block stores, evictions); replay through SGLang's real ROUTER; the
light (no torch) strategy in a child process; plugins and DP-controller modules import.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Union

import msgspec
import pytest
import sglang_real
import zmq
from conftest import free_port_block, free_tcp_endpoint

from sglang_kvpub import wire

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), sglang_real.requires_sglang_kv_events]

RECV_DEADLINE_S = 20.0


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def kv() -> Any:
    return sglang_real.load_kv_events()


@pytest.fixture(scope="module")
def radix() -> sglang_real.RadixApi:
    return sglang_real.load_radix_cache()


def _config(endpoint: str, replay: str | None = None, topic: str = "kv") -> str:
    body: dict[str, Any] = {"publisher": "zmq", "endpoint": endpoint, "bind": True, "topic": topic}
    if replay:
        body["replay_endpoint"] = replay
    return msgspec.json.encode(body).decode()


class Link:
    """A real SGLang publisher and a SUB that provably receives from it."""

    def __init__(self, kv: Any, ctx: zmq.Context, replay: bool = False) -> None:
        self.kv = kv
        self.endpoint = free_tcp_endpoint()
        self.replay_endpoint = free_tcp_endpoint() if replay else None
        self.pub = kv.EventPublisherFactory.create(_config(self.endpoint, self.replay_endpoint), attn_dp_rank=0)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(self.endpoint)
        self.first_seq = self._join()

    def _join(self) -> int:
        """Publishes heartbeats until one arrives (PUB/SUB drops messages before the join)."""
        deadline = time.monotonic() + RECV_DEADLINE_S
        while time.monotonic() < deadline:
            self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=[]))
            if self.sub.poll(100):
                _, seq, _ = wire.parse_live_frames(self.sub.recv_multipart())
                self._drain()
                return seq + 1
        raise AssertionError("SUB never joined the real publisher")

    def _drain(self) -> None:
        while self.sub.poll(200):
            self.sub.recv_multipart()

    def publish(self, events: list[Any]) -> None:
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))

    def recv(self, count: int) -> list[tuple[int, bytes]]:
        """``count`` non-heartbeat ``(seq, payload)`` messages."""
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + RECV_DEADLINE_S
        while len(out) < count:
            assert time.monotonic() < deadline, f"received {len(out)} of {count} batches"
            if not self.sub.poll(100):
                continue
            topic, seq, payload = wire.parse_live_frames(self.sub.recv_multipart())
            assert topic == b"kv"
            if seq >= self.first_seq:
                out.append((seq, payload))
        return out

    def close(self) -> None:
        self.pub.shutdown()
        self.sub.close(linger=0)


@pytest.fixture
def link(kv: Any, zctx: zmq.Context) -> Iterator[Link]:
    item = Link(kv, zctx, replay=True)
    yield item
    item.close()


# --------------------------------------------------------------------------- helpers


def _sglang_decoder(kv: Any) -> msgspec.msgpack.Decoder:
    """SGLang's own typed view of a payload, built from its real event classes."""
    event = Union[kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared]
    return msgspec.msgpack.Decoder(tuple[float, list[event], Union[int, None]])


_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def _canonical(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in _FIELDS:
        if hasattr(event, name):
            value = getattr(event, name)
            out[name] = value.value if hasattr(value, "value") else value
    return out


def _sample_events(kv: Any) -> list[Any]:
    return [
        kv.BlockStored(
            block_hashes=[-3488128144981237669, 5674439469042975057],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
        ),
        kv.BlockStored(
            block_hashes=[(1 << 63) - 1],
            parent_block_hash=5674439469042975057,
            token_ids=[7, 7, 7, 7],
            block_size=4,
            lora_id=3,
            medium=kv.StorageMedium.CPU,
        ),
        kv.BlockRemoved(block_hashes=[-3488128144981237669], medium="GPU"),
        kv.AllBlocksCleared(),
    ]


def _signed(hex_digest: str) -> int:
    return wire.to_i64(int(hex_digest[:16], 16))


# --------------------------------------------------------------------------- tests


def test_real_publisher_frames_decode_exactly_like_sglang(kv: Any, link: Link) -> None:
    sent = _sample_events(kv)
    link.publish(sent)
    link.publish([kv.BlockRemoved(block_hashes=[1, 2, 3])])
    (seq0, payload0), (seq1, payload1) = link.recv(2)
    assert seq1 == seq0 + 1

    ours = wire.BatchDecoder()
    theirs = _sglang_decoder(kv)
    for payload in (payload0, payload1):
        batch = ours.decode(payload)
        ts, their_events, rank = theirs.decode(payload)
        assert batch.ts == ts and batch.dp_rank == rank == 0
        assert [_canonical(e) for e in batch.events] == [_canonical(e) for e in their_events]
    assert [_canonical(e) for e in ours.decode(payload0).events] == [_canonical(e) for e in sent]
    assert ours.stats.slow_path == 0 and ours.stats.errors == 0


@sglang_real.requires_radix_cache
def test_real_radix_cache_events_split_per_block(kv: Any, radix: sglang_real.RadixApi, link: Link) -> None:
    cache = radix.simulated(page_size=4)
    assert radix.insert(cache, range(1, 13)) == 0
    branch = [1, 2, 3, 4, 9, 9, 9, 9, 10, 10, 10, 10]
    assert radix.insert(cache, branch) == 4
    assert radix.match(cache, branch) == 12
    assert radix.evict(cache, 8) == 8
    events = cache.take_events()
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]

    link.publish(events)
    [(_, payload)] = link.recv(1)
    batch = wire.BatchDecoder().decode(payload)
    _, first, second, removed = batch.events
    assert isinstance(first, wire.BlockStored) and isinstance(second, wire.BlockStored)
    assert isinstance(removed, wire.BlockRemoved)

    # One merged store of 3 pages, split back into per-block token ids.
    assert [tokens for _, tokens in wire.split_stored(first)] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert first.parent_block_hash is None and first.block_size == 4 and first.medium == wire.MEDIUM_GPU
    assert [tokens for _, tokens in wire.split_stored(second)] == [[9, 9, 9, 9], [10, 10, 10, 10]]
    assert second.parent_block_hash == first.block_hashes[0]
    # LRU evicts the older leaf: pages 2-3 of the first prompt.
    assert removed.block_hashes == first.block_hashes[1:] and removed.medium == wire.MEDIUM_GPU

    # Hash values: SHA-256 page chain, first 8 bytes signed (independent of the extension).
    expected = [_signed(h) for h in sglang_real.hashlib_page_hashes(range(1, 13), None, 4)]
    assert first.block_hashes == expected


@sglang_real.requires_radix_cache
def test_hashlib_stand_in_equals_sglang_hash(radix: sglang_real.RadixApi) -> None:
    if radix.hash_impl != "native":
        pytest.skip("SGLang's native hash extension is not built here (no g++/ninja/OpenSSL headers)")
    utils = sglang_real.load_module("sglang.srt.mem_cache.utils", sglang_real.RADIX_DEPS)
    tokens = [0, 1, 2**32 - 1, 17, 99_999, 5, 6, 7, 8]
    prior = "ab" * 32
    assert utils.get_hash_str(tokens, prior, page_size=4) == sglang_real.hashlib_page_hashes(
        tokens, bytes.fromhex(prior), 4
    )
    assert utils.get_hash_str(tokens[:4]) == sglang_real.hashlib_page_hashes(tokens[:4], None, None)


def test_replay_through_sglang_router(kv: Any, link: Link, zctx: zmq.Context) -> None:
    for n in range(5):
        link.publish([kv.BlockRemoved(block_hashes=[n])])
    live = link.recv(5)
    start = live[2][0]

    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    assert link.replay_endpoint is not None
    dealer.connect(link.replay_endpoint)
    dealer.send_multipart(wire.replay_request_frames(start))
    replies: list[wire.ReplayReply] = []
    deadline = time.monotonic() + RECV_DEADLINE_S
    while not (replies and replies[-1].is_end):
        assert time.monotonic() < deadline, "replay never ended"
        if dealer.poll(100):
            replies.append(wire.parse_replay_reply(dealer.recv_multipart()))
    dealer.close(linger=0)

    body = replies[:-1]
    assert [r.seq for r in body] == [seq for seq, _ in live[2:]]
    assert [r.payload for r in body] == [payload for _, payload in live[2:]]
    assert all(r.topic == b"kv" for r in body)
    decoded = [wire.BatchDecoder().decode(r.payload).events[0] for r in body]
    assert [e.block_hashes for e in decoded if isinstance(e, wire.BlockRemoved)] == [[2], [3], [4]]


def test_light_mode_child_publishes_without_torch(zctx: zmq.Context) -> None:
    """The two-stub trick in a fresh process: real publisher, no torch, replay served."""
    # SGLang offsets both ports by the rank: rank 3 binds base+3.
    pub_base, replay_base = free_port_block(4), free_port_block(4)
    endpoint, replay = f"tcp://127.0.0.1:{pub_base}", f"tcp://127.0.0.1:{replay_base}"
    body = f"""
kv = sglang_real.load_kv_events()
pub = kv.EventPublisherFactory.create({_config(endpoint, replay)!r}, attn_dp_rank=3)
for n in range(3):
    pub.publish(kv.KVEventBatch(ts=1.0 + n, events=[kv.BlockRemoved(block_hashes=[n], medium="GPU")]))
print("torch" in sys.modules, type(pub).__name__, flush=True)
sys.stdin.readline()
pub.shutdown()
"""
    child = subprocess.Popen(
        [sys.executable, "-c", sglang_real.sglang_bootstrap_code("light") + "import sys\n" + body],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().split() == ["False", "ZmqEventPublisher"]
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_base + 3}")
        deadline = time.monotonic() + RECV_DEADLINE_S
        replies: list[wire.ReplayReply] = []
        # The publisher thread may not have queued all three yet: ask again until it has.
        while len(replies) != 4:
            assert time.monotonic() < deadline, "child never replayed its 3 batches"
            replies = []
            dealer.send_multipart(wire.replay_request_frames(0))
            while not (replies and replies[-1].is_end) and dealer.poll(2000):
                replies.append(wire.parse_replay_reply(dealer.recv_multipart()))
        dealer.close(linger=0)
        batches = [wire.BatchDecoder().decode(r.payload) for r in replies[:-1]]
        assert [b.dp_rank for b in batches] == [3, 3, 3]
        assert [b.ts for b in batches] == [1.0, 2.0, 3.0]
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_light_mode_refuses_full_loads_in_same_process() -> None:
    code = sglang_real.sglang_bootstrap_code("light") + (
        "sglang_real.load_kv_events()\n"
        "try:\n    sglang_real.load_radix_cache()\nexcept sglang_real.SglangUnavailable as exc:\n"
        "    print('refused', 'fresh process' in str(exc))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["refused", "True"]


@sglang_real.requires_sglang_managers
def test_plugin_and_manager_modules_import() -> None:
    plugins = sglang_real.load_plugins_module()
    assert callable(plugins.load_plugins) and hasattr(plugins.HookRegistry, "register")
    dpc = sys.modules[sglang_real.DP_CONTROLLER]
    assert hasattr(dpc.DataParallelController, "maybe_external_dp_rank_routing")
    pub = sys.modules[sglang_real.KV_EVENTS_PUBLISHER]
    assert hasattr(pub.SchedulerKvEventsPublisher, "publish_kv_events")


@sglang_real.requires_sglang_full
def test_torchvision_stub_answers_deep_imports() -> None:
    code = (
        sglang_real.sglang_bootstrap_code("full")
        + "from torchvision.transforms.v2 import functional as F\nimport importlib.util\n"
        + "print(importlib.util.find_spec('torchvision') is not None, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]
