"""Bad input: decoders, live/replay/channel frames, the subscriber, the fan-in PULL and the HTTP service.

Pure decoder fuzzing is ``unit``: whatever the bytes, only ``WireError`` escapes and memory
stays bounded by ``DecodeLimits``.  The socket and HTTP parts are ``integration``: real
PUB/PUSH peers and a real aiohttp server; a bad input is counted and the component keeps
serving.  Run the longer by-hand fuzzer with ``scripts/fuzz_decoder.py`` (atheris).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.service import ServiceConfig
from motor_adapter.stream import StreamOptions, StreamSubscriber
from sglang_kvpub import wire
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.publish.fanin import FanIn
from sglang_kvpub.transport.channel import channel_frames, parse_channel_frames, seqpacket_available
from sglang_kvpub.transport.packet_channel import PacketPusher, packet_path
from tests.adapter.test_service import Server, http
from tests.conftest import free_tcp_endpoint

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BS = 4

# ----------------------------------------------------------------------------- strategies

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)  # all msgpack can carry
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)
# ints outside 64 bits cannot be msgpack ints: they arrive as strings (decimal or 0x hex)
_hash = (
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.integers(min_value=-(1 << 80), max_value=1 << 80).map(str)
    | st.integers(min_value=0, max_value=1 << 80).map(hex)
    | _scalars
)
_event_names = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStoredWithMetadata", "Nope"])


@st.composite
def _events(draw: st.DrawFn) -> Any:
    tag = draw(_event_names)
    hashes = draw(st.lists(_hash, max_size=4) | _values)
    fields: dict[str, Any] = {
        "type": tag,
        "block_hashes": hashes,
        "parent_block_hash": draw(_hash),
        "token_ids": draw(st.lists(st.integers(-5, 1 << 33) | _scalars, max_size=12) | _values),
        "block_size": draw(st.integers(-2, 6) | _scalars),
        "medium": draw(st.sampled_from([None, "GPU", "CPU_PINNED"]) | _scalars),
        "lora_id": draw(st.none() | st.integers(-3, 3) | _scalars),
    }
    if draw(st.booleans()):  # positional (old SGLang) spelling
        return [tag, *list(fields.values())[1:]]
    return fields


_batches = (
    st.tuples(
        st.floats(allow_nan=True) | _scalars,
        st.lists(_events(), max_size=5) | _values,
        st.none() | st.integers(-3, 1 << 40) | _scalars,
    ).map(list)
    | _values
)


def _decode_only_wire_errors(decoder: wire.BatchDecoder, payload: bytes) -> wire.EventBatch | None:
    try:
        batch = decoder.decode(payload)
    except wire.WireError as exc:
        assert exc.reason  # a short, stable explanation
        return None
    assert math.isfinite(batch.ts)
    for event in batch.events:
        if isinstance(event, wire.BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert all(-(1 << 63) <= h < 1 << 64 for h in event.block_hashes)
        elif isinstance(event, wire.BlockRemoved):
            assert all(-(1 << 63) <= h < 1 << 64 for h in event.block_hashes)
    return batch


# ----------------------------------------------------------------------------- decoder (unit)


@pytest.mark.unit
@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_wire_error(payload: bytes) -> None:
    _decode_only_wire_errors(wire.BatchDecoder(), payload)


@pytest.mark.unit
@FUZZ
@given(_batches)
def test_structured_garbage_only_raises_wire_error(obj: Any) -> None:
    _decode_only_wire_errors(wire.BatchDecoder(), msgpack.packb(obj, use_bin_type=True))


@pytest.mark.unit
@FUZZ
@given(st.integers(0, 40), st.integers(0, 255), st.integers(0, 300))
def test_truncated_and_flipped_valid_payloads(rank: int, byte: int, cut: int) -> None:
    events: list[wire.Event] = [
        wire.BlockStored(
            block_hashes=[rank + 1, rank + 2], parent_block_hash=7, token_ids=list(range(2 * BS)), block_size=BS
        ),
        wire.BlockRemoved(block_hashes=[rank + 1], medium=wire.MEDIUM_CPU),
        wire.AllBlocksCleared(),
    ]
    for encoding in ("map", "array"):
        good = wire.BatchEncoder(encoding).encode(wire.EventBatch(ts=1.0, events=events, dp_rank=rank))
        assert _decode_only_wire_errors(wire.BatchDecoder(), good) is not None
        _decode_only_wire_errors(wire.BatchDecoder(), good[: cut % len(good)])
        flipped = bytearray(good)
        flipped[cut % len(good)] = byte
        _decode_only_wire_errors(wire.BatchDecoder(), bytes(flipped))


def _stored(**overrides: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
    }
    event.update({"block_size": BS, "lora_id": None, "medium": "GPU", **overrides})
    return event


@pytest.mark.unit
@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ([1.0, [_stored(block_hashes=[str(-(1 << 63) - 1)])], 0], "bad hash"),
        ([1.0, [_stored(block_hashes=[hex(1 << 64)])], 0], "bad hash"),
        ([1.0, [_stored(parent_block_hash=str(1 << 64))], 0], "bad hash"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [str(1 << 64)]}], 0], "bad hash"),
        ([1.0, [_stored(block_hashes=["twelve"])], 0], "bad hash"),
        ([1.0, [_stored(block_hashes=[True])], 0], "bad hash"),
        ([1.0, [_stored(token_ids=[1, 2, 3])], 0], "token_ids/block_size mismatch"),
        ([1.0, [_stored(block_size=0)], 0], "bad BlockStored"),
        ([1.0, [_stored(block_hashes=[])], 0], "bad BlockStored"),
        ([1.0, [_stored(token_ids="abcd")], 0], "bad token_ids"),
        ([1.0, [_stored(medium=5)], 0], "bad medium"),
        ([math.nan, [], 0], "bad batch"),
        ([math.inf, [], 0], "bad batch"),
        (["now", [], 0], "bad batch"),
        ([1.0, 5, 6], "bad batch"),
        ({"ts": 1.0}, "bad batch"),
        ([1.0, [7], 0], "bad event"),
        ([1.0, [], "rank"], "bad dp_rank"),
    ],
)
def test_each_contract_violation_has_its_reason(obj: Any, reason: str) -> None:
    decoder = wire.BatchDecoder()
    with pytest.raises(wire.WireError) as info:
        decoder.decode(msgpack.packb(obj))
    assert info.value.reason == reason
    assert decoder.stats.errors == 1


@pytest.mark.unit
def test_unknown_event_types_are_counted_and_skipped() -> None:
    decoder = wire.BatchDecoder()
    batch = decoder.decode(msgpack.packb([1.0, [{"type": "Teleported", "x": 1}, ["Nope", 1], _stored()], 3]))
    assert [type(e) for e in batch.events] == [wire.BlockStored] and batch.dp_rank == 3
    assert decoder.stats.unknown_events == 2


@pytest.mark.unit
def test_deep_nesting_and_huge_headers_are_rejected_within_bounded_memory() -> None:
    deep = b"\x91" * 10_000 + b"\xc0"  # [[[[...nil...]]]] 10k deep
    deep_map = b"\x81\xa1k" * 10_000 + b"\xc0"
    huge_array = b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\xdd\xff\xff\xff\xff"  # events: 2^32-1, no body
    huge_bin = b"\xc6\xff\xff\xff\xf0"  # a 4 GB bin header, 0 bytes follow
    huge_tokens = msgpack.packb([1.0, [_stored(token_ids=list(range(200_000)))], 0])
    limits = wire.DecodeLimits(max_payload_bytes=64 << 10, max_events=1000)
    decoder = wire.BatchDecoder(limits)
    tracemalloc.start()
    try:
        for payload in (deep, deep_map, huge_array, huge_bin, huge_tokens, b"\x00" * (65 << 10)):
            with pytest.raises(wire.WireError):
                decoder.decode(payload)
        many_events = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 1001, 0])
        with pytest.raises(wire.WireError, match="too many events"):
            decoder.decode(many_events)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # nothing sized by a header's claim
    assert decoder.stats.errors == 7


_frame = st.binary(max_size=24) | st.sampled_from([b"", wire.END_SEQ_BYTES, wire.encode_seq(5), wire.SNAPSHOT_MARKER])


@pytest.mark.unit
@FUZZ
@given(st.lists(_frame, max_size=6), st.none() | st.integers(0, 32))
def test_frame_parsers_only_raise_wire_error(frames: list[bytes], limit: int | None) -> None:
    for parse in (
        lambda f: wire.parse_live_frames(f, limit),
        wire.parse_replay_reply,
        wire.parse_replay_request,
        parse_channel_frames,
    ):
        try:
            parse(frames)
        except wire.WireError as exc:
            assert exc.reason


@pytest.mark.unit
def test_frame_parsers_accept_what_the_encoders_write() -> None:
    assert wire.parse_live_frames(wire.live_frames(b"t", 9, b"p")) == (b"t", 9, b"p")
    assert wire.parse_replay_request([b"id", *wire.replay_request_frames(3, snapshot=True)]) == (b"id", 3, True)
    assert wire.parse_replay_reply(wire.replay_reply_frames(b"id", b"t", 4, b"p")[1:]).seq == 4
    assert parse_channel_frames(channel_frames(2, 3, 4, b"p")) == (2, 3, 4, b"p")
    with pytest.raises(wire.WireError, match="payload too large"):
        wire.parse_live_frames([b"t", wire.encode_seq(1), b"x" * 33], 32)


# ----------------------------------------------------------------------------- sockets (integration)


def _deadline(
    condition: Callable[[], bool], what: str, timeout_s: float = 10.0, tick: Callable[[], None] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if tick is not None:
            tick()
        time.sleep(0.01)


GARBAGE: list[list[bytes]] = [
    [b"only one"],
    [b"", b"two"],
    [b"", b"\x00\x01", b"short seq"],
    [b"", wire.encode_seq(1), b"\xc1 not msgpack"],
    [b"", wire.encode_seq(2), msgpack.packb([math.nan, [], 0])],
    [b"", wire.encode_seq(3), b"\x91" * 10_000 + b"\xc0"],
    [b"", wire.encode_seq(4), msgpack.packb([1.0, [_stored(block_hashes=[hex(1 << 64)])], 0])],
    [b"", wire.encode_seq(5), b"x" * 2048],  # over the subscriber's payload limit
    [b"", wire.encode_seq(6), b"", b"four frames"],
]


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_subscriber_fed_garbage_by_a_real_pub_keeps_running(zctx: zmq.Context[Any]) -> None:
    endpoint = free_tcp_endpoint()
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index = PrefixIndex(BS)
    options = StreamOptions(expect_heartbeats=False, poll_s=0.02)
    sub = StreamSubscriber(
        "inst", endpoint, index, context=zctx, options=options, decode_limits=wire.DecodeLimits(max_payload_bytes=1024)
    )
    sub.start()
    encoder = wire.BatchEncoder()
    try:
        heartbeat = wire.live_frames(b"", 0, encoder.encode(wire.EventBatch(ts=1.0, events=[])))
        _deadline(lambda: sub.health().batches > 0, "the subscription", tick=lambda: pub.send_multipart(heartbeat))
        for frames in GARBAGE:
            pub.send_multipart(frames)
        good = wire.BlockStored(block_hashes=[77], token_ids=[1, 2, 3, 4], block_size=BS, medium=wire.MEDIUM_GPU)
        pub.send_multipart(wire.live_frames(b"", 7, encoder.encode(wire.EventBatch(ts=1.0, events=[good], dp_rank=1))))
        _deadline(lambda: index.resident("inst", 1, wire.MEDIUM_GPU) == {77}, "the good batch after the garbage")
        health = sub.health()
        assert health.decode_errors == len(GARBAGE)  # every bad frame or payload counted once
        assert sub.is_alive() and health.apply_errors == 0
    finally:
        sub.stop()
        pub.close(linger=0)


@pytest.mark.integration
@pytest.mark.timeout(30)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(_frame | st.binary(max_size=200), min_size=0, max_size=4), min_size=1, max_size=20))
def test_fanin_pull_fed_garbage_keeps_running(frames_list: list[list[bytes]]) -> None:
    _fanin_garbage_round(frames_list)


_FANIN: dict[str, Any] = {}


def _fanin_garbage_round(frames_list: list[list[bytes]]) -> None:
    """One fan-in for all examples (built lazily): garbage in, then one good batch must come out."""
    if "push" not in _FANIN:
        ctx: zmq.Context[Any] = zmq.Context()
        channel = free_tcp_endpoint()
        fanin = FanIn(
            PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2), 1, channel_endpoint=channel
        )
        fanin.start()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(channel)
        _FANIN.update(ctx=ctx, fanin=fanin, push=push, seq=0)
    fanin, push = _FANIN["fanin"], _FANIN["push"]
    before = fanin.stats()
    for frames in frames_list:
        if frames:
            push.send_multipart(frames)
    seq = _FANIN["seq"] = _FANIN["seq"] + 1
    good = wire.enrich_batch(wire.EventBatch(ts=1.0, events=[]), dp_rank=0, block_size=BS)
    push.send_multipart(channel_frames(0, 99, seq, wire.BatchEncoder().encode(good)))
    _deadline(lambda: fanin.stats()["ranks"].get(0, {}).get("last_rank_seq", -1) >= seq, "the good frame")
    after = fanin.stats()
    assert after["malformed"] >= before["malformed"]
    assert fanin._thread is not None and fanin._thread.is_alive()


_packet = st.tuples(st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x07"]), _frame | st.binary(max_size=300)).map(
    lambda flag_body: flag_body[0] + flag_body[1]
)


@pytest.mark.integration
@pytest.mark.timeout(30)
@pytest.mark.skipif(not seqpacket_available(), reason="no Unix SEQPACKET sockets on this platform")
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_packet | st.binary(max_size=200), min_size=1, max_size=20))
def test_fanin_packet_channel_fed_garbage_keeps_running(packets: list[bytes]) -> None:
    """A local peer writes random packets (valid flags or not, cut messages, empty ones)
    on the default channel; a rank's good batch must still come out, nothing may crash."""
    if "packet_fanin" not in _FANIN:
        directory = tempfile.mkdtemp(prefix="kvpub-fuzz-")
        channel = f"unixpkt://{directory}/ch.pkt"
        fanin = FanIn(
            PluginConfig(endpoint=free_tcp_endpoint(), bind=True, heartbeat_s=0.2), 1, channel_endpoint=channel
        )
        fanin.start()
        _FANIN.update(
            packet_fanin=fanin,
            packet_channel=channel,
            packet_pusher=PacketPusher(channel),
            packet_seq=0,
            packet_dir=directory,
        )
    fanin, channel, pusher = _FANIN["packet_fanin"], _FANIN["packet_channel"], _FANIN["packet_pusher"]
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.connect(packet_path(channel))
    for packet in packets:
        with contextlib.suppress(OSError):  # the fan-in may close on an empty packet (end of file)
            peer.send(packet)
    peer.close()
    seq = _FANIN["packet_seq"] = _FANIN["packet_seq"] + 1
    good = wire.enrich_batch(wire.EventBatch(ts=1.0, events=[]), dp_rank=0, block_size=BS)
    assert pusher.send(0, 99, seq, wire.BatchEncoder().encode(good))
    _deadline(lambda: fanin.stats()["ranks"].get(0, {}).get("last_rank_seq", -1) >= seq, "the good message")
    stats = fanin.stats()
    assert stats["loop_errors"] == 0 and fanin._thread is not None and fanin._thread.is_alive()


@pytest.fixture(scope="module", autouse=True)
def _close_shared_fanin() -> Iterator[None]:
    yield
    if "packet_fanin" in _FANIN:
        _FANIN["packet_pusher"].close_socket()
        _FANIN["packet_fanin"].stop()
        shutil.rmtree(_FANIN["packet_dir"], ignore_errors=True)
    if "push" in _FANIN:
        _FANIN["push"].close(linger=0)
        _FANIN["fanin"].stop()
        _FANIN["ctx"].destroy(linger=0)
    _FANIN.clear()


# ----------------------------------------------------------------------------- HTTP (integration)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(ServiceConfig(kv_affinity=KvAffinityConfig(block_size=128), max_body_bytes=64 << 10))
    yield srv
    srv.close()


def _bad_total(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("motor_kv_adapter_bad_requests_total{")
    )


_PATHS = ["/query", "/query_by_hash", "/register", "/unregister", "/select", "/explain"]
_bodies = (
    _values.map(lambda v: ("json", json.dumps(v, default=repr).encode()))
    | _values.map(lambda v: ("msgpack", msgpack.packb(v, use_bin_type=True)))
    | st.binary(max_size=300).map(lambda b: ("json", b))
    | st.binary(max_size=300).map(lambda b: ("msgpack", b))
    | st.fixed_dictionaries(
        {
            "model": st.sampled_from(["m", "", None, 5]),
            "block_size": st.sampled_from([128, 0, -1, 1 << 30, "x"]),
            "token_ids": st.lists(st.integers(-(1 << 40), 1 << 40), max_size=300) | _values,
            "block_hashes": st.lists(st.integers(-(1 << 70), 1 << 70), max_size=5) | _values,
            "instance_id": _scalars,
            "candidates": _values,
        }
    ).map(lambda d: ("json", json.dumps(d, default=repr).encode()))
)


@pytest.mark.integration
@pytest.mark.timeout(90)
@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(_PATHS), _bodies)
def test_http_never_500_and_every_refusal_is_counted(server: Server, path: str, body: tuple[str, bytes]) -> None:
    kind, raw = body
    content_type = "application/msgpack" if kind == "msgpack" else "application/json"
    before = _bad_total(http(server.url + "/metrics")[1])
    status, reply = http(server.url + path, raw=raw, headers={"Content-Type": content_type})
    assert status < 500, reply
    if status >= 400:
        assert isinstance(reply, dict) and reply["error"] and "detail" in reply
        assert _bad_total(http(server.url + "/metrics")[1]) == before + 1


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_http_oversized_unknown_and_huge_inputs_get_4xx_then_service_answers(server: Server) -> None:
    cases: list[tuple[str, bytes, str, int, str]] = [
        ("/query", b"[" + b"1," * 40_000 + b"1]", "application/json", 413, "body_too_large"),
        ("/register", b"{" * 70_000, "application/json", 413, "body_too_large"),
        (
            "/query",
            msgpack.packb({"model": "m", "token_ids": list(range(30_000))}),
            "application/msgpack",
            413,
            "body_too_large",
        ),
        ("/query", b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}", "application/json", 400, "invalid_json"),
        ("/query", b"\x91" * 10_000 + b"\xc0", "application/msgpack", 400, "bad_body"),
        ("/query", b"\x81\xa6prompt" + b"\x91" * 10_000 + b"\xc0", "application/msgpack", 400, "invalid_msgpack"),
        (
            "/query",
            json.dumps({"model": "unknown-model", "token_ids": [1] * 300}).encode(),
            "application/json",
            404,
            "NoIndexer",
        ),
        ("/unregister", json.dumps({"instance_id": "nobody"}).encode(), "application/json", 404, "InstanceNotFound"),
        ("/query", json.dumps({"model": "m", "token_ids": [1 << 33]}).encode(), "application/json", 400, "bad_field"),
        (
            "/query_by_hash",
            json.dumps({"model": "m", "block_hashes": [1 << 65]}).encode(),
            "application/json",
            400,
            "bad_field",
        ),
    ]
    for path, raw, content_type, status, reason in cases:
        got, reply = http(server.url + path, raw=raw, headers={"Content-Type": content_type})
        assert (got, reply["error"]) == (status, reason), (path, reply)
        assert reply["detail"]
    metrics = http(server.url + "/metrics")[1]
    assert 'motor_kv_adapter_bad_requests_total{path="/query",reason="body_too_large"}' in metrics
    assert 'reason="NoIndexer"' in metrics and 'reason="InstanceNotFound"' in metrics
    assert http(server.url + "/health") == (200, "OK")
