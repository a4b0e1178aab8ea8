"""Per-rank order on the instance stream: tagging a batch payload, checking a rank's order.

The fan-in appends a :class:`~sglang_kvpub.wire.contract.RankOrder` to every rank batch as
the fifth batch element (``[ts, events, dp_rank, nil, RankOrder]``); readers that do not
know it ignore trailing elements, as they ignore the rank-load message's fourth.
:class:`RankOrderCheck` is what a consumer runs to see a lost batch of one rank even when
the instance seq is contiguous (e.g. a relay or a replay that skipped one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from sglang_kvpub.wire.contract import RankOrder

__all__ = ["tag_payload", "read_rank_order", "RankGap", "RankOrderCheck"]

_ENCODER = msgspec.msgpack.Encoder()
_BATCH3 = 0x93  # msgpack fixarray of 3: [ts, events, dp_rank]
_BATCH5 = b"\x95"
_NIL = b"\xc0"


class _OrderTail(msgspec.Struct, array_like=True, gc=False):
    """A batch read only for its rank and order: every other element left undecoded."""

    ts: msgspec.Raw
    events: msgspec.Raw
    dp_rank: Union[int, None] = None
    reserved: msgspec.Raw = msgspec.Raw(b"\xc0")
    order: Union[RankOrder, None] = None


_TAIL = msgspec.msgpack.Decoder(_OrderTail)


def tag_payload(payload: bytes, order: RankOrder) -> bytes:
    """``payload`` (a ``[ts, events, dp_rank]`` batch) with ``order`` appended; any other
    shape is returned as it is (nothing to tag safely)."""
    if not payload or payload[0] != _BATCH3:
        return payload
    return b"".join((_BATCH5, memoryview(payload)[1:], _NIL, _ENCODER.encode(order)))


def read_rank_order(payload: Union[bytes, memoryview]) -> tuple[Union[int, None], Union[RankOrder, None]]:
    """``(dp_rank, order)`` of a payload; ``(None, None)`` when it is not a batch array."""
    try:
        tail = _TAIL.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    return tail.dp_rank, tail.order


@dataclasses.dataclass(frozen=True)
class RankGap:
    dp_rank: int
    epoch: int
    expected: int
    got: int

    @property
    def missing(self) -> int:
        return self.got - self.expected

    def describe(self) -> str:
        return (
            f"rank gap: dp_rank {self.dp_rank} epoch {self.epoch}: expected rank seq {self.expected}, "
            f"got {self.got} ({self.missing} batch(es) of that rank missed)"
        )


@dataclasses.dataclass
class _Rank:
    epoch: int
    last: int


class RankOrderCheck:
    """Follows every rank's (epoch, seq) and reports what breaks contiguity.

    A snapshot batch sets the rank's position; a new epoch must start at seq 0 (else the
    batches before were missed); within an epoch each batch is the last + 1.  A batch seen
    again (a replay overlapping live) is ignored.  Bounded: one entry per rank seen,
    ranks limited to ``max_ranks``."""

    def __init__(self, max_ranks: int = 4096) -> None:
        self.max_ranks = max_ranks
        self._ranks: dict[int, _Rank] = {}
        self.gaps: dict[int, int] = {}  # dp_rank -> batches missed
        self.restarts: dict[int, int] = {}
        self.untagged = 0  # rank batches without an order (an engine without the plugin, or a relay)

    def reset(self) -> None:
        """Forget every rank (the instance stream restarted: its ranks' orders start again)."""
        self._ranks.clear()

    def observe(self, dp_rank: Union[int, None], order: Union[RankOrder, None]) -> Union[RankGap, None]:
        if dp_rank is None:
            return None
        if order is None:
            self.untagged += 1
            return None
        state = self._ranks.get(dp_rank)
        if order.snapshot:
            if state is not None or len(self._ranks) < self.max_ranks:
                self._ranks[dp_rank] = _Rank(order.epoch, order.seq)
            return None
        if state is None:
            if len(self._ranks) < self.max_ranks:
                self._ranks[dp_rank] = _Rank(order.epoch, order.seq)
            return None
        if order.epoch != state.epoch:
            self.restarts[dp_rank] = self.restarts.get(dp_rank, 0) + 1
            expected = 0
            state.epoch = order.epoch
        elif order.seq <= state.last:
            return None  # seen already
        else:
            expected = state.last + 1
        state.last = order.seq
        if order.seq != expected:
            gap = RankGap(dp_rank, order.epoch, expected, order.seq)
            self.gaps[dp_rank] = self.gaps.get(dp_rank, 0) + max(gap.missing, 0)
            return gap
        return None

    def positions(self) -> dict[int, tuple[int, int]]:
        """dp_rank -> (epoch, last seq)."""
        return {rank: (state.epoch, state.last) for rank, state in sorted(self._ranks.items())}

    def as_dict(self) -> dict[str, Any]:
        return {
            "gaps": dict(sorted(self.gaps.items())),
            "restarts": dict(sorted(self.restarts.items())),
            "untagged": self.untagged,
        }
