"""The remote tier's configuration keys: parsing and the ``RemoteSettings`` they make (torch-free; any process).

LMCache keys: ``remote_url`` (which store; see ``lmi_cache.remote.settings``),
``remote_serde`` (only the lossless ``naive``) and ``lookup_timeout_ms``
(LMCache's default is 3000 ms; lmi_cache's is 50 ms because the scheduler
answers "not yet" while a lookup is in flight, so a slow store delays one
request by at most this, never the batch). lmi_cache's ``extra_config`` keys
are listed in ``REMOTE_EXTRA_KEYS`` with their defaults. Secrets never come
from the YAML: ``LMI_CACHE_REMOTE_SECRET`` (value MAC) and
``LMI_CACHE_REMOTE_USERNAME`` / ``LMI_CACHE_REMOTE_PASSWORD`` (Redis) are read
from the environment by the remote package.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmi_cache.config.values import parse_bool, parse_int, parse_optional_str, show
from lmi_cache.errors import ConfigError

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.remote.settings import RemoteSettings

MAX_TIMEOUT_MS = 600_000  # ten minutes: anything longer is a typo
MAX_PUT_QUEUE_BYTES = 1 << 40
MAX_REMOTE_WORKERS = 256
MAX_TTL_S = 10 * 365 * 86400
# extra_config key -> RemoteSettings field (the defaults live on CacheConfig and RemoteSettings alike).
REMOTE_EXTRA_KEYS: dict[str, str] = {
    "remote_compression": "compression",
    "remote_io_timeout_ms": "io_timeout_ms",
    "remote_put_queue_bytes": "put_queue_bytes",
    "remote_key_prefix": "key_prefix",
    "remote_ttl_s": "ttl_s",
    "remote_cluster": "cluster",
    "s3_endpoint_url": "s3_endpoint_url",
    "s3_region": "s3_region",
    "remote_max_workers": "max_workers",
}
COMPRESSIONS = ("off", "zstd", "zstd-planes")


def parse_serde(value: Any, where: str) -> str:
    """The serde name; checked (only ``naive`` is lossless) by ``remote_settings`` when the remote tier is on."""
    return (parse_optional_str(value, where) or "naive").lower()


def parse_lookup_timeout(value: Any, where: str) -> int:
    return parse_int(value, where, minimum=1, maximum=MAX_TIMEOUT_MS)


def parse_remote_extra(key: str, value: Any, where: str) -> Any:
    """One typed ``extra_config`` value of the remote tier; ConfigError naming ``where`` otherwise."""
    if key == "remote_compression":
        name = str(value).strip().lower() if value is not False else "off"
        if name not in COMPRESSIONS:
            raise ConfigError(f"{where}: expected one of {', '.join(COMPRESSIONS)}, got {show(value)}")
        return name
    if key == "remote_cluster":
        return parse_bool(value, where)
    if key in ("s3_endpoint_url", "s3_region"):
        return parse_optional_str(value, where)
    if key == "remote_key_prefix":
        prefix = parse_optional_str(value, where)
        if not prefix or any(c in prefix for c in " \n\r\t{}"):
            raise ConfigError(f"{where}: a non-empty name without spaces or braces, e.g. lmi-cache-prod")
        return prefix
    if key == "remote_ttl_s":
        return parse_int(value, where, minimum=0, maximum=MAX_TTL_S)
    if key == "remote_put_queue_bytes":
        return parse_int(value, where, minimum=1 << 20, maximum=MAX_PUT_QUEUE_BYTES)
    if key == "remote_max_workers":
        return parse_int(value, where, minimum=1, maximum=MAX_REMOTE_WORKERS)
    if key == "remote_io_timeout_ms":
        return parse_int(value, where, minimum=1, maximum=MAX_TIMEOUT_MS)
    raise KeyError(key)


def remote_settings(config: CacheConfig, source: str = "config") -> RemoteSettings | None:
    """The remote tier's settings, or None when ``remote_url`` names no store lmi_cache serves.

    Raises ConfigError (one line, credentials redacted, naming ``source``) for a URL
    the store cannot use (no host, bad port, no bucket).
    """
    from lmi_cache.remote.url import parse_remote_url

    url = config.remote_url
    if not url or not parse_remote_url(url).served:
        return None
    return store_settings(config, url, source)


def store_settings(config: CacheConfig, url: str, source: str = "config") -> RemoteSettings:
    """Settings for a store at ``url`` with the remote tier's timeouts, key prefix, cluster mode and backoff.

    One reading of those keys for every Redis/Valkey client lmi_cache opens: the remote
    tier's and the peer tier's holder records (which may live in a store of their own).
    """
    from lmi_cache.remote.settings import RemoteSettings

    options = {field: getattr(config, key) for key, field in REMOTE_EXTRA_KEYS.items()}
    try:
        return RemoteSettings(url, serde=config.remote_serde, lookup_timeout_ms=config.lookup_timeout_ms, **options)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
