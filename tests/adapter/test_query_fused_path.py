"""The service's fused ``/query`` path renders exactly what the general path renders.

``AdapterState.query`` / ``query_by_hash`` fold hits straight into the conductor JSON from a
cached per-``(model, tenant, block_size)`` grouping of registrations. Reference: the
general composition ``conductor_response(*instance_hits(.., KvAffinity.query_keys))`` and
the per-tier hit metrics as read back from that JSON. Registration changes must show up in
the next query (the grouping cache is invalidated).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest
from conftest import offline_state
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_adapter.affinity import KvAffinity
from motor_adapter.registration import Registration, Unregistration
from motor_adapter.scoring import KvAffinityConfig, conductor_response
from motor_adapter.service import AdapterState, RequestError, ServiceConfig, u32_tokens
from sglang_kvpub import wire
from sglang_kvpub.core.hashing import chain_hashes, local_block_hashes, sequence_keys

pytestmark = pytest.mark.unit

BS = 4
MODEL = "m"
MEDIA = (wire.MEDIUM_GPU, wire.MEDIUM_CPU, wire.MEDIUM_DISK)


def _state(cfg: KvAffinityConfig, shape: str = "tokens") -> AdapterState:
    return offline_state(ServiceConfig(kv_affinity=cfg, query_shape=shape))


def _reg(instance: str, dp: int, stream: str | None, block_size: int = BS, tenant: str = "default") -> Registration:
    return Registration(
        instance_id=instance,
        dp_rank=dp,
        model=MODEL,
        tenant=tenant,
        block_size=block_size,
        engine_type="sglang",
        store_backend="",
        media={"npu": stream} if stream else {},
        replay_endpoint=None,
        node_id=None,
        dp_size=None,
        fanned_in=True,
        stream=stream,
        mode="engine" if stream else "http_only",
        compat_dp_size=None,
    )


def _store(aff: KvAffinity, stream: str, rank: int, tokens: list[int], rng: random.Random) -> None:
    """A prefix of ``tokens`` on ``rank``: some blocks in GPU, continuing in CPU, then disk."""
    blocks = rng.randint(0, len(tokens) // BS)
    parent: int | None = None
    start = 0
    for medium in MEDIA:
        count = rng.randint(0, blocks - start) if medium != wire.MEDIUM_DISK else blocks - start
        if count <= 0:
            continue
        hashes = [rng.getrandbits(63) for _ in range(count)]
        event = wire.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens[start * BS : (start + count) * BS],
            block_size=BS,
            medium=medium,
        )
        aff.index.apply_batch(stream, wire.EventBatch(ts=0.0, events=[event], dp_rank=rank))
        parent, start = hashes[-1], start + count


def _reference(state: AdapterState, keys: list[int], tenant: str = "default") -> dict[str, Any]:
    hits, dps, _ = state.instance_hits(MODEL, tenant, BS, lambda aff: aff.query_keys(keys))
    cfg = state.scoring_config(BS)
    return conductor_response(hits, dps, BS, tenant=tenant, fold=True, cfg=cfg, shape=state.config.query_shape)


def _expected_hit_metrics(response: Mapping[str, Any]) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for instance, entry in response.items():
        detail = entry["DP"] if isinstance(next(iter(entry["DP"].values()), None), dict) else entry["dp_detail"]
        for dp, fig in detail.items():
            for tier in ("npu", "cpu", "disk"):
                count = fig[f"{tier}_blocks"]
                if fig["matched_tokens"] and count:
                    labels = (
                        ("dp", dp),
                        ("engine_dp_rank", str(fig["engine_dp_rank"])),
                        ("instance", instance),
                        ("tier", tier),
                    )
                    out[labels] = out.get(labels, 0.0) + count
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    w_cpu=st.sampled_from([0.0, 0.5, 1.0]),
    w_disk=st.sampled_from([0.0, 1.0]),
    shape=st.sampled_from(["tokens", "rank_dicts"]),
)
def test_fused_query_equals_conductor_response_of_instance_hits(
    seed: int, w_cpu: float, w_disk: float, shape: str
) -> None:
    rng = random.Random(seed)
    state = _state(KvAffinityConfig(block_size=BS, w_cpu=w_cpu, w_disk=w_disk), shape)
    try:
        tokens = [rng.randrange(1000) for _ in range(rng.randint(0, 10) * BS + rng.randrange(BS))]
        streams: list[str] = []
        for i in range(rng.randint(1, 4)):
            instance = f"p{i}"
            dps = rng.sample(range(6), rng.choice([1, 1, 2, 3]))
            shared = rng.random() < 0.3  # several dps naming one URL (pool-mode style)
            for n, dp in enumerate(dps):
                roll = rng.random()
                stream = None if roll < 0.1 else f"tcp://127.0.0.1:{1000 + i * 10 + (0 if shared else n)}"
                block_size = BS * 2 if 0.1 <= roll < 0.2 else BS  # registered at another block size: unusable
                state.register(_reg(instance, dp, stream, block_size))
                if stream is not None and block_size == BS and stream not in streams:
                    streams.append(stream)
        for stream in streams:
            aff = state.affinity(MODEL, "default", BS)
            assert aff is not None
            for rank in rng.sample(range(8), rng.randint(0, 4)):
                _store(aff, stream, rank, tokens, rng)
        keys = sequence_keys(tokens, BS)
        expected = _reference(state, keys)
        assert state.query(MODEL, "default", BS, u32_tokens(tokens)) == expected
        assert state.query(MODEL, "default", BS, tokens) == expected
        assert state.query_by_hash(MODEL, "default", BS, local_block_hashes(tokens, BS)) == expected
        assert chain_hashes(local_block_hashes(tokens, BS)) == keys
        want = {k: 3 * v for k, v in _expected_hit_metrics(expected["default"]).items()}
        assert state.metrics.instance_hits.items() == want
        best = max((e["longest_matched"] // BS for e in expected["default"].values()), default=0)
        assert state.metrics.hit_blocks.value(model=MODEL) == 3 * min(best, len(keys))
        assert state.metrics.query_blocks.value(model=MODEL) == 3 * len(keys)
        assert state.metrics.latency.count(model=MODEL) == 3
    finally:
        state.close()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    steps=st.lists(st.sampled_from(["store", "remove", "new_rank", "query"]), min_size=1, max_size=30),
)
def test_remembered_answers_follow_every_index_change(seed: int, steps: list[str]) -> None:
    """``/query`` remembers an answer per walk result of the index (HBM only): stores,
    removals and ranks that appear between two queries of the same prompt must show in the
    next answer, every answer must equal the general path's, and every query is counted."""
    rng = random.Random(seed)
    state = _state(KvAffinityConfig(block_size=BS))
    try:
        streams = ["tcp://127.0.0.1:1001", "tcp://127.0.0.1:1002"]
        for i, stream in enumerate(streams):
            state.register(_reg(f"p{i}", 0, stream))
        aff = state.affinity(MODEL, "default", BS)
        assert aff is not None
        tokens = [rng.randrange(1000) for _ in range(8 * BS)]
        keys = sequence_keys(tokens, BS)
        held: dict[tuple[str, int], list[int]] = {}  # (stream, rank) -> block hashes stored, in order
        queries = 0
        for step in [*steps, "query"]:
            stream, rank = rng.choice(streams), rng.randrange(3 if step != "new_rank" else 64)
            chain = held.setdefault((stream, rank), [])
            if step in ("store", "new_rank") and len(chain) < len(keys):
                more = rng.randint(1, len(keys) - len(chain))
                hashes = [rng.getrandbits(62) + 1 for _ in range(more)]
                event = wire.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=chain[-1] if chain else None,
                    token_ids=tokens[len(chain) * BS : (len(chain) + more) * BS],
                    block_size=BS,
                    medium=wire.MEDIUM_GPU,
                )
                aff.index.apply_batch(stream, wire.EventBatch(ts=0.0, events=[event], dp_rank=rank))
                chain.extend(hashes)
            elif step == "remove" and chain:
                cut = rng.randrange(len(chain))
                removed = wire.BlockRemoved(block_hashes=chain[cut:], medium=wire.MEDIUM_GPU)
                aff.index.apply_batch(stream, wire.EventBatch(ts=0.0, events=[removed], dp_rank=rank))
                del chain[cut:]
            expected = _reference(state, keys)
            first = state.answer_keys(MODEL, "default", BS, keys, len(keys), 0.0)
            again = state.answer_keys(MODEL, "default", BS, keys, len(keys), 0.0)
            queries += 2
            assert first.body == again.body == expected
            assert again is first  # the same walk: the remembered answer
        assert state.metrics.latency.count(model=MODEL) == queries
        assert state.metrics.query_blocks.value(model=MODEL) == queries * len(keys)
    finally:
        state.close()


def test_registration_changes_reach_the_next_query() -> None:
    state = _state(KvAffinityConfig(block_size=BS))
    try:
        tokens = list(range(3 * BS))
        state.register(_reg("p0", 0, "tcp://127.0.0.1:1001"))
        assert list(state.query(MODEL, "default", BS, tokens)["default"]) == ["p0"]
        state.register(_reg("p1", 0, "tcp://127.0.0.1:1002"))
        aff = state.affinity(MODEL, "default", BS)
        assert aff is not None
        _store(aff, "tcp://127.0.0.1:1002", 3, tokens, random.Random(1))
        body = state.query(MODEL, "default", BS, tokens)["default"]
        assert list(body) == ["p0", "p1"] and body == _reference(state, sequence_keys(tokens, BS))["default"]
        state.register(_reg("p0", 1, "tcp://127.0.0.1:1003"))  # p0 now has two registered dps
        assert list(state.query(MODEL, "default", BS, tokens)["default"]["p0"]["DP"]) == ["0", "1"]
        assert state.unregister(Unregistration("p0", None, None, "default")) == 2
        assert list(state.query(MODEL, "default", BS, tokens)["default"]) == ["p1"]
        assert state.unregister(Unregistration("p1", None, None, "default")) == 1
        with pytest.raises(RequestError) as info:
            state.query(MODEL, "default", BS, tokens)
        assert info.value.status == 404 and info.value.reason == "NoIndexer"
    finally:
        state.close()


def test_counter_cells_and_inc_labels_count_the_same_series() -> None:
    from motor_adapter.metrics import Counter, Registry

    counter = Counter("c_total", "help")
    labels = (("a", "x"),)
    counter.inc_labels(labels, 2)
    cell = counter.cell(labels)
    cell.inc(3)
    counter.inc(a="x")
    assert counter.cell(labels) is cell
    assert counter.value(a="x") == 6 and counter.items() == {labels: 6}
    assert 'c_total{a="x"} 6.0' in Registry().render([counter]).splitlines()


def test_repeated_adds_read_exactly_as_adds_made_one_by_one() -> None:
    """``Counter.repeat`` (a repeated ``/query``'s hits per instance) defers its adds to the
    next read: every read (``items``, ``value``, the exposition) shows what adding them one by
    one shows, and unread repeats are folded in past a bound."""
    from motor_adapter import metrics

    direct, repeated = metrics.Counter("c_total", "h"), metrics.Counter("c_total", "h")

    def lines(counter: metrics.Counter) -> list[str]:
        return metrics.Registry().render([counter]).splitlines()

    labels = [(("instance", f"p{i}"),) for i in range(4)]
    rng = random.Random(3)
    tallies = [tuple((i, rng.randrange(1, 50)) for i in rng.sample(range(4), rng.randint(1, 4))) for _ in range(6)]
    for series in labels:  # a tally creates its series when it is made, before any count
        direct.cell(series)
        repeated.cell(series)
    adds = [tuple((repeated.cell(labels[i]), count) for i, count in t) for t in tallies]
    for step in range(300):
        pick = rng.randrange(len(tallies))
        for i, count in tallies[pick]:
            direct.cell(labels[i]).inc(count)
        repeated.repeat(adds[pick])
        if step % 37 == 0:
            assert lines(repeated) == lines(direct)
        if step % 53 == 0:
            assert repeated.value(instance="p1") == direct.value(instance="p1")
    assert repeated.items() == direct.items()
    assert lines(repeated) == lines(direct)
    many = metrics.Counter("c_total", "h")
    cell = many.cell(labels[0])
    for _ in range(metrics._REPEATS_MAX + 5):  # distinct adds, never read: folded in, not kept
        many.repeat(((cell, 1.0),))
    assert len(many._repeats) <= metrics._REPEATS_MAX
    assert many.value(instance="p0") == metrics._REPEATS_MAX + 5
