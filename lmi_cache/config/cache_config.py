"""CacheConfig: the LMCache-format YAML plus ``LMCACHE_<KEY>`` env, typed and validated.

Runs in every process that needs the engine settings (vLLM workers, the vLLM
scheduler, autoconfig at container start), so it must stay torch-free.
Semantics follow LMCache 0.5.6 (sizes are GiB per rank; env overrides the
file). Differences on purpose: unknown keys are an error with a did-you-mean
hint (LMCache only logs them), known-but-unimplemented keys give one warning.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lmi_cache.config.keys import (
    DEPRECATED_ALIASES,
    EXTRA_CONFIG_KEYS,
    LEGACY_KEYS,
    LMCACHE_KEYS,
    UNSUPPORTED_FEATURES,
)
from lmi_cache.config.yaml_reader import (  # noqa: F401 (re-exported)
    CONFIG_FILE_ENV,
    MAX_CONFIG_FILE_BYTES,
    read_yaml_mapping,
)
from lmi_cache.config.peer import PEER_EXTRA_KEYS, check_peer, parse_peer_extra, parse_ports, parse_transfer_channel
from lmi_cache.config.remote import REMOTE_EXTRA_KEYS, parse_lookup_timeout, parse_remote_extra, parse_serde, remote_settings
from lmi_cache.config.env import env_names, env_override_names, env_where, misspelt_env_warnings  # noqa: F401 (re-exported)
from lmi_cache.config.values import (
    MAX_CHUNK_TOKENS,
    MAX_DISK_WORKERS,
    MAX_QUEUE_DEPTH,
    parse_bool,
    parse_int,
    parse_local_disk,
    parse_mapping,
    parse_optional_str,
    parse_remote_url_value,
    parse_size_gib,
    show,
    unquote_env,
)
from lmi_cache.errors import ConfigError
from lmi_cache.remote.url import parse_remote_url
from lmi_cache.eviction.retaining import DEFAULT_RETENTION_SHARE, parse_retention_share

DISK_FEEDS = ("write_through", "demote")
CACHE_POLICIES = ("LRU", "FIFO")
# LMCache policies we do not implement: accepted with a warning, LRU is used.
_FALLBACK_POLICIES = ("LFU", "MRU")


@dataclass(frozen=True)
class CacheConfig:
    """Engine settings, one per rank. Every field has LMCache's meaning unless noted."""

    chunk_size: int = 256  # tokens per chunk (the unit of hashing, storing and loading)
    local_cpu: bool = True  # keep a CPU-RAM tier
    max_local_cpu_size: float = 5.0  # GiB per rank for the CPU tier
    local_disk: tuple[str, ...] = ()  # disk-tier directories (from "file:///a/,file:///b/")
    max_local_disk_size: float = 0.0  # GiB per rank for the disk tier, split over the paths
    save_unfull_chunk: bool = False  # also store a trailing partial chunk
    save_decode_cache: bool = False  # also store KV produced while decoding
    cache_policy: str = "LRU"  # eviction policy of every tier: LRU or FIFO
    min_retrieve_tokens: int = 0  # a hit shorter than this is reported as 0
    remote_url: str | None = None  # redis/rediss/valkey/valkeys/unix/s3 turn the remote tier on; others warn
    remote_serde: str = "naive"  # LMCache remote_serde: only the lossless "naive"
    lookup_timeout_ms: int = 50  # remote existence checks give up after this (LMCache's default is 3000)
    use_odirect: bool = False  # extra_config.use_odirect: O_DIRECT disk I/O where the FS allows
    disk_feed: str = "write_through"  # extra_config.disk_feed: write_through or demote (on CPU eviction)
    disk_fsync: bool = False  # extra_config.disk_fsync: fsync each file before the rename
    disk_write_workers: int = 2  # extra_config.disk_write_workers: threads writing files
    disk_read_workers: int = 2  # extra_config.disk_read_workers: parallel reads in retrieve_many
    disk_queue_depth: int = 64  # extra_config.disk_queue_depth: queued writes before stores drop
    # extra_config.session_retention_share: share of the CPU tier where open sessions' chunks are evicted last (0: off)
    session_retention_share: float = DEFAULT_RETENTION_SHARE
    # LMCache's enable_blending as given: the blending connector reads it with the blend_* keys
    # (lmi_cache.blend.settings); the exact-prefix connector only says that it does not blend.
    enable_blending: bool = False
    # extra_config keys of the remote tier (lmi_cache.config.remote; RemoteSettings documents each).
    remote_compression: str = "off"  # off | zstd | zstd-planes (lossless)
    remote_io_timeout_ms: int = 2000  # a batched remote load or store batch gives up after this
    remote_put_queue_bytes: int = 256 << 20  # stores waiting for the network; beyond: dropped, counted
    remote_key_prefix: str = "lmi-cache"  # first part of every remote key
    remote_ttl_s: int = 0  # Redis/Valkey expiry (0: until the store evicts)
    remote_cluster: bool = False  # Redis/Valkey cluster mode (or ?cluster=true in the URL)
    s3_endpoint_url: str | None = None  # S3-compatible endpoint
    s3_region: str | None = None  # S3 region (default: boto3's chain)
    remote_max_workers: int = 16  # parallel S3 requests per batch
    # The peer tier (lmi_cache.config.peer documents each): LMCache's P2P keys, then extra_config keys.
    enable_p2p: bool = False
    p2p_host: str | None = None  # None: 127.0.0.1
    p2p_init_ports: tuple[int, ...] = ()  # one per rank
    p2p_lookup_ports: tuple[int, ...] = ()  # one per rank
    transfer_channel: str | None = None  # only "mooncake" (the engine the peer tier uses)
    peer_transport: str = "tcp"  # tcp | rdma | efa
    peer_timeout_ms: int = 2000  # a peer read gives up after this; vLLM recomputes
    peer_lease_ms: int = 5000  # a peer pins chunks for a reader at most this long
    peer_advertise: bool = True  # record in the holder store which chunks this server holds
    peer_holders_url: str | None = None  # a Redis/Valkey for holder records only (else a Redis/Valkey remote_url)

    @property
    def cpu_capacity_bytes(self) -> int:
        return int(self.max_local_cpu_size * 1024**3) if self.local_cpu else 0

    @property
    def disk_capacity_bytes(self) -> int:
        return int(self.max_local_disk_size * 1024**3) if self.local_disk else 0


def _parse_policy(value: Any, where: str, warnings: list[str]) -> str:
    name = parse_optional_str(value, where) or ""
    upper = name.upper()
    if upper in CACHE_POLICIES:
        return upper
    if upper in _FALLBACK_POLICIES:
        warnings.append(f"{where}: cache_policy {name} is not implemented by lmi_cache; using LRU")
        return "LRU"
    raise ConfigError(f"{where}: unknown cache_policy {show(value)}; use one of {', '.join(CACHE_POLICIES)}")


_SIMPLE_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "chunk_size": lambda v, w: parse_int(v, w, minimum=1, maximum=MAX_CHUNK_TOKENS),
    "local_cpu": parse_bool,
    "max_local_cpu_size": parse_size_gib,
    "local_disk": parse_local_disk,
    "max_local_disk_size": parse_size_gib,
    "save_unfull_chunk": parse_bool,
    "save_decode_cache": parse_bool,
    "min_retrieve_tokens": lambda v, w: parse_int(v, w, minimum=0),
    "remote_serde": parse_serde,
    "lookup_timeout_ms": parse_lookup_timeout,
    "enable_p2p": parse_bool,
    "p2p_host": parse_optional_str,
    "p2p_init_ports": parse_ports,
    "p2p_lookup_ports": parse_ports,
}
# extra_config integer keys -> their upper bound (threads and queue slots are allocated up front).
_EXTRA_INT_MAX = {"disk_write_workers": MAX_DISK_WORKERS, "disk_read_workers": MAX_DISK_WORKERS,
                  "disk_queue_depth": MAX_QUEUE_DEPTH}


def _parse_extra(
    extra: Mapping[str, Any], where: str, where_of: Callable[[str], str], warnings: list[str]
) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    plugin_keys = []
    for key in sorted(k for k in extra if k not in EXTRA_CONFIG_KEYS):
        # LMCache's extra_config is an open bag read by its plugins: warn, don't fail.
        close = difflib.get_close_matches(key, sorted(EXTRA_CONFIG_KEYS), n=1, cutoff=0.75)
        if close:
            warnings.append(f"{where_of('extra_config.' + key)}: not read by lmi_cache, ignored; did you mean {close[0]!r}?")
        else:
            plugin_keys.append(key)
    if plugin_keys:
        warnings.append(f"{where_of('extra_config')}: keys for LMCache's own backends, not read by lmi_cache, "
                        f"ignored: {', '.join(plugin_keys)}")
    problems: list[str] = []  # every bad value at once: one fix-and-retry round, not one per key
    for key in sorted(EXTRA_CONFIG_KEYS & set(extra)):
        try:
            fields[key] = _parse_extra_value(key, extra[key], where_of(f"extra_config.{key}"))
        except ConfigError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in extra_config: " + "; ".join(problems))
    return fields


def _parse_extra_value(key: str, value: Any, kw: str) -> Any:
    if key in REMOTE_EXTRA_KEYS:
        return parse_remote_extra(key, value, kw)
    if key in PEER_EXTRA_KEYS:
        return parse_peer_extra(key, value, kw)
    if key == "session_retention_share":
        return parse_retention_share(value, kw)
    if key in ("use_odirect", "disk_fsync"):
        return parse_bool(value, kw)
    if key == "disk_feed":
        feed = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
        if feed not in DISK_FEEDS:
            raise ConfigError(f"{kw}: expected one of {', '.join(DISK_FEEDS)}, got {show(value)}")
        return feed
    return parse_int(value, kw, minimum=1, maximum=_EXTRA_INT_MAX[key])


# ---------------------------------------------------------------- loaders


def unknown_key_problem(key: str, value: Any) -> tuple[str, bool]:
    """(message, is_error) for a top-level key that no LMCache release defines.

    An error with a did-you-mean, except when the key is close to a real one and its
    value is that key's default: LMCache would ignore it and so would the author's
    intent (``async_loading: false`` in LMCache's own RESP example), so it only warns.
    """
    candidates = list(LMCACHE_KEYS) + list(DEPRECATED_ALIASES) + list(LEGACY_KEYS)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:
        return "unknown key; not an LMCache setting (see LMCache's configuration reference)", True
    default = LMCACHE_KEYS.get(close[0], (None, object()))[1]
    if type(value) is type(default) and value == default:
        return (f"unknown key, ignored; did you mean {close[0]!r}? (its value {show(value)} is {close[0]}'s default, "
                "so ignoring it changes nothing)"), False
    return f"unknown key; did you mean {close[0]!r}?", True


def _merge(
    values: Mapping[str, Any], where_of: Callable[[str], str], source: str, warnings: list[str], strict: bool
) -> dict[str, Any]:
    """Typed CacheConfig fields from raw key -> value pairs (one source)."""
    fields: dict[str, Any] = {}
    unimplemented: list[str] = []
    for key, value in values.items():
        where = where_of(key)
        if key in _SIMPLE_PARSERS:
            fields[key] = _SIMPLE_PARSERS[key](value, where)
            if key == "local_disk" and _two_slash_file_url(value):
                warnings.append(f"{where}: file://dir/ (two slashes) read as /dir/, as LMI's LMCache page means it "
                                "(LMCache itself would use a directory relative to where the server starts); "
                                "write file:///dir/")
        elif key == "cache_policy":
            fields[key] = _parse_policy(value, where, warnings)
        elif key == "transfer_channel":
            fields[key] = parse_transfer_channel(value, where, warnings)
        elif key == "remote_url":
            url = parse_remote_url_value(value, where)
            if url is not None and url.lower().startswith("file://"):
                warnings.append(f"{where}: file:// is not a remote store in LMCache 0.3-0.5 (LMI's LMCache guide shows "
                                "it), ignored; to keep KV on local disk set local_disk: file:///path/ and "
                                "max_local_disk_size")
                url = None
            fields[key] = url
        elif key == "extra_config":
            fields.update(_parse_extra(parse_mapping(value, where), where, where_of, warnings))
        elif key == "enable_blending" or key.startswith("blend_"):
            # Checked by lmi_cache.blend.settings, which the blending connector and start-up read.
            if key == "enable_blending":
                fields[key] = _truthy(value)
        elif key in UNSUPPORTED_FEATURES and _truthy(value):
            warnings.append(f"{where}: asks for {UNSUPPORTED_FEATURES[key]}, which lmi_cache does not provide; "
                            "this server runs without it (its local tiers still serve)")
        elif key in DEPRECATED_ALIASES:
            warnings.append(f"{where}: {key} is deprecated in LMCache; use {DEPRECATED_ALIASES[key]} (ignored here)")
        elif key in LEGACY_KEYS:
            warnings.append(f"{where}: {key} is a legacy LMCache key, ignored; {LEGACY_KEYS[key]}")
        elif key in LMCACHE_KEYS:
            unimplemented.append(key)
        elif strict:
            message, is_error = unknown_key_problem(key, value)
            if is_error:
                raise ConfigError(f"{where}: {message}")
            warnings.append(f"{where}: {message}")
    if unimplemented:
        warnings.append(f"{source}: LMCache keys not implemented by lmi_cache, ignored: {', '.join(unimplemented)}")
    return fields


def _two_slash_file_url(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(i, str) and any(p.strip().startswith("file://") and not p.strip().startswith("file:///")
                                          for p in i.split(",")) for i in items)


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().strip("'\"").lower() in ("true", "1"))


def _check(config: CacheConfig, source: str, warnings: list[str]) -> None:
    if config.local_disk and config.max_local_disk_size == 0:
        warnings.append(f"{source}: local_disk is set but max_local_disk_size is 0, so the disk tier is off")
    if config.max_local_disk_size > 0 and not config.local_disk:
        warnings.append(f"{source}: max_local_disk_size is set but local_disk is empty, so the disk tier is off")
    remote = parse_remote_url(config.remote_url) if config.remote_url else None  # parsed at load
    scheme = remote.scheme if remote is not None else ""
    if remote is not None and not remote.served:
        warnings.append(f"{source}: remote_url ({scheme}://) is a valid LMCache remote store, but lmi_cache has "
                        "no store for it: the remote tier is off (the local tiers still serve); lmi_cache serves "
                        "redis://, rediss://, valkey://, valkeys://, unix:// and s3://")
    if remote is not None and not remote.served and config.remote_serde != "naive":
        warnings.append(f"{source}: remote_serde {config.remote_serde} is not used (no remote tier for "
                        f"{scheme}://); lmi_cache's remote tier stores KV losslessly (remote_serde: naive)")
    warnings += check_peer(config, source)
    remote_settings(config, source)  # a served URL the store cannot use is an error now, not at the first request


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> tuple[CacheConfig, list[str]]:
    """Parse one LMCache-format mapping. Returns (config, warnings); raises ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of LMCache keys at the top level")
    warnings: list[str] = []
    fields = _merge({str(k): v for k, v in data.items()}, lambda k: f"{source}: key {show(k)}", source, warnings, True)
    config = CacheConfig(**fields)
    _check(config, source, warnings)
    return config, warnings




def load_config(path: str | None = None, env: Mapping[str, str] | None = None) -> tuple[CacheConfig, list[str]]:
    """The file (``path`` or ``$LMCACHE_CONFIG_FILE``) overridden by ``LMCACHE_<KEY>`` env vars.

    Env values are read as LMCache reads them: one pair of surrounding quotes is dropped
    (``LMCACHE_CHUNK_SIZE="'512'"`` is 512). A misspelt LMCACHE_* name gets a did-you-mean warning.
    """
    env = os.environ if env is None else env
    path = path or unquote_env(env.get(CONFIG_FILE_ENV, "")) or None
    return config_with_env(read_yaml_mapping(path) if path else None, env, path or "environment")


def config_with_env(data: Mapping[str, Any] | None, env: Mapping[str, str],
                    source: str = "<dict>") -> tuple[CacheConfig, list[str]]:
    """An LMCache mapping (``source`` names it; None: no file) with ``LMCACHE_<KEY>`` from ``env`` on top."""
    warnings: list[str] = []
    fields: dict[str, Any] = {}
    if data is not None:
        fields.update(_merge({str(k): v for k, v in data.items()}, lambda k: f"{source}: key {show(k)}", source,
                             warnings, True))
    # Only names from the tables are read: other LMCACHE_* vars (log level, ...) are not ours.
    env_values = {key: unquote_env(env[name]) for name, key in env_names().items() if name in env}
    fields.update(_merge(env_values, env_where, "environment", warnings, False))
    warnings += misspelt_env_warnings(env)
    config = CacheConfig(**fields)
    _check(config, source, warnings)
    return config, warnings


_PEER_KEYS = ("enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "transfer_channel")


def config_to_dict(config: CacheConfig) -> dict[str, Any]:
    """The LMCache-format mapping of ``config`` (what autoconfig writes; round-trips)."""
    defaults = CacheConfig()
    data: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for field in dataclasses.fields(CacheConfig):
        value = getattr(config, field.name)
        if field.name in EXTRA_CONFIG_KEYS:
            if value != getattr(defaults, field.name):
                extra[field.name] = value
        elif field.name == "local_disk":
            if value:
                data[field.name] = ",".join(f"file://{p.rstrip('/')}/" for p in value)
        elif field.name in ("remote_serde", "lookup_timeout_ms", "enable_blending", *_PEER_KEYS):
            if value != getattr(defaults, field.name):
                data[field.name] = list(value) if isinstance(value, tuple) else value
        elif value is not None:
            data[field.name] = value
    if extra:
        data["extra_config"] = extra
    return data
