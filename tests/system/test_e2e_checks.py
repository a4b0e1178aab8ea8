"""The shared end-to-end checks (tests/e2e_checks.py) pass on good streams and fail on bad ones.

The NPU/GPU tier asserts through these same functions; here they run on CPU, fed by
hand-built streams and by SGLang 0.5.23's real RadixCache (page 128, two ranks).
"""

from __future__ import annotations

from typing import Any

import e2e_checks as checks
import msgspec
import pytest
import sglang_real

from sglang_kvpub import wire

PAGE = 128


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None, medium: str = "GPU") -> wire.BlockStored:
    return wire.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=PAGE, medium=medium
    )


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(blocks * PAGE)]


def _good_stream() -> list[tuple[int, wire.EventBatch]]:
    p0, p1 = _prompt(1, 2), _prompt(2, 1)
    return [
        (10, wire.EventBatch(ts=1.0, events=[_stored([11, 12], p0)], dp_rank=0)),
        (11, wire.EventBatch(ts=1.1, events=[], dp_rank=None)),  # heartbeat
        (12, wire.EventBatch(ts=1.2, events=[_stored([21], p1)], dp_rank=1)),
        (13, wire.EventBatch(ts=2.0, events=[wire.BlockRemoved(block_hashes=[11, 12], medium="GPU")], dp_rank=0)),
        (14, wire.EventBatch(ts=2.1, events=[wire.BlockRemoved(block_hashes=[21], medium="GPU")], dp_rank=1)),
    ]


@pytest.mark.unit
def test_good_stream_passes_every_check() -> None:
    stream = _good_stream()
    assert checks.check_ranks_in_one_stream(stream, [0, 1]) == {0: 2, 1: 2}
    assert checks.check_seq_increasing(stream) == 5
    assert checks.check_stored_blocks(stream, block_size=PAGE, ranks=[0, 1]) == 3
    assert checks.check_prompt_on_rank(stream, [*_prompt(1, 2), 5, 6], rank=0, block_size=PAGE) == 2
    assert checks.check_released_after(stream, 12, [0, 1]) == {0: 2, 1: 1}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mutate", "check", "message"),
    [
        (lambda s: s[:2], lambda s: checks.check_ranks_in_one_stream(s, [0, 1]), "no batches from dp_rank [1]"),
        (
            lambda s: [(9, wire.EventBatch(ts=0.0, events=[_stored([1], _prompt(3, 1))], dp_rank=None)), *s],
            lambda s: checks.check_ranks_in_one_stream(s, [0, 1]),
            "carry no dp_rank",
        ),
        (lambda s: [s[1], s[0]], checks.check_seq_increasing, "seq went from 11 to 10"),
        (
            lambda s: [(1, wire.EventBatch(ts=0.0, events=[wire.BlockStored([1], None, [1, 2], 2, None, "GPU")]))],
            lambda s: checks.check_stored_blocks(s, block_size=PAGE),
            "block_size 2, expected 128",
        ),
        (
            lambda s: [(1, wire.EventBatch(ts=0.0, events=[_stored([1], _prompt(3, 1), medium="CPU_PINNED")]))],
            lambda s: checks.check_stored_blocks(s, block_size=PAGE),
            "no BlockStored with medium=GPU",
        ),
        (lambda s: s[:4], lambda s: checks.check_released_after(s, 12, [0, 1]), "dp_rank 1: no BlockRemoved"),
        (
            lambda s: [*s[:3], (13, wire.EventBatch(ts=2.0, events=[wire.AllBlocksCleared()], dp_rank=0)), *s[4:]],
            lambda s: checks.check_released_after(s, 12, [0, 1]),
            "dp_rank 0: no BlockRemoved",
        ),
        (
            lambda s: s,
            lambda s: checks.check_prompt_on_rank(s, _prompt(2, 1), rank=0, block_size=PAGE),
            "dp_rank 0 announced none",
        ),
    ],
)
def test_bad_streams_fail_with_a_reason(mutate: Any, check: Any, message: str) -> None:
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check(mutate(_good_stream()))


@pytest.mark.unit
def test_all_blocks_cleared_counts_when_allowed() -> None:
    stream = [*_good_stream()[:3], (13, wire.EventBatch(ts=2.0, events=[wire.AllBlocksCleared()], dp_rank=0))]
    stream.append((14, wire.EventBatch(ts=2.1, events=[wire.AllBlocksCleared()], dp_rank=1)))
    assert checks.check_released_after(stream, 12, [0, 1], require_block_removed=False) == {0: 0, 1: 0}


@pytest.mark.unit
def test_decision_checks() -> None:
    hot = {"policy": "kv_cache_affinity", "matched": 2560, "hbm": 2560, "dp_rank": 7}
    assert checks.check_affinity_decision(hot, 7)["hbm"] == 2560
    with pytest.raises(AssertionError, match="dp_rank=3"):
        checks.check_affinity_decision(hot, 3)
    with pytest.raises(AssertionError, match="hbm >= 1"):
        checks.check_affinity_decision({**hot, "hbm": 0}, 7)
    with pytest.raises(AssertionError, match="policy=kv_cache_affinity"):
        checks.check_affinity_decision({**hot, "policy": "load_balance"}, 7)
    cold = {"policy": "load_balance", "matched": None, "hbm": None, "dp_rank": None}
    assert checks.check_cold_decision(cold)["policy"] == "load_balance"
    with pytest.raises(AssertionError, match="load_balance"):
        checks.check_cold_decision(hot)

    class Obj:  # decision objects with attributes work too
        policy, matched, hbm, dp_rank = "kv_cache_affinity", 256, 128, 1

    assert checks.check_affinity_decision(Obj(), 1)["matched"] == 256


@pytest.mark.integration
@pytest.mark.timeout(180)
@sglang_real.requires_radix_cache
def test_checks_on_real_radix_cache_events() -> None:
    """Two real RadixCaches (one per rank, page 128) -> enriched batches -> the shared checks."""
    radix = sglang_real.load_radix_cache()
    caches = [radix.simulated(page_size=PAGE), radix.simulated(page_size=PAGE)]
    prompts = [[*_prompt(4, 3), 1, 2, 3], _prompt(5, 2)]
    stream: list[tuple[int, wire.EventBatch]] = []
    decoder = wire.BatchDecoder()
    kv = sglang_real.load_kv_events()
    encoder = msgspec.msgpack.Encoder()

    def collect(rank: int) -> None:
        payload = encoder.encode(kv.KVEventBatch(ts=float(len(stream)), events=caches[rank].take_events()))
        batch = wire.enrich_batch(decoder.decode(payload), dp_rank=rank, block_size=PAGE)
        stream.append((len(stream), batch))

    for rank in (0, 1):
        radix.insert(caches[rank], prompts[rank])
        collect(rank)
    checks.check_ranks_in_one_stream(stream, [0, 1])
    assert checks.check_stored_blocks(stream, block_size=PAGE, ranks=[0, 1]) == 5
    assert checks.check_prompt_on_rank(stream, prompts[0], 0, PAGE) == 3
    with pytest.raises(AssertionError):
        checks.check_prompt_on_rank(stream, prompts[0], 1, PAGE)

    flushed_at = stream[-1][0]
    for rank in (0, 1):
        radix.evict(caches[rank], 10 * PAGE)  # evicts everything unlocked
        collect(rank)
    assert checks.check_released_after(stream, flushed_at, [0, 1]) == {0: 3, 1: 2}
