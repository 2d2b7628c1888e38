"""The LMCache 0.5.6 configuration key table (facts, torch-free, any process).

``lmi_cache.config.cache_config`` parses against this table; autoconfig renders from the
same names. Each entry is ``key -> (LMCache type, LMCache default)``. The
environment variable of a key is ``LMCACHE_`` + the key in upper case.
"""
from __future__ import annotations

from typing import Any

# Every key LMCache 0.5.6 accepts, with its declared type and default.
LMCACHE_KEYS: dict[str, tuple[str, Any]] = {
    "chunk_size": ("int", 256),
    "local_cpu": ("bool", True),
    "max_local_cpu_size": ("float", 5.0),
    "local_cpu_use_hugepages": ("bool", False),
    "reserve_local_cpu_size": ("float", 0.0),
    "local_disk": ("Optional[str]", None),
    "local_disk_path_sharding": ("str", 'by_gpu'),
    "max_local_disk_size": ("float", 0.0),
    "remote_url": ("Optional[str]", None),
    "remote_serde": ("Optional[str]", 'naive'),
    "use_layerwise": ("bool", False),
    "save_decode_cache": ("bool", False),
    "pre_caching_hash_algorithm": ("str", 'builtin'),
    "enable_blending": ("bool", False),
    "blend_recompute_ratios": ("Optional[list[float]]", None),
    "blend_thresholds": ("Optional[list[float]]", None),
    "blend_check_layers": ("list[int]", None),
    "blend_min_tokens": ("int", 256),
    "blend_special_str": ("str", ' # # '),
    "retrieve_locations": ("Optional[list[str]]", None),
    "store_location": ("Optional[str]", None),
    "enable_p2p": ("bool", False),
    "p2p_host": ("Optional[str]", None),
    "p2p_init_ports": ("Optional[list[int]]", None),
    "p2p_lookup_ports": ("Optional[list[int]]", None),
    "mp_host": ("Optional[str]", None),
    "mp_port": ("int", 5555),
    "enable_controller": ("bool", False),
    "lmcache_instance_id": ("Optional[str]", None),
    "controller_pull_url": ("Optional[str]", None),
    "controller_reply_url": ("Optional[str]", None),
    "lmcache_worker_ports": ("Optional[list[int]]", None),
    "lmcache_worker_ids": ("Optional[list[int]]", None),
    "lmcache_worker_heartbeat_delay_time": ("int", 10),
    "lmcache_worker_heartbeat_time": ("Optional[int]", None),
    "enable_pd": ("bool", False),
    "pd_role": ("Optional[str]", None),
    "pd_buffer_size": ("Optional[int]", None),
    "pd_buffer_device": ("Optional[str]", None),
    "pd_peer_host": ("Optional[str]", None),
    "pd_peer_init_port": ("Optional[list[int]]", None),
    "pd_peer_alloc_port": ("Optional[list[int]]", None),
    "pd_peer_query_port": ("Optional[list[int]]", None),
    "pd_proxy_host": ("Optional[str]", None),
    "pd_proxy_port": ("Optional[int]", None),
    "pd_allocation_timeout_sec": ("float", float("inf")),
    "pd_shutdown_timeout_sec": ("float", 5.0),
    "pd_condition_poll_interval_sec": ("float", 0.005),
    "pd_max_prefill_len": ("int", 0),
    "pd_backend_mode": ("Optional[str]", 'async'),
    "pd_skip_proxy_notification": ("bool", False),
    "pd_bidirectional": ("bool", False),
    "transfer_channel": ("Optional[str]", None),
    "nixl_backends": ("Optional[list[str]]", None),
    "nixl_buffer_size": ("Optional[int]", None),
    "nixl_buffer_device": ("Optional[str]", None),
    "gds_path": ("Optional[str]", None),
    "gds_path_sharding": ("str", 'by_gpu'),
    "gds_buffer_size": ("Optional[int]", None),
    "maru_path": ("Optional[str]", None),
    "maru_pool_size": ("float", 4.0),
    "use_gds": ("bool", True),
    "gds_backend": ("str", 'cufile'),
    "audit_actual_remote_url": ("Optional[str]", None),
    "internal_api_server_host": ("str", '127.0.0.1'),
    "extra_config": ("Optional[dict]", None),
    "save_unfull_chunk": ("bool", False),
    "blocking_timeout_secs": ("int", 10),
    "external_lookup_client": ("Optional[str]", None),
    "py_enable_gc": ("bool", True),
    "cache_policy": ("str", 'LRU'),
    "numa_mode": ("Optional[str]", None),
    "enable_async_loading": ("bool", False),
    "internal_api_server_enabled": ("bool", False),
    "internal_api_server_port_start": ("int", 6999),
    "priority_limit": ("Optional[int]", None),
    "internal_api_server_include_index_list": ("Optional[list[int]]", None),
    "internal_api_server_socket_path_prefix": ("Optional[str]", None),
    "runtime_plugin_locations": ("Optional[list[str]]", None),
    "storage_plugins": ("Optional[list[str]]", None),
    "remote_storage_plugins": ("Optional[list[str]]", None),
    "lookup_timeout_ms": ("int", 3000),
    "min_retrieve_tokens": ("int", 0),
    "hit_miss_ratio": ("Optional[float]", None),
    "lookup_server_worker_ids": ("Optional[list[int]]", None),
    "enable_scheduler_bypass_lookup": ("bool", False),
    "script_allowed_imports": ("Optional[list[str]]", None),
    "run_script_api_enabled": ("bool", False),
    "enable_lazy_memory_allocator": ("bool", False),
    "lazy_memory_initial_ratio": ("float", 0.2),
    "lazy_memory_expand_trigger_ratio": ("float", 0.5),
    "lazy_memory_step_ratio": ("float", 0.1),
    "lazy_memory_safe_size": ("float", 0.0),
    "enable_chunk_statistics": ("bool", False),
    "chunk_statistics_auto_start_statistics": ("bool", False),
    "chunk_statistics_auto_exit_timeout_hours": ("float", 0.0),
    "chunk_statistics_auto_exit_target_unique_chunks": ("int", 0),
    "chunk_statistics_strategy": ("str", 'memory_bloom_filter'),
    "enable_kv_events": ("bool", False),
    "use_gpu_connector_v3": ("bool", False),
    "pin_timeout_sec": ("int", 300),
    "pin_check_interval_sec": ("int", 30),
    "remote_config_url": ("Optional[str]", None),
    "app_id": ("Optional[str]", None),
    "enable_hidden_state_cache": ("bool", False),
    "max_hidden_state_cpu_size": ("float", 2.0),
    "hidden_state_layers": ("Optional[list[int]]", None),
    "hidden_states_retrieve_mode": ("str", 'prefix_strict'),
}

# Keys lmi_cache implements with LMCache's meaning (the rest warn once).
IMPLEMENTED_KEYS: frozenset[str] = frozenset(
    {
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_disk",
        "max_local_disk_size",
        "save_unfull_chunk",
        "save_decode_cache",
        "cache_policy",
        "min_retrieve_tokens",
        "remote_url",
        "remote_serde",
        "lookup_timeout_ms",
        "extra_config",
    }
)

# LMCache's own renamed keys: old name -> the name to use instead.
DEPRECATED_ALIASES: dict[str, str] = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_role": "pd_role",
    "controller_url": "controller_pull_url",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}

# Keys of older LMCache releases still found in the wild: key -> what to do instead.
LEGACY_KEYS: dict[str, str] = {
    "local_device": "use local_cpu: true for RAM, or local_disk: file:///path/ with max_local_disk_size",
    "use_experimental": "remove it (the experimental engine is the only engine now)",
    "pipelined_backend": "remove it (no longer used)",
    "blend_recompute_ratio": "use blend_recompute_ratios (a list)",
    "lookup_url": "remove it (lookups are in-process)",
    "distributed_url": "remove it (use enable_p2p / remote_url)",
    "error_handling": "remove it (cache faults are always treated as misses)",
    "enable_nixl": "use enable_pd with transfer_channel: nixl",
    "weka_path": "use gds_path",
    "cufile_buffer_size": "use gds_buffer_size",
    # LMCache 0.3-0.4 disaggregated-prefill (NIXL) keys that 0.5 replaced by the pd_* family.
    "nixl_receiver_host": "LMCache 0.3/0.4 NIXL receiver host (0.5: pd_peer_host); P/D transfer is not done by lmi_cache",
    "nixl_receiver_port": "LMCache 0.3/0.4 NIXL receiver port (0.5: pd_peer_init_port); P/D transfer is not done by lmi_cache",
    "nixl_peer_port": "LMCache 0.3 name of nixl_receiver_port; P/D transfer is not done by lmi_cache",
    "nixl_enable_gc": "LMCache 0.3/0.4 NIXL garbage-collection switch; P/D transfer is not done by lmi_cache",
}

# Switches of LMCache features lmi_cache does not provide -> what they ask for. Set to
# true they get their own warning (the server runs without the feature), not just a name in a list.
UNSUPPORTED_FEATURES: dict[str, str] = {
    "enable_pd": "disaggregated prefill (KV sent from a prefill to a decode instance)",
    "enable_nixl": "disaggregated prefill over NIXL (LMCache 0.3/0.4)",
    "enable_xpyd": "disaggregated prefill (LMCache 0.3 name of enable_pd)",
    "enable_controller": "the LMCache controller",
    "use_layerwise": "layer-by-layer KV transfer",
}

# Every remote_url scheme an LMCache 0.3-0.5 connector adapter accepts (each adapter's
# ``schema``; redis also takes rediss:// and unix://, couchbase also couchbases://),
# plus valkeys:// (Valkey over TLS), which lmi_cache's own remote store speaks.
# Those lmi_cache does not serve (SERVED_REMOTE_SCHEMES) are accepted with a warning that the
# remote tier is off; another scheme is an error (most likely a typo).
REMOTE_URL_SCHEMES: tuple[str, ...] = (
    "lm", "redis", "rediss", "unix", "redis-sentinel", "resp", "valkey", "valkeys", "valkey-sync",
    "infinistore", "mooncakestore", "blackhole", "audit", "fs", "s3", "s3-rdma", "cuobj+s3",
    "gs", "azure", "hf3fs", "eic", "sagemaker-hyperpod", "shmfile", "couchbase", "couchbases",
    "mock", "external", "benchmark",
)

# The schemes lmi_cache's own remote tier serves (lmi_cache.remote); the others warn that the remote tier is off.
SERVED_REMOTE_SCHEMES: frozenset[str] = frozenset({"redis", "rediss", "valkey", "valkeys", "unix", "s3"})

# LMCACHE_* environment variables LMCache reads that are not configuration keys (names
# after the prefix). LMCache reads many more ad hoc (timing, telemetry, ...), so only a
# name close to a key's variable gets a did-you-mean; other names are left alone.
ENV_NON_KEY_NAMES: frozenset[str] = frozenset({"CONFIG_FILE", "USE_EXPERIMENTAL", "LOG_LEVEL"})
# Prefixes of LMCACHE_* variable families read elsewhere in LMCache (erasure-coding settings).
ENV_NON_KEY_PREFIXES: tuple[str, ...] = ("EC_",)

# extra_config keys lmi_cache reads (LMCache's extra_config is an untyped bag).
EXTRA_CONFIG_KEYS: frozenset[str] = frozenset(
    {"use_odirect", "disk_feed", "disk_fsync", "disk_write_workers", "disk_read_workers", "disk_queue_depth",
     "remote_compression", "remote_io_timeout_ms", "remote_put_queue_bytes", "remote_key_prefix", "remote_ttl_s",
     "remote_cluster", "s3_endpoint_url", "s3_region", "remote_max_workers", "session_retention_share",
     "peer_transport", "peer_timeout_ms", "peer_lease_ms", "peer_advertise",
     "peer_holders_url"}
)
