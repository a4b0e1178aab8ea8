"""PluginConfig: SGLang keys, plugin keys from JSON and env, clear errors."""

from __future__ import annotations

import json

import pytest

from sglang_kvpub.config import ConfigError, PluginConfig, offset_endpoint, should_bind

pytestmark = pytest.mark.unit


def test_defaults_match_sglang() -> None:
    config = PluginConfig.from_kv_events_json('{"publisher": "zmq"}', env={})
    assert config.endpoint == "tcp://*:5557"
    assert (config.buffer_steps, config.hwm, config.max_queue_size, config.topic) == (10_000, 100_000, 100_000, "")
    assert config.replay_endpoint is None and config.bind is None and config.binds
    assert config.hash_form == "u64" and config.event_encoding == "map" and config.full_policy == "drop_oldest"
    assert config.rank_send == "inline"


def test_sglang_keys_and_plugin_keys_from_json_and_env() -> None:
    text = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:6667",
            "topic": "kv",
            "buffer_steps": 500,
            "hash_form": "i64",
        }
    )
    env = {
        "SGLANG_KVPUB_HASH_FORM": "u64",
        "SGLANG_KVPUB_HEARTBEAT_S": "0.5",
        "SGLANG_KVPUB_RANK_QUEUE_SIZE": "7",
        "SGLANG_KVPUB_RANK_SEND": "thread",
    }
    config = PluginConfig.from_kv_events_json(text, env=env)
    assert config.replay_endpoint == "tcp://*:6667" and config.topic == "kv" and config.buffer_steps == 500
    assert config.hash_form == "i64"  # the JSON wins over env
    assert config.heartbeat_s == 0.5 and config.rank_queue_size == 7 and config.rank_send == "thread"


def test_from_mapping_ignores_factory_extras() -> None:
    config = PluginConfig.from_mapping({"attn_dp_rank": 3, "endpoint": "tcp://*:5600", "bind": None}, env={})
    assert config.endpoint == "tcp://*:5600"


@pytest.mark.parametrize(
    ("text", "env", "fragment"),
    [
        ('{"hash_form": "hex"}', {}, "'hash_form'"),
        ("{}", {"SGLANG_KVPUB_HASH_FORM": "hex"}, "SGLANG_KVPUB_HASH_FORM"),
        ("{}", {"SGLANG_KVPUB_HEARTBEAT_S": "soon"}, "'soon'"),
        ('{"buffer_steps": 0}', {}, "integer >= 1"),
        ('{"endpoint": "http://x:1"}', {}, "tcp://"),
        ('{"bind": "yes"}', {}, "true, false or null"),
        ('{"internal_channel": "tcp://*:5600"}', {}, "fan-in host"),
        ('{"full_policy": "block"}', {}, "drop_oldest"),
        ('{"rank_send": "async"}', {}, "'inline', 'thread'"),
        ('{"dp_dispatch": "magic"}', {}, "cache_aware"),
        ("[1]", {}, "JSON object"),
        ("{nope", {}, "not valid JSON"),
    ],
)
def test_bad_values_name_key_value_and_fix(text: str, env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        PluginConfig.from_kv_events_json(text, env=env)
    assert fragment in str(info.value)


def test_bind_rule_and_offsets() -> None:
    assert should_bind("tcp://*:5557") and should_bind("tcp://0.0.0.0:1") and should_bind("ipc:///tmp/x")
    assert not should_bind("tcp://127.0.0.1:5557") and should_bind("tcp://127.0.0.1:5557", True)
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ConfigError):
        offset_endpoint("ipc:///tmp/x", 1)
