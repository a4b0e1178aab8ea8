"""Differential test: our PrefixIndex against NVIDIA Dynamo's RadixTree (ai-dynamo-runtime 1.6.1).

The same random GPU events go to both; for random queries the matched depth per
(instance, dp_rank) must be equal.  Engine block ids are content-derived (equal for equal
prefixes on every rank, as SGLang's are): Dynamo 1.6.1's tree cannot attach a child under
a node that another worker created with a different engine id ("Failed to find parent
block"), while our index keeps engine ids per worker and does not care.

Removals take leaves only, as a radix cache evicts.  When an engine removes a parent but
not its child, the trees differ by design: Dynamo drops the child with the emptied node,
while our index keeps it (the engine never said it left) and counts it again once the
parent is stored again; events say the child is resident, so ours follows the events.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from sglang_kvpub.core.hashing import local_block_hashes, sequence_keys
from sglang_kvpub.core.index import PrefixIndex
from sglang_kvpub.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

dynamo_core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (dynamo._core) is not installed")

pytestmark = pytest.mark.integration

BS = 4
INSTANCES = ["prefill-a", "prefill-b", "prefill-c"]
WORKER_IDS = {name: 100 + i for i, name in enumerate(INSTANCES)}  # Dynamo worker ids are ints
RANKS = [0, 1, 3]


def engine_id(key: int) -> int:
    return (key * 0x9E3779B97F4A7C15 + 17) & ((1 << 64) - 1)


class Both:
    def __init__(self) -> None:
        self.ours = PrefixIndex(BS)
        self.tree = dynamo_core.RadixTree()
        self.event_id = 0

    def _dynamo(self, inst: str, rank: int, data: object) -> None:
        self.event_id += 1
        payload = {"event_id": self.event_id, "data": data, "dp_rank": rank}
        # orphan stores and unknown removals: Dynamo rejects the event, we count it
        with contextlib.suppress(RuntimeError):
            self.tree.apply_event(WORKER_IDS[inst], json.dumps(payload).encode())

    def store(self, inst: str, rank: int, toks: list[int], first: int, last: int) -> None:
        keys = sequence_keys(toks, BS)
        parent = engine_id(keys[first - 1]) if first else None
        hashes = [engine_id(k) for k in keys[first:last]]
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=toks[first * BS : last * BS],
            block_size=BS,
            medium="GPU",
        )
        self.ours.apply_batch(inst, EventBatch(ts=0.0, events=[event], dp_rank=rank))
        locals_ = local_block_hashes(event.token_ids, BS)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, locals_, strict=True)]
        self._dynamo(inst, rank, {"stored": {"parent_hash": parent, "blocks": blocks}})

    def remove(self, inst: str, rank: int, keys: list[int]) -> None:
        hashes = [engine_id(k) for k in keys]
        self.ours.apply_event(inst, rank, BlockRemoved(block_hashes=hashes, medium="GPU"))
        self._dynamo(inst, rank, {"removed": {"block_hashes": hashes}})

    def clear(self, inst: str, rank: int) -> None:
        self.ours.apply_event(inst, rank, AllBlocksCleared())
        self._dynamo(inst, rank, "cleared")

    def compare(self, toks: list[int]) -> None:
        ours = {
            (WORKER_IDS[inst], rank): hit.npu_blocks
            for inst, ranks in self.ours.query(toks).items()
            for rank, hit in ranks.items()
        }
        theirs = dict(self.tree.find_matches(local_block_hashes(toks, BS)).scores)
        assert ours == theirs, toks


def make_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts that share prefixes at several depths, over a tiny alphabet."""
    roots = [[rng.randrange(50) for _ in range(rng.randint(1, 3) * BS)] for _ in range(3)]
    prompts = []
    for _ in range(8):
        base = list(rng.choice(roots))
        base += [rng.randrange(50) for _ in range(rng.randint(1, 5) * BS)]
        prompts.append(base)
    for _ in range(4):  # extensions of existing prompts
        prompts.append(rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randint(1, 3) * BS)])
    return prompts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(12))
def test_same_matches_as_dynamo_radix_tree(seed: int) -> None:
    rng = random.Random(seed)
    prompts = make_prompts(rng)
    both = Both()
    workers = [(inst, rank) for inst in INSTANCES for rank in RANKS]
    held: dict[tuple[str, int], dict[int, int]] = {w: {} for w in workers}  # key -> parent key (0: root)
    for step in range(300):
        worker = rng.choice(workers)
        inst, rank = worker
        toks = rng.choice(prompts)
        keys = sequence_keys(toks, BS)
        roll = rng.random()
        if roll < 0.6:
            first = 0 if rng.random() < 0.5 else rng.randrange(len(keys))
            last = rng.randint(first + 1, len(keys))
            both.store(inst, rank, toks, first, last)
            if first == 0 or keys[first - 1] in held[worker]:
                for i in range(first, last):
                    held[worker][keys[i]] = keys[i - 1] if i else 0
        elif roll < 0.95:
            # leaves only: a radix cache never evicts a node before its children
            parents = set(held[worker].values())
            leaves = [k for k in held[worker] if k not in parents]
            picks = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
            extra = rng.choice(keys)
            if rng.random() < 0.2 and extra not in held[worker]:
                picks.append(extra)  # a block this rank does not hold
            for k in picks:
                held[worker].pop(k, None)
            both.remove(inst, rank, picks)
        else:
            held[worker].clear()
            both.clear(inst, rank)
        if step % 10 == 9:
            for prompt in prompts:
                both.compare(prompt)
                both.compare(prompt[: rng.randint(1, len(prompt))])
            both.compare([rng.randrange(50) for _ in range(3 * BS)])
