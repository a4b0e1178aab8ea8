"""The rank cost's C definition (sglang_kvpub/core/rank_cost.h, through ``dispatch_score``)
agrees with its Python reference (``rank_cost._score_ranks_py``) on random inputs: the same
rank, reason, matched tokens, cost and load - or the same refusal."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvpub.core import hashing, rank_cost

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(hashing.NATIVE is None, reason="the C helpers are not built (or KVPUB_NATIVE=0)"),
]

_weights = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(min_value=-2.0, max_value=4.0, allow_nan=False))
_loads = st.one_of(
    st.integers(min_value=0, max_value=10**7),
    st.floats(min_value=0.0, max_value=1e9, allow_nan=False),
    st.sampled_from([0.0, 0.5, 2.5, 1e15]),
)
_optional = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e5, allow_nan=False))


@st.composite
def _inputs(draw: Any) -> tuple[Any, ...]:
    size = draw(st.integers(min_value=1, max_value=24))
    loads = draw(st.lists(_loads, min_size=size, max_size=size))
    ranks = draw(st.lists(st.integers(min_value=0, max_value=size - 1), min_size=1, max_size=size, unique=True))
    held = draw(st.lists(st.sampled_from(ranks), unique=True))
    block = st.integers(min_value=0, max_value=80)
    hits = {rank: (draw(block), draw(block), draw(block)) for rank in held}
    params = rank_cost.CostParams(
        block_size=draw(st.sampled_from([1, 16, 64, 128, 256])),
        w_npu=draw(_weights),
        w_cpu=draw(_weights),
        w_disk=draw(_weights),
        prefill_load_scale=draw(_weights),
        overlap_credit=draw(_weights),
        load_weight=draw(_weights),
        hotspot_spread=draw(_optional),
        hotspot_relative=draw(_optional),
    )
    start = draw(st.integers(min_value=0, max_value=len(ranks) - 1))
    isl = draw(st.integers(min_value=0, max_value=20_000))
    return hits, loads, ranks, start, isl, params


def _outcome(call: Any) -> Any:
    try:
        return call()
    except (ValueError, OverflowError) as error:
        return type(error)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    floats = zip(a[3:], b[3:], strict=True)
    return a[:3] == b[:3] and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in floats)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_inputs())
def test_the_c_cost_agrees_with_the_python_reference(inputs: tuple[Any, ...]) -> None:
    hits, loads, ranks, start, isl, params = inputs
    in_c = _outcome(lambda: rank_cost.score_ranks(hits, loads, list(ranks), start, isl, params))
    in_python = _outcome(lambda: rank_cost._score_ranks_py(hits, loads, list(ranks), start, isl, params))
    assert _same(in_c, in_python), (in_c, in_python)


@pytest.mark.parametrize("weight", [math.inf, -math.inf, math.nan])
def test_a_weight_without_a_value_is_refused_alike(weight: float) -> None:
    params = rank_cost.CostParams(block_size=16, w_npu=weight)
    hits = {0: (3, 0, 0)}
    in_c = _outcome(lambda: rank_cost.score_ranks(hits, [0.0, 0.0], [0, 1], 0, 100, params))
    in_python = _outcome(lambda: rank_cost._score_ranks_py(hits, [0.0, 0.0], [0, 1], 0, 100, params))
    assert isinstance(in_c, type) and in_c is in_python
