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
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

import yaml

from lmi_cache.config_keys import (
    DEPRECATED_ALIASES,
    EXTRA_CONFIG_KEYS,
    IMPLEMENTED_KEYS,
    LEGACY_KEYS,
    LMCACHE_KEYS,
)
from lmi_cache.errors import ConfigError

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
DISK_FEEDS = ("write_through", "demote")
CACHE_POLICIES = ("LRU", "FIFO")
# LMCache policies we do not implement: accepted with a warning, LRU is used.
_FALLBACK_POLICIES = ("LFU", "MRU")
REMOTE_SCHEMES = ("redis", "rediss", "s3")


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
    remote_url: str | None = None  # redis://host:port or s3://bucket/prefix (validated only)
    use_odirect: bool = False  # extra_config.use_odirect: O_DIRECT disk I/O where the FS allows
    disk_feed: str = "write_through"  # extra_config.disk_feed: write_through or demote (on CPU eviction)
    disk_fsync: bool = False  # extra_config.disk_fsync: fsync each file before the rename
    disk_write_workers: int = 2  # extra_config.disk_write_workers: threads writing files
    disk_read_workers: int = 2  # extra_config.disk_read_workers: parallel reads in retrieve_many
    disk_queue_depth: int = 64  # extra_config.disk_queue_depth: queued writes before stores drop

    @property
    def cpu_capacity_bytes(self) -> int:
        return int(self.max_local_cpu_size * 1024**3) if self.local_cpu else 0

    @property
    def disk_capacity_bytes(self) -> int:
        return int(self.max_local_disk_size * 1024**3) if self.local_disk else 0


# ---------------------------------------------------------------- value parsers
# Each parser takes (value, where) and returns the typed value or raises ConfigError.
# ``where`` is "FILE: key 'k'" or "env LMCACHE_K"; env values arrive as strings.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _parse_int(value: Any, where: str, minimum: int = 0) -> int:
    parsed: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = int(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or parsed < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return parsed


def _parse_size_gib(value: Any, where: str) -> float:
    parsed: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        parsed = float(value)
    elif isinstance(value, str):
        try:
            parsed = float(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or not math.isfinite(parsed) or parsed < 0:
        raise ConfigError(f"{where}: expected a size in GiB >= 0 (e.g. 5 or 0.5), got {value!r}")
    return parsed


def _parse_optional_str(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(value, str):
        return value.strip()
    raise ConfigError(f"{where}: expected a string, got {value!r}")


def parse_local_disk(value: Any, where: str) -> tuple[str, ...]:
    """``"file:///a/,file:///b/"``, a plain path, or a YAML list -> absolute directories."""
    if value is None:
        return ()
    items: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    paths: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{where}: expected file:// paths separated by commas, got {value!r}")
        for part in item.split(","):
            part = part.strip()
            if not part or part.lower() in ("none", "null"):
                continue
            if "://" in part:
                scheme, _, rest = part.partition("://")
                if scheme != "file":
                    raise ConfigError(
                        f"{where}: {part!r} is not a local path; use file:///dir/ (remote stores go in remote_url)"
                    )
                part = rest
            if not os.path.isabs(part):
                raise ConfigError(f"{where}: {part!r} must be an absolute path such as file:///mnt/nvme/kv/")
            paths.append(os.path.normpath(part))
    return tuple(dict.fromkeys(paths))  # de-duplicate, keep order


def parse_remote_url(value: Any, where: str) -> str | None:
    url = _parse_optional_str(value, where)
    if url is None:
        return None
    parsed = urlparse(url)
    if parsed.scheme not in REMOTE_SCHEMES:
        raise ConfigError(
            f"{where}: unsupported remote_url {url!r}; use redis://host:port, rediss://host:port or s3://bucket/prefix"
        )
    if not parsed.hostname:
        raise ConfigError(f"{where}: remote_url {url!r} has no host (or bucket); e.g. redis://cache:6379")
    try:
        port = parsed.port
    except ValueError:
        raise ConfigError(f"{where}: remote_url {url!r} has a bad port; use a number 1-65535") from None
    if parsed.scheme.startswith("redis") and port is None:
        raise ConfigError(f"{where}: remote_url {url!r} needs a port, e.g. redis://{parsed.hostname}:6379")
    return url


def _parse_policy(value: Any, where: str, warnings: list[str]) -> str:
    name = _parse_optional_str(value, where) or ""
    upper = name.upper()
    if upper in CACHE_POLICIES:
        return upper
    if upper in _FALLBACK_POLICIES:
        warnings.append(f"{where}: cache_policy {name} is not implemented by lmi_cache; using LRU")
        return "LRU"
    raise ConfigError(f"{where}: unknown cache_policy {value!r}; use one of {', '.join(CACHE_POLICIES)}")


def _parse_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):  # env: a JSON/YAML object in a string
        try:
            value = yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError:
            raise ConfigError(f"{where}: expected a JSON object such as {{\"use_odirect\": true}}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping such as {{use_odirect: true}}, got {value!r}")
    return {str(k): v for k, v in value.items()}


_SIMPLE_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "chunk_size": lambda v, w: _parse_int(v, w, minimum=1),
    "local_cpu": _parse_bool,
    "max_local_cpu_size": _parse_size_gib,
    "local_disk": parse_local_disk,
    "max_local_disk_size": _parse_size_gib,
    "save_unfull_chunk": _parse_bool,
    "save_decode_cache": _parse_bool,
    "min_retrieve_tokens": lambda v, w: _parse_int(v, w, minimum=0),
    "remote_url": parse_remote_url,
}


def _parse_extra(
    extra: Mapping[str, Any], where: str, where_of: Callable[[str], str], warnings: list[str]
) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    unknown = sorted(k for k in extra if k not in EXTRA_CONFIG_KEYS)
    if unknown:
        # LMCache's extra_config is an open bag used by its plugins: warn, don't fail.
        warnings.append(f"{where}: extra_config keys not used by lmi_cache, ignored: {', '.join(unknown)}")
    for key in sorted(EXTRA_CONFIG_KEYS & set(extra)):
        kw = where_of(f"extra_config.{key}")
        value = extra[key]
        if key in ("use_odirect", "disk_fsync"):
            fields[key] = _parse_bool(value, kw)
        elif key == "disk_feed":
            feed = str(value).strip().lower().replace("-", "_")
            if feed not in DISK_FEEDS:
                raise ConfigError(f"{kw}: expected one of {', '.join(DISK_FEEDS)}, got {value!r}")
            fields[key] = feed
        else:
            fields[key] = _parse_int(value, kw, minimum=1)
    return fields


# ---------------------------------------------------------------- loaders


def _unknown_key_error(key: str, where: str) -> ConfigError:
    candidates = list(LMCACHE_KEYS) + list(DEPRECATED_ALIASES) + list(LEGACY_KEYS)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; see LMCache's configuration reference"
    return ConfigError(f"{where}: unknown key{hint}")


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
        elif key == "cache_policy":
            fields[key] = _parse_policy(value, where, warnings)
        elif key == "extra_config":
            fields.update(_parse_extra(_parse_mapping(value, where), where, where_of, warnings))
        elif key in DEPRECATED_ALIASES:
            warnings.append(f"{where}: {key} is deprecated in LMCache; use {DEPRECATED_ALIASES[key]} (ignored here)")
        elif key in LEGACY_KEYS:
            warnings.append(f"{where}: {key} is a legacy LMCache key, ignored; {LEGACY_KEYS[key]}")
        elif key in LMCACHE_KEYS:
            unimplemented.append(key)
        elif strict:
            raise _unknown_key_error(key, where)
    if unimplemented:
        warnings.append(f"{source}: LMCache keys not implemented by lmi_cache, ignored: {', '.join(unimplemented)}")
    return fields


def _check(config: CacheConfig, source: str, warnings: list[str]) -> None:
    if config.local_disk and config.max_local_disk_size == 0:
        warnings.append(f"{source}: local_disk is set but max_local_disk_size is 0, so the disk tier is off")
    if config.max_local_disk_size > 0 and not config.local_disk:
        warnings.append(f"{source}: max_local_disk_size is set but local_disk is empty, so the disk tier is off")
    if config.remote_url:
        warnings.append(f"{source}: remote_url is validated but remote tiers are not available yet; ignored")


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> tuple[CacheConfig, list[str]]:
    """Parse one LMCache-format mapping. Returns (config, warnings); raises ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of LMCache keys at the top level")
    warnings: list[str] = []
    fields = _merge({str(k): v for k, v in data.items()}, lambda k: f"{source}: key {k!r}", source, warnings, True)
    config = CacheConfig(**fields)
    _check(config, source, warnings)
    return config, warnings


def read_yaml_mapping(path: str) -> Mapping[str, Any]:
    """The top-level mapping of an LMCache YAML file; ConfigError (one line naming the file) otherwise."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; fix {CONFIG_FILE_ENV} or the path given") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}; check indentation and quoting") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of LMCache keys at the top level")
    return data


def load_config(path: str | None = None, env: Mapping[str, str] | None = None) -> tuple[CacheConfig, list[str]]:
    """The file (``path`` or ``$LMCACHE_CONFIG_FILE``) overridden by ``LMCACHE_<KEY>`` env vars."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_FILE_ENV) or None
    warnings: list[str] = []
    fields: dict[str, Any] = {}
    source = path or "environment"
    if path:
        data = read_yaml_mapping(path)
        fields.update(_merge({str(k): v for k, v in data.items()}, lambda k: f"{path}: key {k!r}", path, warnings, True))
    # Only names from the tables are read: other LMCACHE_* vars (log level, ...) are not ours.
    env_values = {
        key: env[f"LMCACHE_{key.upper()}"]
        for key in list(LMCACHE_KEYS) + list(DEPRECATED_ALIASES) + list(LEGACY_KEYS)
        if f"LMCACHE_{key.upper()}" in env
    }
    fields.update(_merge(env_values, lambda k: f"env LMCACHE_{k.upper()}", "environment", warnings, False))
    config = CacheConfig(**fields)
    _check(config, source, warnings)
    return config, warnings


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
        elif value is not None:
            data[field.name] = value
    if extra:
        data["extra_config"] = extra
    return data
