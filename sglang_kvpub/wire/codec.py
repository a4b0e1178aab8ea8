"""The codec beside the contract: every engine's batch shape in, one declared shape out.

One import path for the codec's public names; each concern lives in its own module:
:mod:`~sglang_kvpub.wire.decode` (every engine's shape in, bounded by
:class:`DecodeLimits`), :mod:`~sglang_kvpub.wire.encode` (one declared shape out, and the
scheduler's in-process batches adopted), :mod:`~sglang_kvpub.wire.positional` (the tagged
array shape), :mod:`~sglang_kvpub.wire.raw_tokens` (ids kept as msgpack bytes),
:mod:`~sglang_kvpub.wire.hashes` (the two hash forms), and here the rank-load message's
codec.  The shapes themselves are :mod:`sglang_kvpub.wire.contract`.
"""

from __future__ import annotations

import math

import msgspec

from sglang_kvpub.wire.contract import (
    LOAD_REPORT_PREFIX,
    MAX_LOAD_RANKS,
    MAX_PENDING_KEYS,
    LoadReport,
    RankLoads,
    WireError,
)
from sglang_kvpub.wire.decode import BatchDecoder, DecodeLimits, DecodeStats
from sglang_kvpub.wire.encode import BatchEncoder, adopt_batch, enrich_batch, split_stored
from sglang_kvpub.wire.hashes import hash_from_wire, to_i64, to_u64
from sglang_kvpub.wire.raw_tokens import MsgpackIds, RawStored

__all__ = [
    "DecodeLimits",
    "DecodeStats",
    "MsgpackIds",
    "RawStored",
    "BatchDecoder",
    "BatchEncoder",
    "to_u64",
    "to_i64",
    "hash_from_wire",
    "split_stored",
    "enrich_batch",
    "adopt_batch",
    "LoadReportCodec",
]


# --------------------------------------------------------------------------- rank loads


class LoadReportCodec:
    """Encodes and recognises the rank-load message (``wire.LoadReport``, docs/wire.md).

    :meth:`decode` returns None for every payload that is not one (a plain batch or
    heartbeat: the first byte tells, no decoding) and raises :class:`WireError` for a
    malformed one, which a consumer counts and skips like any bad payload."""

    def __init__(self, max_payload_bytes: int = 1 << 20) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LoadReport)

    def encode(self, ts: float, loads: RankLoads) -> bytes:
        return self._encoder.encode(LoadReport(ts, [], None, loads))

    def decode(self, payload: bytes | memoryview) -> LoadReport | None:
        if payload[:1] != LOAD_REPORT_PREFIX:
            return None
        if len(payload) > self.max_payload_bytes:
            raise WireError("payload too large", f"load report of {len(payload)} bytes")
        try:
            report = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("bad load report", str(exc)[:80]) from exc
        ranks = report.loads.ranks
        if report.events or len(ranks) > MAX_LOAD_RANKS or len(report.loads.dispatch) > 64:
            raise WireError("bad load report", f"{len(report.events)} events, {len(ranks)} ranks")
        for rank in ranks:
            bad = len(rank.pending) > MAX_PENDING_KEYS
            if bad or not 0 <= rank.dp_rank < MAX_LOAD_RANKS or not math.isfinite(rank.load_tokens):
                raise WireError("bad load report", f"rank {rank.dp_rank} load {rank.load_tokens}")
        return report
