"""The peer tier's LMCache keys (enable_p2p, p2p_*, transfer_channel) and extra_config keys."""
from __future__ import annotations

import pytest

from lmi_cache.config.cache_config import config_from_dict, config_to_dict, config_with_env
from lmi_cache.config.peer import peer_ports
from lmi_cache.errors import ConfigError


def test_yaml_lists_and_scalars_and_env_strings_give_the_same_ports() -> None:
    listed, _ = config_from_dict({"enable_p2p": True, "p2p_init_ports": [8200, 8202], "p2p_lookup_ports": [8201, 8203]})
    env, _ = config_with_env(None, {"LMCACHE_ENABLE_P2P": "true", "LMCACHE_P2P_INIT_PORTS": "8200,8202",
                                    "LMCACHE_P2P_LOOKUP_PORTS": "[8201, 8203]"})
    assert listed.p2p_init_ports == env.p2p_init_ports == (8200, 8202)
    assert listed.p2p_lookup_ports == env.p2p_lookup_ports == (8201, 8203)
    assert env.enable_p2p and peer_ports(env, 1) == (8202, 8203) and peer_ports(env, 2) is None
    scalar, _ = config_from_dict({"enable_p2p": True, "p2p_init_ports": 8300, "p2p_lookup_ports": "8301"})
    assert (scalar.p2p_init_ports, scalar.p2p_lookup_ports) == ((8300,), (8301,))


def test_without_ports_each_rank_takes_two_from_8200() -> None:
    config, _ = config_from_dict({"enable_p2p": True})
    assert [peer_ports(config, rank) for rank in range(3)] == [(8200, 8201), (8202, 8203), (8204, 8205)]


@pytest.mark.parametrize("data, needle", [
    ({"enable_p2p": True, "p2p_init_ports": [8200, 8202], "p2p_lookup_ports": [8201]}, "one port per rank"),
    ({"enable_p2p": True, "p2p_init_ports": [8200], "p2p_lookup_ports": [8200]}, "in both"),
    ({"enable_p2p": True, "p2p_init_ports": [8200]}, "give both"),
    ({"p2p_init_ports": [8200, 8200]}, "listed twice"),
    ({"p2p_init_ports": "http"}, "p2p_init_ports"),
    ({"p2p_lookup_ports": 70000}, "p2p_lookup_ports"),
    ({"extra_config": {"peer_transport": "ib"}}, "tcp, rdma, efa"),
    ({"enable_p2p": True, "extra_config": {"peer_timeout_ms": 9000, "peer_lease_ms": 1000}}, "outlive"),
])
def test_bad_peer_settings_are_one_line_errors(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "lmcache.yaml")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_transfer_channel_other_than_mooncake_warns() -> None:
    config, warnings = config_from_dict({"enable_p2p": True, "transfer_channel": "nixl"})
    assert config.transfer_channel is None and any("Mooncake" in w for w in warnings)
    config, warnings = config_from_dict({"enable_p2p": True, "transfer_channel": "mooncake"})
    assert config.transfer_channel == "mooncake" and not warnings


def test_peer_settings_round_trip_through_the_written_yaml() -> None:
    config, _ = config_from_dict({"enable_p2p": True, "p2p_host": "10.0.0.5", "p2p_init_ports": [8200],
                                  "p2p_lookup_ports": [8201],
                                  "extra_config": {"peer_transport": "efa", "peer_timeout_ms": 500}})
    data = config_to_dict(config)
    assert data["p2p_init_ports"] == [8200] and data["extra_config"]["peer_transport"] == "efa"
    assert config_from_dict(data)[0] == config
    assert "enable_p2p" not in config_to_dict(config_from_dict({})[0])  # off stays unwritten


@pytest.mark.parametrize("url, needle", [
    ("s3://bucket/kv", "Redis or Valkey, not s3://"),
    ("http://cache:6379", "Redis or Valkey, not http://"),
    ("cache:6379", "without a scheme"),
    ("redis://:secret@:6379", "peer_holders_url 'redis://***@:6379' has no host"),
    ("valkey://cache:99999", "bad port"),
])
def test_a_holder_store_lmi_cache_cannot_use_is_a_one_line_error_naming_the_key(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"enable_p2p": True, "extra_config": {"peer_holders_url": url}}, "lmcache.yaml")
    message = str(info.value)
    assert message.startswith("lmcache.yaml: key 'extra_config.peer_holders_url': ") and needle in message
    assert "\n" not in message and "secret" not in message


def test_the_holder_store_is_its_own_url_else_a_redis_remote_url_else_none() -> None:
    from lmi_cache.config.peer import HolderRecords, holder_records

    assert holder_records("valkey://records:6379", "redis://cache:6379") == HolderRecords("valkey://records:6379", True)
    assert holder_records("valkey://records:6379", "s3://bucket/kv") == HolderRecords("valkey://records:6379", True)
    assert holder_records(None, "rediss://cache:6380") == HolderRecords("rediss://cache:6380", False)
    assert holder_records(None, "s3://bucket/kv") is None and holder_records(None, None) is None


def test_the_holder_store_is_set_the_lmcache_ways_and_warned_about_when_it_does_nothing() -> None:
    url = "valkeys://records:6380"
    yaml, _ = config_from_dict({"enable_p2p": True, "extra_config": {"peer_holders_url": url}})
    env, warnings = config_with_env(None, {"LMCACHE_ENABLE_P2P": "true",
                                           "LMCACHE_EXTRA_CONFIG": '{"peer_holders_url": "%s"}' % url})
    assert yaml.peer_holders_url == env.peer_holders_url == url and not warnings
    assert config_from_dict(config_to_dict(yaml))[0] == yaml
    _, warnings = config_from_dict({"extra_config": {"peer_holders_url": url}}, "lmcache.yaml")
    assert warnings == ["lmcache.yaml: extra_config.peer_holders_url is set but enable_p2p is off: no holder "
                        "records are kept or read"]
    # LMCache reads extra_config from one variable only: a variable per extra_config key is said to be ignored.
    config, warnings = config_with_env(None, {"LMCACHE_ENABLE_P2P": "true", "LMCACHE_PEER_HOLDERS_URL": url})
    assert config.peer_holders_url is None
    assert warnings == ["env LMCACHE_PEER_HOLDERS_URL: not an LMCache variable, ignored; peer_holders_url is an "
                        "extra_config key: set LMCACHE_EXTRA_CONFIG='{\"peer_holders_url\": ...}'"]
