"""The router half against an unmodified SGLang 0.5.23: real RadixCaches, real per-rank publishers.

Four DP ranks of one instance, each with SGLang's real ``RadixCache`` (page 128) and SGLang's
real ``ZmqEventPublisher`` on ``base + rank`` (what SGLang does without the plugin).  The
adapter follows them in compatibility mode (one subscription per rank port, history from
SGLang's real replay ROUTERs) and must decide exactly as the report expects: the repeat of
a 5,000-token prompt held by rank 2 -> kv_cache_affinity, 39 blocks, dp_rank 2; after the
rank evicts it, no stale hit is scored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sglang_real
from conftest import free_port_block, wait_for

from motor_adapter.affinity import KvAffinity
from motor_adapter.scoring import Candidate, KvAffinityConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    sglang_real.requires_radix_cache,
    sglang_real.requires_sglang_kv_events,
]

PAGE = 128
RANKS = 4
HOLDER = 2


def _prompt(seed: int, tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 120_000 + 1 for i in range(tokens)]


class Rank:
    """One SGLang DP rank: its real tree cache and its real per-rank publisher."""

    def __init__(self, radix: Any, kv: Any, rank: int, config: str) -> None:
        self.radix = radix
        self.kv = kv
        self.cache = radix.simulated(page_size=PAGE)
        self.publisher = kv.EventPublisherFactory.create(config, attn_dp_rank=rank)
        assert type(self.publisher).__name__ == "ZmqEventPublisher"  # SGLang's own, not the plugin's

    def flush(self) -> None:
        """What SGLang's scheduler does after a prefill step: take the events, publish them."""
        events = self.cache.take_events()
        if events:
            self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=events))


@pytest.fixture
def instance() -> Iterator[tuple[list[Rank], str, str]]:
    radix = sglang_real.load_radix_cache()
    kv = sglang_real.load_kv_events()
    base = free_port_block(2 * RANKS)
    config = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://*:{base}",
            "replay_endpoint": f"tcp://*:{base + RANKS}",  # replay ports above every rank's stream port
            "topic": "kv",
        }
    )
    ranks = [Rank(radix, kv, rank, config) for rank in range(RANKS)]
    try:
        yield ranks, f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + RANKS}"
    finally:
        for rank in ranks:
            rank.publisher.shutdown()


def test_compat_mode_scores_the_rank_that_holds_the_prefix(instance: tuple[list[Rank], str, str]) -> None:
    ranks, endpoint, replay = instance
    prompt = _prompt(1, 5000)
    for index, rank in enumerate(ranks):  # every rank serves something; only HOLDER holds the long prompt
        rank.radix.insert(rank.cache, prompt if index == HOLDER else _prompt(10 + index, 3 * PAGE))
        rank.flush()

    with KvAffinity(KvAffinityConfig(block_size=PAGE)) as affinity:
        # Published before the router started: it must come back through SGLang's replay ROUTERs.
        affinity.add_instance("vllm-prefill-0", endpoint, replay_endpoint=replay, compat_dp_size=RANKS, topic=b"kv")
        affinity.add_instance("vllm-prefill-1", "tcp://127.0.0.1:1", compat_dp_size=1)  # an idle peer
        wait_for(lambda: affinity.query(prompt)["vllm-prefill-0"].get(HOLDER) is not None, "the holder's blocks")

        hits = affinity.query(prompt)["vllm-prefill-0"]
        assert set(hits) == {HOLDER}, "a prefix held by one rank is credited to that rank only"
        assert (hits[HOLDER].npu_blocks, hits[HOLDER].cpu_blocks) == (5000 // PAGE, 0)
        decision = affinity.select([Candidate("vllm-prefill-1", 0.0), Candidate("vllm-prefill-0", 500.0)], prompt)
        assert decision.policy == "kv_cache_affinity" and decision.instance_id == "vllm-prefill-0"
        assert (decision.matched, decision.hbm, decision.dp_rank) == (4992, 4992, HOLDER)
        assert f"matched=4992 hbm=4992 cpu=0 disk=0 dp_rank={HOLDER}" in decision.log_line()

        # HBM released on the holder: SGLang's own BlockRemoved(GPU) reaches the index.
        ranks[HOLDER].radix.evict(ranks[HOLDER].cache, 10_000)
        ranks[HOLDER].flush()
        wait_for(lambda: not affinity.query(prompt)["vllm-prefill-0"], "the eviction")
        after = affinity.select([Candidate("vllm-prefill-1", 0.0), Candidate("vllm-prefill-0", 500.0)], prompt)
        # Motor semantics: a successful all-zero answer ranks by load (no fallback, no pinned rank).
        assert (after.instance_id, after.matched, after.hbm, after.dp_rank) == ("vllm-prefill-1", 0, 0, None)
