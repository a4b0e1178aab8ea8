"""The adapter and the dispatcher pick the same rank, on one replay.

One replay of agentic sessions (a shared system prompt, each session's history growing turn
by turn) over 2 instances x 4 ranks, driving the shipped halves only: the adapter's state
(``AdapterState``, what ``/query`` answers; each instance registered as Motor registers it) and
one ``CacheAwareDispatcher`` per instance.  Before each request every instance's rank loads go
out as the fan-in sends them (``wire.LoadReport``, encoded and decoded), so both halves see the
same loads and the same KV events.  For every instance in every answer, the rank the adapter
scored it by (``dp_detail.scored_rank``) must be the rank its dispatcher chooses; the
request then runs on the instance Motor picks and its blocks are published to both halves.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from conftest import offline_adapter

from motor_adapter.scoring import KvAffinityConfig
from motor_adapter.settings import ServiceConfig
from sglang_kvpub import wire
from sglang_kvpub.core.dispatch import CacheAwareDispatcher
from sglang_kvpub.core.hashing import sequence_keys

pytestmark = pytest.mark.unit

BS = 16
INSTANCES = 2
RANKS = 4
MODEL = "m"


def _stream(instance: int) -> str:
    return f"tcp://127.0.0.{instance + 1}:5557"


class Cluster:
    """The two halves of 2 instances, fed the same events and loads through the wire codec."""

    def __init__(self) -> None:
        cfg = KvAffinityConfig(block_size=BS)
        instances = [(f"vllm-prefill-{i}", _stream(i)) for i in range(INSTANCES)]
        self.state, self.affinity = offline_adapter(ServiceConfig(kv_affinity=cfg), instances, BS, MODEL)
        self.dispatchers = [CacheAwareDispatcher(RANKS, BS) for _ in range(INSTANCES)]
        self.loads = [[0.0] * RANKS for _ in range(INSTANCES)]
        self.held: list[list[set[int]]] = [[set() for _ in range(RANKS)] for _ in range(INSTANCES)]
        self.encoder, self.decoder, self.codec = wire.BatchEncoder(), wire.BatchDecoder(), wire.LoadReportCodec()

    def report_loads(self, now: float) -> None:
        for i, loads in enumerate(self.loads):
            figures = wire.RankLoads([wire.RankLoad(r, load) for r, load in enumerate(loads)], {}, 0.1)
            report = self.codec.decode(self.codec.encode(now, figures))
            assert report is not None
            self.affinity.loads.apply(_stream(i), report)

    def serve(self, instance: int, rank: int, tokens: list[int]) -> None:
        """The rank computes the prompt and publishes its new full blocks as SGLang would (one
        BlockStored; engine block hashes: the chained keys, parent: the block before)."""
        keys = sequence_keys(tokens, BS)
        held = self.held[instance][rank]
        start = next((b for b, key in enumerate(keys) if key not in held), len(keys))
        if start < len(keys):
            event = wire.BlockStored(
                block_hashes=keys[start:],
                parent_block_hash=keys[start - 1] if start else None,
                token_ids=tokens[start * BS : len(keys) * BS],
                block_size=BS,
                medium=wire.MEDIUM_GPU,
            )
            batch = self.decoder.decode(self.encoder.encode(wire.EventBatch(0.0, [event], rank)))
            self.affinity.index.apply_batch(_stream(instance), batch)
            self.dispatchers[instance].observe(batch, rank)
            held.update(keys[start:])
        self.loads[instance][rank] += len(tokens) - start * BS


def _replay(seed: int, sessions: int = 24) -> list[list[int]]:
    """Agentic sessions interleaved: a shared system prompt, histories growing turn by turn."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(4 * BS)]
    histories = [list(system) for _ in range(sessions)]
    prompts = []
    turns = [rng.randint(2, 6) for _ in range(sessions)]
    while any(turns):
        s = rng.choice([i for i, left in enumerate(turns) if left])
        turns[s] -= 1
        histories[s] += [rng.randrange(1, 50_000) for _ in range(rng.randint(5, 3 * BS))]
        prompts.append(list(histories[s]))
        histories[s] += [rng.randrange(1, 50_000) for _ in range(rng.randint(5, 2 * BS))]  # the answer
    return prompts


def test_adapter_and_dispatcher_pick_the_same_rank_on_one_replay() -> None:
    cluster = Cluster()
    agreed = compared = hits = 0
    used: Counter[tuple[int, int]] = Counter()
    for n, tokens in enumerate(_replay(seed=5)):
        for loads in cluster.loads:  # ranks drain between requests: the loads move both ways
            for r in range(RANKS):
                loads[r] = max(0.0, loads[r] - 40.0)
        cluster.report_loads(float(n))
        answer = cluster.state.query(MODEL, "default", BS, tokens)["default"]
        for i in range(INSTANCES):
            scored = answer[f"vllm-prefill-{i}"]["dp_detail"]["0"]["scored_rank"]
            chosen = cluster.dispatchers[i].choose(tokens, list(cluster.loads[i]))
            compared += 1
            agreed += int(chosen.rank == scored)
        picked = max(range(INSTANCES), key=lambda i: answer[f"vllm-prefill-{i}"]["GPU"])  # 3.0.0b2's rule
        decision = cluster.dispatchers[picked].choose(tokens, list(cluster.loads[picked]))
        assert decision.rank is not None
        hits += int(decision.matched_tokens > 0)
        used[(picked, decision.rank)] += 1
        cluster.serve(picked, decision.rank, tokens)
    assert compared > 150
    assert agreed == compared  # every instance, every request: the same rank
    assert hits > compared // 4  # a replay with hits (growing histories), not only cold prompts
    assert len(used) >= 2  # loads moved requests off the rank holding the shared system prompt


def test_cold_prompts_at_equal_loads_spread_and_agree() -> None:
    """The seen bug (every cold prompt to rank 1 at zero loads) is gone on both halves."""
    cluster = Cluster()
    cluster.report_loads(0.0)
    rng = random.Random(9)
    ranks = Counter()
    for _ in range(64):
        tokens = [rng.randrange(1, 50_000) for _ in range(3 * BS)]
        cluster.report_loads(0.0)  # fresh figures: no commit of an earlier answer counts
        entry = cluster.state.query(MODEL, "default", BS, tokens)["default"]["vllm-prefill-0"]
        rank = entry["dp_detail"]["0"]["scored_rank"]
        assert rank == cluster.dispatchers[0].choose(tokens, [0.0] * RANKS).rank
        ranks[rank] += 1
    assert set(ranks) == set(range(RANKS))
    assert max(ranks.values()) <= 32
