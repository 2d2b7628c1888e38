"""Settings -> remote store and RemoteCache, importing redis or boto3 only for the store in use (any process).

``open_remote`` raises ``ConfigError`` (one line, naming the setting) for bad
settings or a missing client library; it never contacts the store, so a store
that is down at start is a miss later, not a failed start. ``probe_remote``
checks reachability once, for start-up messages.
"""
from __future__ import annotations

from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.store import RemoteStore
from lmi_cache.remote.value_codec import ValueCodec, load_secret


def open_store(settings: RemoteSettings) -> RemoteStore:
    if settings.kind == "s3":
        from lmi_cache.remote.s3_store import S3Store

        return S3Store(settings)
    from lmi_cache.remote.redis_store import RedisStore

    return RedisStore(settings)


def open_remote(
    settings: RemoteSettings,
    *,
    secret: bytes | None = None,
    metrics: CacheMetrics | None = None,
    warner: RateLimitedWarner | None = None,
) -> RemoteCache:
    """The remote tier's client; the MAC secret defaults to ``LMI_CACHE_REMOTE_SECRET``."""
    codec = ValueCodec(secret if secret is not None else load_secret(), settings.compression)
    return RemoteCache(open_store(settings), codec, settings, metrics=metrics, warner=warner)


def probe_remote(settings: RemoteSettings, timeout_s: float = 1.0) -> str | None:
    """One PING (Redis) or HEAD bucket (S3) within ``timeout_s``: None when the store answers, else why not.

    For ``configure``/``serve`` start-up checks: the answer is safe to print
    (no credentials) and a store that does not answer is not an error.
    """
    cache = RemoteCache(open_store(settings), ValueCodec(), settings)
    try:
        return cache.ping(timeout_s)
    finally:
        cache.close(flush_timeout_s=0.0)
