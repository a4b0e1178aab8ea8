"""Pending prefixes: what a rank is prefilling or has queued counts as a future hit there
(sglang_kvpub/core/pending.py, the dispatcher's use of it, the controller's abort hook)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_kvpub.core.dispatch import REASON_CACHE_HIT, REASON_NO_HIT, CacheAwareDispatcher
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.pending import PendingPrefixes
from sglang_kvpub.core.rank_cost import CostParams, with_pending
from sglang_kvpub.engine import dispatch_hook
from sglang_kvpub.wire import BlockStored, EventBatch

pytestmark = pytest.mark.unit

BLOCK = 16
RANKS = 4


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 150_000 for i in range(n)]


def _publish(d: CacheAwareDispatcher, rank: int, tokens: list[int], first_hash: int = 1) -> None:
    """What the rank publishes when the prompt's prefill ends: its full blocks, stored."""
    blocks = len(tokens) // BLOCK
    event = BlockStored(list(range(first_hash, first_hash + blocks)), None, tokens[: blocks * BLOCK], BLOCK)
    d.observe(EventBatch(time.time(), [event], rank))


# --------------------------------------------------------------------------- the structure


def test_depth_is_the_leading_keys_pending_on_each_rank() -> None:
    p = PendingPrefixes(RANKS)
    p.add("a", 1, [10, 11, 12])
    p.add("b", 2, [10, 20])
    assert p.depths([10, 11, 12, 13], range(RANKS)) == {1: 3, 2: 1}
    assert p.depths([99, 11, 12], range(RANKS)) == {}  # a first block nobody is prefilling: no hit
    assert p.empty([0, 3]) and not p.empty([1])


def test_an_entry_leaves_when_its_rank_publishes_its_last_block_aborts_or_expires() -> None:
    p = PendingPrefixes(RANKS, ttl_s=10.0)
    p.add("a", 1, [1, 2, 3], now=0.0)
    p.add("b", 1, [1, 2, 4], now=0.0)
    p.add("c", 2, [7], now=5.0)
    assert p.settle(1, lambda key: key == 3, now=1.0) == 1  # "a" stored
    assert p.depths([1, 2, 4], [1]) == {1: 3}  # "b" still pending: the shared keys stay
    assert p.drop("b") and not p.drop("b")
    assert p.depths([1, 2, 4], [1]) == {}
    assert p.settle(0, lambda key: False, now=16.0) == 1  # "c" past its ttl
    assert len(p) == 0 and p.keys == 0
    assert p.stats()["dropped"] == {"stored": 1, "aborted": 1, "expired": 1, "capped": 0, "restarted": 0}


def test_memory_is_bounded_by_requests_and_keys_and_the_drops_counted() -> None:
    p = PendingPrefixes(RANKS, max_requests=3, max_keys=10)
    for i in range(5):
        p.add(i, i % RANKS, [i * 100 + k for k in range(3)])
    assert len(p) == 3 and p.keys == 9  # the oldest two went
    p.add("big", 0, list(range(1000, 1008)))  # 8 more keys: the older entries make room
    assert p.keys == 8 and len(p) == 1
    p.add("huge", 0, list(range(2000, 2011)))  # larger than the bound: refused, counted
    assert p.stats()["dropped"]["capped"] >= 5
    assert p.keys <= 10


def test_a_restarted_rank_drops_what_it_was_prefilling() -> None:
    p = PendingPrefixes(RANKS)
    p.add("a", 3, [1, 2])
    p.clear_rank(3)
    assert p.depths([1, 2], [3]) == {}


def test_a_pending_prefix_merges_into_the_hits_only_where_it_is_longer() -> None:
    params = CostParams(BLOCK)
    hits = {0: (4, 0, 0), 1: (1, 2, 0)}
    assert with_pending(hits, {0: 3, 1: 5, 2: 2}, params) == {0: (4, 0, 0), 1: (5, 0, 0), 2: (2, 0, 0)}
    assert hits == {0: (4, 0, 0), 1: (1, 2, 0)}  # not changed in place


# --------------------------------------------------------------------------- the dispatcher


def _dispatcher(**kw: Any) -> CacheAwareDispatcher:
    return CacheAwareDispatcher(RANKS, BLOCK, capacity_blocks=None, pending=True, **kw)


def _pending(d: CacheAwareDispatcher) -> PendingPrefixes:
    assert d.pending is not None
    return d.pending


def test_a_burst_of_one_prompt_waits_for_the_first_prefill_on_its_rank() -> None:
    """A GRPO group sent at once: nothing is published yet, yet every member goes where the
    first is being prefilled, while that rank's wait (its load) is below a recompute."""
    d = _dispatcher()
    prompt = _tokens(20 * BLOCK)
    loads = [0.0] * RANKS
    first = d.choose(prompt, loads, rid="m0")
    assert first.reason == REASON_NO_HIT and first.rank is not None
    loads[first.rank] += len(prompt)  # the engine counts it queued there
    rest = [d.choose(prompt, loads, rid=f"m{i}") for i in range(1, 8)]
    assert {r.rank for r in rest} == {first.rank}
    assert all(r.reason == REASON_CACHE_HIT and r.matched_tokens == len(prompt) for r in rest)
    assert len(_pending(d)) == 1  # the members compute nothing new: only the first is pending


def test_without_pending_prefixes_the_burst_spreads_and_recomputes() -> None:
    d = CacheAwareDispatcher(RANKS, BLOCK, capacity_blocks=None)
    prompt = _tokens(20 * BLOCK)
    loads = [0.0] * RANKS
    ranks = []
    for i in range(4):
        decision = d.choose(prompt, loads, rid=i)
        assert decision.rank is not None
        ranks.append(decision.rank)
        loads[decision.rank] += len(prompt)
    assert len(set(ranks)) == RANKS and d.pending is None


def test_a_longer_wait_than_the_recompute_goes_elsewhere() -> None:
    d = _dispatcher()
    prompt = _tokens(20 * BLOCK)
    first = d.choose(prompt, [0.0] * RANKS, rid="a")
    assert first.rank is not None
    loads = [0.0] * RANKS
    loads[first.rank] = 10 * len(prompt)  # a long queue in front of it
    assert d.choose(prompt, loads, rid="b").rank != first.rank


def test_the_published_prefix_replaces_the_pending_one_and_aborts_drop_it() -> None:
    d = _dispatcher()
    prompt, other = _tokens(8 * BLOCK), _tokens(8 * BLOCK, salt=3)
    a = d.choose(prompt, [0.0] * RANKS, rid="a")
    b = d.choose(other, [0.0] * RANKS, rid="b")
    assert a.rank is not None and b.rank is not None and len(_pending(d)) == 2
    _publish(d, a.rank, prompt)
    assert len(_pending(d)) == 1 and _pending(d).stats()["dropped"]["stored"] == 1
    again = d.choose(prompt, [0.0] * RANKS, rid="c")
    assert (again.rank, again.reason) == (a.rank, REASON_CACHE_HIT)  # now from the index
    assert d.request_ended("b") and len(_pending(d)) == 0
    loads = [0.0] * RANKS
    assert d.choose(other, loads, rid="d").reason == REASON_NO_HIT  # nothing promised any more


def test_pending_keys_are_the_index_keys_of_the_prompt() -> None:
    d = _dispatcher()
    prompt = _tokens(5 * BLOCK + 3)
    decision = d.choose(prompt, [0.0] * RANKS, rid="x")
    assert decision.rank is not None
    keys = sequence_keys(prompt, BLOCK)
    assert _pending(d).depths(keys, [decision.rank]) == {decision.rank: 5}


def test_the_controller_abort_hook_drops_the_pending_prefix_and_never_raises() -> None:
    d = _dispatcher()
    prompt = _tokens(8 * BLOCK)
    d.choose(prompt, [0.0] * RANKS, rid="r1")
    d.choose(_tokens(8 * BLOCK, salt=9), [0.0] * RANKS, rid="r2")
    sent: list[Any] = []
    controller = SimpleNamespace(kvpub_dispatcher=d)
    AbortReq = type("AbortReq", (), {})  # the hook knows SGLang's message by its class name
    abort = AbortReq()
    abort.rid, abort.abort_all = "r1", False
    dispatch_hook._control_hook(lambda self, obj: sent.append(obj), controller, abort)
    assert sent == [abort] and len(_pending(d)) == 1
    broken = AbortReq()  # no rid: contained, counted
    before = dispatch_hook.abort_failures
    dispatch_hook._control_hook(lambda self, obj: sent.append(obj), controller, broken)
    assert dispatch_hook.abort_failures == before + 1 and sent[-1] is broken
    everything = AbortReq()
    everything.abort_all = True
    dispatch_hook._control_hook(lambda self, obj: None, controller, everything)
    assert len(_pending(d)) == 0


def test_members_waiting_for_a_prefill_do_not_count_as_its_queue() -> None:
    """The engine counts every waiting member as work; the rank computes the prompt once.
    A member's wait is the prefill in front of it: the riders' part leaves the rank's load."""
    d = _dispatcher()
    prompt = _tokens(20 * BLOCK + 5)
    loads = [1000.0] * RANKS
    first = d.choose(prompt, loads, rid="m0")
    assert first.rank is not None and first.pending_tokens == 0
    loads = [1000.0 + len(prompt) if r == first.rank else 2000.0 for r in range(RANKS)]  # the others got busier
    for i in range(1, 8):
        member = d.choose(prompt, loads, rid=f"m{i}")
        assert (member.rank, member.pending_tokens) == (first.rank, 20 * BLOCK)
        assert member.load == pytest.approx(1000 + len(prompt) + 5 * (i - 1))  # the first, then 5 tokens each
        loads[first.rank] += len(prompt)  # the engine's figure: each member queued in full
    pend = _pending(d)
    assert pend.credit[first.rank] == 7 * 20 * BLOCK
    _publish(d, first.rank, prompt)  # the prefill ended: the members are cache hits now
    assert pend.credit[first.rank] == 0.0 and len(pend) == 0
