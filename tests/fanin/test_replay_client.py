"""The one replay client (``sglang_kvpub.transport.replay``) against a real ROUTER on loopback;
and the shared helpers that replaced per-module copies (rate-limited log, ConfigError)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import zmq

from sglang_kvpub.core.errors import ConfigError
from sglang_kvpub.core.ratelimit import RateLimitedLog
from sglang_kvpub.transport.replay import ReplayClient
from sglang_kvpub.wire import (
    WireError,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)
from tests.conftest import free_tcp_endpoint

pytestmark = pytest.mark.integration


class Router:
    """Answers one request: ``bad`` malformed replies first, then ``count`` batches, then the end
    marker unless ``silent``; records what was asked."""

    def __init__(self, ctx: zmq.Context[Any], count: int, bad: int = 0, silent: bool = False) -> None:
        self.endpoint = free_tcp_endpoint()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoint)
        self.count, self.bad, self.silent = count, bad, silent
        self.requests: list[tuple[int, bool]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if not self.socket.poll(10_000):
            return
        identity, start, snapshot = parse_replay_request(self.socket.recv_multipart())
        self.requests.append((start, snapshot))
        for _ in range(self.bad):
            self.socket.send_multipart([identity, b"", b"only", b"two", b"frames", b"extra"])
        for seq in range(start, start + self.count):
            self.socket.send_multipart(replay_reply_frames(identity, b"kv", seq, b"payload-%d" % seq))
        if not self.silent:
            self.socket.send_multipart(replay_end_frames(identity))


def test_fetch_returns_every_reply_in_order_until_the_end_marker(ctx: zmq.Context[Any]) -> None:
    router = Router(ctx, count=5)
    with ReplayClient(ctx, router.endpoint) as client:
        got = list(client.fetch(40, snapshot=True, timeout_s=10.0))
    assert got == [(seq, b"payload-%d" % seq) for seq in range(40, 45)]
    assert router.requests == [(40, True)]


def test_malformed_replies_are_reported_and_skipped(ctx: zmq.Context[Any]) -> None:
    router = Router(ctx, count=2, bad=3)
    bad: list[WireError] = []
    with ReplayClient(ctx, router.endpoint) as client:
        got = list(client.fetch(7, timeout_s=10.0, on_bad=bad.append))
    assert [seq for seq, _ in got] == [7, 8]
    assert len(bad) == 3 and all(exc.reason == "bad replay reply" for exc in bad)


def test_a_silent_endpoint_times_out_and_close_drops_the_socket(ctx: zmq.Context[Any]) -> None:
    router = Router(ctx, count=1, silent=True)
    client = ReplayClient(ctx, router.endpoint)
    got = []
    with pytest.raises(TimeoutError, match=router.endpoint):
        for item in client.fetch(3, timeout_s=0.5):
            got.append(item)
    assert got == [(3, b"payload-3")]
    client.close()
    assert client._socket is None
    assert client.recv() is None  # a new socket, nothing asked: nothing arrives


def test_recv_without_a_reply_returns_none_and_raises_on_a_bad_one(ctx: zmq.Context[Any]) -> None:
    router = Router(ctx, count=0, bad=1)
    with ReplayClient(ctx, router.endpoint) as client:
        assert client.recv() is None
        client.request(0)
        with pytest.raises(WireError):
            client.recv(10_000)
        end = client.recv(10_000)
        assert end is not None and end.is_end


def test_rate_limited_log_counts_occurrences_without_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.ratelimit.count")
    rlog = RateLimitedLog(logger, interval_s=None)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for n in range(2000):
            rlog.warning("bad", "bad input %d", n)
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert len(lines) == 12  # the first ten, the 1000th and the 2000th
    assert lines[0] == "bad input 0 (occurrence 1)" and lines[-1] == "bad input 1999 (occurrence 2000)"
    assert rlog.counts == {"bad": 2000}


def test_rate_limited_log_with_an_interval_says_how_many_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.ratelimit.interval")
    rlog = RateLimitedLog(logger, interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(5):
            rlog.warning("a", "stream %s lost", "x")
        rlog.warning("b", "other key")
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert lines == ["stream x lost", "other key"]  # per key, the rest suppressed until the interval ends
    rlog._next["a"] = 0.0  # the interval is over
    with caplog.at_level(logging.WARNING, logger=logger.name):
        rlog.warning("a", "stream %s lost", "x")
    assert caplog.records[-1].getMessage() == "stream x lost (4 similar suppressed)"


def test_one_config_error_for_both_halves() -> None:
    from motor_adapter import scoring
    from sglang_kvpub import config

    assert scoring.ConfigError is ConfigError is config.ConfigError
    single = ConfigError("endpoint 'x': use tcp://")
    assert str(single) == "endpoint 'x': use tcp://" and single.problems == ["endpoint 'x': use tcp://"]
    several = ConfigError(["a is bad", "b is bad"], scoring.INVALID)
    assert str(several) == "invalid kv_affinity configuration: a is bad; b is bad"
    assert several.problems == ["a is bad", "b is bad"]
