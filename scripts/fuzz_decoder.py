#!/usr/bin/env python3
"""Coverage-guided fuzzing of the wire decoders with atheris (by hand, not in CI).

    pip install -c constraints.txt atheris
    python scripts/fuzz_decoder.py -max_total_time=300 -rss_limit_mb=1024

Any exception other than ``WireError`` (or a crash, or RSS over the limit) is a finding:
atheris stops and writes the input to ``crash-*``.  Replay one with
``python scripts/fuzz_decoder.py crash-<hash>``.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from sglang_kvpub import wire
    from sglang_kvpub.transport.channel import parse_channel_frames

_DECODER = wire.BatchDecoder(wire.DecodeLimits(max_payload_bytes=1 << 20, max_events=10_000))


def _frames(data: bytes) -> list[bytes]:
    return data.split(b"\x00\xff", 5)


def test_one_input(data: bytes) -> None:
    for parse in (
        _DECODER.decode,
        lambda d: wire.parse_live_frames(_frames(d), 1 << 20),
        lambda d: wire.parse_replay_reply(_frames(d)),
        lambda d: wire.parse_replay_request(_frames(d)),
        lambda d: parse_channel_frames(_frames(d)),
    ):
        with contextlib.suppress(wire.WireError):
            parse(data)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
