"""Both halves accept and refuse the same rank-cost values: one check (core/cost_settings.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_adapter.scoring import KvAffinityConfig
from sglang_kvpub.config import PluginConfig
from sglang_kvpub.core.cost_settings import COST_KEYS, OPTIONAL_COST_KEYS
from sglang_kvpub.core.errors import ConfigError

pytestmark = pytest.mark.unit

_ODD = [0, 1, 2.5, -1, -0.5, "1", "x", float("nan"), float("inf"), -float("inf"), True, False, None, [1], {}]


def _accepts(make: Any, key: str, value: Any) -> bool:
    try:
        make(**{key: value})
    except ConfigError:
        return False
    return True


def _expected(key: str, value: Any) -> bool:
    if value is None:
        return key in OPTIONAL_COST_KEYS
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


@pytest.mark.parametrize("key", COST_KEYS)
@pytest.mark.parametrize("value", _ODD, ids=repr)
def test_the_engine_and_the_adapter_agree_on_each_value(key: str, value: Any) -> None:
    engine, adapter = _accepts(PluginConfig, key, value), _accepts(KvAffinityConfig, key, value)
    assert engine == adapter == _expected(key, value), (key, value, engine, adapter)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(COST_KEYS), st.one_of(st.floats(allow_nan=True), st.integers(-(10**6), 10**6)))
def test_the_engine_and_the_adapter_agree_on_random_numbers(key: str, value: float) -> None:
    assert _accepts(PluginConfig, key, value) == _accepts(KvAffinityConfig, key, value) == _expected(key, value)


def test_the_adapter_names_the_key_it_refuses() -> None:
    with pytest.raises(ConfigError, match=r"kv_affinity\.overlap_credit is -1"):
        KvAffinityConfig(overlap_credit=-1)
