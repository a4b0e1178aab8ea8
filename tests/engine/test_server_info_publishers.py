"""``kv_events.publishers`` in ``/server_info``: the instance stream and the folded view."""

from __future__ import annotations

import pytest

from sglang_kvpub.config import ConfigError, PluginConfig
from sglang_kvpub.engine.publishers import describe_publishers

pytestmark = pytest.mark.unit


def test_publishers_name_each_view_with_a_dialable_endpoint() -> None:
    config = PluginConfig(
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        folded_endpoint="tcp://*:5600",
        folded_replay_endpoint="tcp://*:5601",
        folded_event_encoding="array",
    )
    instance, folded = describe_publishers(config, 2, "10.0.0.7")
    assert instance == {
        "dp_rank": None,
        "dp_ranks": [0, 1],
        "endpoint": "tcp://10.0.0.7:5557",
        "replay_endpoint": "tcp://10.0.0.7:5558",
        "view": "instance",
        "fanned_in": True,
        "event_encoding": "map",
        "rank_order": False,
        "topic": "",
    }
    assert folded["dp_rank"] == 0 and folded["view"] == "folded" and folded["fanned_in"] is True
    assert (folded["endpoint"], folded["replay_endpoint"]) == ("tcp://10.0.0.7:5600", "tcp://10.0.0.7:5601")
    assert (folded["event_encoding"], folded["replay_reply_frames"]) == ("array", 3)
    # a wildcard HTTP host: the consumer substitutes the host it reached /server_info on
    assert describe_publishers(PluginConfig(endpoint="tcp://*:5557"), 1, "0.0.0.0")[0]["endpoint"] == "tcp://*:5557"
    assert len(describe_publishers(PluginConfig(), 4)) == 1  # no folded view configured


def test_folded_config_is_checked_at_start() -> None:
    with pytest.raises(ConfigError, match="folded_endpoint"):
        PluginConfig(folded_replay_endpoint="tcp://*:5601")
    with pytest.raises(ConfigError, match="folded_event_encoding"):
        PluginConfig(folded_endpoint="tcp://*:5600", folded_event_encoding="tuple")  # type: ignore[arg-type]
    env = {"SGLANG_KVPUB_FOLDED_ENDPOINT": "tcp://*:5600", "SGLANG_KVPUB_RANK_ORDER": "true"}
    config = PluginConfig.from_kv_events_json("{}", env)
    assert (config.folded_endpoint, config.rank_order) == ("tcp://*:5600", True)
