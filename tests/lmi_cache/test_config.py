"""Tests for lmi_cache.config.cache_config: LMCache YAML + LMCACHE_* env parsing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmi_cache.config.cache_config import CacheConfig, config_from_dict, config_to_dict, load_config
from lmi_cache.config.keys import IMPLEMENTED_KEYS, LMCACHE_KEYS
from lmi_cache.errors import ConfigError, UserError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_match_lmcache_table() -> None:
    config = CacheConfig()
    for key in ("chunk_size", "local_cpu", "max_local_cpu_size", "max_local_disk_size", "save_unfull_chunk",
                "save_decode_cache", "cache_policy", "min_retrieve_tokens", "remote_url"):
        assert getattr(config, key) == LMCACHE_KEYS[key][1], key


def test_file_keys_parsed(tmp_path: Path) -> None:
    path = write(tmp_path, """
chunk_size: 128
local_cpu: false
max_local_cpu_size: 2.5
local_disk: "file:///mnt/a/,file:///mnt/b/"
max_local_disk_size: 10
save_unfull_chunk: true
cache_policy: fifo
min_retrieve_tokens: 64
remote_url: redis://cache:6379
extra_config: {use_odirect: true, disk_feed: demote}
""")
    config, warnings = load_config(path, env={})
    assert config.chunk_size == 128 and config.local_cpu is False
    assert config.max_local_cpu_size == 2.5 and config.max_local_disk_size == 10.0
    assert config.local_disk == ("/mnt/a", "/mnt/b")
    assert config.save_unfull_chunk and config.cache_policy == "FIFO" and config.min_retrieve_tokens == 64
    assert config.use_odirect and config.disk_feed == "demote"
    assert config.remote_url == "redis://cache:6379"
    assert not any("remote_url" in w for w in warnings)  # a served store: the remote tier is on
    assert config.cpu_capacity_bytes == 0  # local_cpu false
    assert config.disk_capacity_bytes == 10 * 1024**3


def test_env_overrides_file_and_is_typed(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 128\nmax_local_cpu_size: 1\n")
    env = {"LMCACHE_CONFIG_FILE": path, "LMCACHE_CHUNK_SIZE": "512", "LMCACHE_LOCAL_CPU": "False",
           "LMCACHE_EXTRA_CONFIG": '{"use_odirect": true}', "LMCACHE_LOCAL_DISK": "/data/kv",
           "LMCACHE_MAX_LOCAL_DISK_SIZE": "3", "LMCACHE_LOG_LEVEL": "DEBUG"}
    config, _ = load_config(env=env)
    assert config.chunk_size == 512 and config.max_local_cpu_size == 1.0
    assert config.local_cpu is False and config.use_odirect is True
    assert config.local_disk == ("/data/kv",) and config.max_local_disk_size == 3.0


def test_unknown_key_has_did_you_mean(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_sise: 512\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert path in message and "chunk_sise" in message and "did you mean 'chunk_size'" in message
    assert "\n" not in message and isinstance(info.value, UserError)


def test_unknown_key_at_the_default_of_its_look_alike_only_warns(tmp_path: Path) -> None:
    # LMCache's own RESP example writes async_loading: false (the key is enable_async_loading,
    # default false): LMCache ignores it and nothing changes, so neither do we.
    config, warnings = load_config(write(tmp_path, "async_loading: false\nchunk_size: 512\n"), env={})
    assert config.chunk_size == 512
    assert any("async_loading" in w and "did you mean 'enable_async_loading'" in w for w in warnings)
    with pytest.raises(ConfigError, match="enable_async_loading"):
        load_config(write(tmp_path, "async_loading: true\n"), env={})
    with pytest.raises(ConfigError, match="not an LMCache setting"):
        load_config(write(tmp_path, "kv_offload_everything: 1\n"), env={})


def test_unsupported_features_switched_on_get_their_own_warning() -> None:
    _, warnings = config_from_dict({"enable_pd": True, "enable_nixl": "True", "enable_blending": False}, "x.yaml")
    assert any("enable_pd" in w and "disaggregated prefill" in w for w in warnings)
    assert any("enable_nixl" in w and "NIXL" in w for w in warnings)
    assert not any("blend" in w for w in warnings)  # switched off: nothing to warn about
    config, warnings = config_from_dict({"enable_blending": True, "blend_min_tokens": 64}, "x.yaml")
    # On: kept for the connector (the exact-prefix one says it does not blend); never "not implemented".
    assert config.enable_blending and not any("blend" in w for w in warnings)


def test_unimplemented_keys_one_warning() -> None:
    _, warnings = config_from_dict({"remote_serde": "naive", "use_layerwise": False, "enable_async_loading": False,
                                    "chunk_size": 64}, "x.yaml")
    hits = [w for w in warnings if "not implemented" in w]
    assert len(hits) == 1 and "use_layerwise" in hits[0] and "remote_serde" not in hits[0]


def test_legacy_and_deprecated_keys_warn_with_replacement() -> None:
    _, warnings = config_from_dict({"local_device": "cpu", "nixl_role": "sender"}, "x.yaml")
    assert any("local_device" in w and "local_cpu" in w for w in warnings)
    assert any("nixl_role" in w and "pd_role" in w for w in warnings)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": "abc"}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"max_local_cpu_size": -1}, "max_local_cpu_size"),
        ({"max_local_cpu_size": "lots"}, "max_local_cpu_size"),
        ({"local_cpu": "maybe"}, "local_cpu"),
        ({"local_disk": "relative/path"}, "local_disk"),
        ({"local_disk": "gds:///x"}, "local_disk"),
        ({"remote_url": "ftp://x"}, "remote_url"),
        ({"remote_url": "redis://:6379"}, "remote_url"),
        ({"remote_url": "redis://host:notaport"}, "remote_url"),
        ({"cache_policy": "RANDOM"}, "cache_policy"),
        ({"extra_config": {"disk_feed": "sideways"}}, "disk_feed"),
        ({"extra_config": "not a mapping ["}, "extra_config"),
    ],
)
def test_bad_values_name_file_and_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "conf.yaml")
    assert "conf.yaml" in str(info.value) and key in str(info.value) and "\n" not in str(info.value)


def test_bad_env_value_names_env_var() -> None:
    with pytest.raises(ConfigError, match="LMCACHE_MAX_LOCAL_CPU_SIZE"):
        load_config(env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "five"})


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.yaml"), env={})
    with pytest.raises(ConfigError, match="line"):
        load_config(write(tmp_path, "chunk_size: [1,\n"), env={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), env={})


def test_fallback_policy_and_extra_warnings() -> None:
    config, warnings = config_from_dict({"cache_policy": "LFU", "extra_config": {"foo": 1}}, "c.yaml")
    assert config.cache_policy == "LRU"
    assert any("LFU" in w for w in warnings) and any("foo" in w for w in warnings)


def test_round_trip_through_dict() -> None:
    config = CacheConfig(chunk_size=64, local_disk=("/a", "/b"), max_local_disk_size=2.0, use_odirect=True)
    again, _ = config_from_dict(config_to_dict(config))
    assert again == config
    assert set(config_to_dict(config)) <= IMPLEMENTED_KEYS


def test_config_import_is_torch_free() -> None:
    code = "import sys, lmi_cache.config.cache_config, lmi_cache.keys.hashing; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- LMCache parity and hostile input


@pytest.mark.parametrize("scheme", ["lm", "resp", "redis-sentinel", "infinistore", "mooncakestore", "blackhole",
                                    "fs", "external", "gs", "azure"])
def test_every_lmcache_remote_scheme_is_accepted_with_remote_tier_off(scheme: str) -> None:
    url = f"{scheme}://user:s3cret@host:1234/x"
    config, warnings = config_from_dict({"remote_url": url}, "c.yaml")
    assert config.remote_url == url
    hits = [w for w in warnings if "remote tier is off" in w]
    assert len(hits) == 1 and f"{scheme}://" in hits[0]
    assert all("s3cret" not in w for w in warnings)  # credentials in the URL are never echoed


def test_unknown_remote_scheme_is_refused_without_echoing_the_url() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"remote_url": "redsi://u:topsecret@h:1"}, "c.yaml")
    assert "'redsi'" in str(info.value) and "topsecret" not in str(info.value)


def test_lmcache_03_04_nixl_keys_are_known() -> None:
    _, warnings = config_from_dict({"nixl_receiver_host": "localhost", "nixl_receiver_port": 55555,
                                    "nixl_enable_gc": True, "nixl_peer_port": 1}, "decoder.yaml")
    for key in ("nixl_receiver_host", "nixl_receiver_port", "nixl_enable_gc", "nixl_peer_port"):
        assert any(key in w and "legacy" in w for w in warnings), key


def test_env_values_are_unquoted_like_lmcache(tmp_path: Path) -> None:
    env = {"LMCACHE_CHUNK_SIZE": "'512'", "LMCACHE_LOCAL_DISK": '"file:///data/kv/"',
           "LMCACHE_MAX_LOCAL_DISK_SIZE": " 2 ", "LMCACHE_EXTRA_CONFIG": "'{\"use_odirect\": true}'",
           "LMCACHE_CONFIG_FILE": f"'{write(tmp_path, 'local_cpu: false')}'"}
    config, _ = load_config(env=env)
    assert config.chunk_size == 512 and config.local_disk == ("/data/kv",)
    assert config.max_local_disk_size == 2.0 and config.use_odirect is True and config.local_cpu is False


def test_misspelt_env_var_gets_did_you_mean_and_others_stay_quiet() -> None:
    _, warnings = load_config(env={"LMCACHE_CHUNK_SIZ": "512", "LMCACHE_MAX_LOCAL_CPU_SIZ": "1",
                                   "LMCACHE_LOG_LEVEL": "DEBUG", "LMCACHE_ENABLE_LAYER_TIMING": "1"})
    assert any("LMCACHE_CHUNK_SIZ:" in w and "did you mean LMCACHE_CHUNK_SIZE" in w for w in warnings)
    assert any("did you mean LMCACHE_MAX_LOCAL_CPU_SIZE" in w for w in warnings)
    assert not any("LOG_LEVEL" in w or "LAYER_TIMING" in w for w in warnings)


def test_extra_config_typo_gets_did_you_mean() -> None:
    _, warnings = config_from_dict({"extra_config": {"use_odirekt": True, "s3_num_io_threads": 4}}, "c.yaml")
    assert any("use_odirekt" in w and "did you mean 'use_odirect'" in w for w in warnings)
    assert any("s3_num_io_threads" in w and "did you mean" not in w for w in warnings)


def test_env_override_names_lists_only_config_variables() -> None:
    from lmi_cache.config.cache_config import env_override_names

    env = {"LMCACHE_CHUNK_SIZE": "1", "LMCACHE_REMOTE_URL": "redis://u:p@h:1", "LMCACHE_LOG_LEVEL": "x",
           "LMCACHE_NIXL_ROLE": "sender", "HOME": "/root"}
    assert env_override_names(env) == ["LMCACHE_CHUNK_SIZE", "LMCACHE_NIXL_ROLE", "LMCACHE_REMOTE_URL"]


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"extra_config": {"disk_write_workers": 100000}}, "disk_write_workers"),
        ({"extra_config": {"disk_read_workers": 65}}, "disk_read_workers"),
        ({"extra_config": {"disk_queue_depth": 10**9}}, "disk_queue_depth"),
        ({"chunk_size": 10**18}, "chunk_size"),
        ({"chunk_size": float("nan")}, "chunk_size"),
        ({"max_local_cpu_size": float("inf")}, "max_local_cpu_size"),
        ({"max_local_cpu_size": 1e308}, "max_local_cpu_size"),
        ({"max_local_disk_size": 10**400}, "max_local_disk_size"),
        ({"local_disk": "/tmp/a\x00b"}, "local_disk"),
    ],
)
def test_out_of_range_values_are_one_line_errors(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "conf.yaml")
    assert needle in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 300


def test_integral_float_is_an_integer() -> None:
    config, _ = config_from_dict({"chunk_size": 512.0}, "c.yaml")
    assert config.chunk_size == 512 and isinstance(config.chunk_size, int)


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"chunk_size: 256\nlocal_disk: \xff\xfe\n", "not UTF-8"),
        (b"a: " + b"[" * 20000 + b"]" * 20000 + b"\n", "nested too deeply"),
        (b"chunk_size: " + b"9" * 5000 + b"\n", "over-long number"),
        (b"when: 2001-13-45\n", "malformed date"),
        # A YAML alias bomb (9^9 strings): refused before anything walks or prints it.
        (b"".join(f"{k}: &{a} [{', '.join([prev] * 9)}]\n".encode() for k, a, prev in zip(
            ["blend_check_layers", "p2p_init_ports", "p2p_lookup_ports", "lmcache_worker_ports", "lmcache_worker_ids",
             "pd_peer_init_port", "pd_peer_alloc_port", "pd_peer_query_port", "nixl_backends"],
            "abcdefghi", ['"lol"'] + [f"*{c}" for c in "abcdefgh"])) + b"local_cpu: *i\n", "alias bomb"),
    ],
)
def test_hostile_files_are_one_line_errors(tmp_path: Path, raw: bytes, needle: str) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_file_remote_url_from_lmis_guide_is_ignored_with_advice() -> None:
    config, warnings = config_from_dict({"remote_url": "file:///tmp/lmcache"}, "guide.yaml")
    assert config.remote_url is None
    assert any("file:// is not a remote store" in w and "local_disk" in w for w in warnings)


def test_two_slash_file_url_means_an_absolute_directory() -> None:
    # LMI's LMCache page writes local_disk: "file://tmp/cache/" ("fixed for SM customers").
    config, warnings = config_from_dict({"local_disk": "file://tmp/cache/", "max_local_disk_size": 1}, "perf.yaml")
    assert config.local_disk == ("/tmp/cache",)
    assert any("two slashes" in w and "file:///dir/" in w for w in warnings)
    config, warnings = config_from_dict({"local_disk": "file:///tmp/cache/", "max_local_disk_size": 1}, "ok.yaml")
    assert config.local_disk == ("/tmp/cache",) and not any("two slashes" in w for w in warnings)


def test_engine_never_logs_the_remote_url_password(caplog: pytest.LogCaptureFixture) -> None:
    from lmi_cache.engine import CacheEngine

    config, _ = config_from_dict({"remote_url": "rediss://user:s3cret-pw@cache:6380", "max_local_cpu_size": 0.01},
                                 "c.yaml")
    with caplog.at_level("INFO"):
        engine = CacheEngine(config)
    assert "rediss://" in caplog.text and "s3cret-pw" not in caplog.text
    engine.close()
