"""Settings of the remote tier: the store URL and typed options (torch-free; any process).

``remote_url`` picks the store: ``redis://``, ``rediss://`` (TLS), ``valkey://``,
``valkeys://`` (TLS) and ``unix:///path.sock`` talk to Redis or Valkey
(``?cluster=true`` or ``cluster=True`` for cluster mode); ``s3://bucket/prefix``
talks to S3 or an S3-compatible store (``s3_endpoint_url``). Credentials come
from the URL's userinfo, the ``LMI_CACHE_REMOTE_USERNAME`` /
``LMI_CACHE_REMOTE_PASSWORD`` environment variables (Redis) or boto3's standard
chain (S3), and never appear in ``display_url``, logs, metrics or errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit

from lmi_cache.errors import ConfigError
from lmi_cache.remote.value_codec import COMPRESSION_CHOICES

USERNAME_ENV = "LMI_CACHE_REMOTE_USERNAME"
PASSWORD_ENV = "LMI_CACHE_REMOTE_PASSWORD"
REDIS_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
# LMCache's remote_serde values: only "naive" stores KV as is; the others are lossy encodings.
LOSSLESS_SERDES = ("naive",)
LOSSY_SERDES = ("cachegen", "kivi", "fp8")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class RemoteSettings:
    """Everything the remote tier needs; defaults suit a store in the same region."""

    url: str  # remote_url: where the store is
    serde: str = "naive"  # LMCache remote_serde: only the lossless "naive" is accepted
    compression: str = "off"  # off | zstd | zstd-planes: lossless compression of remote values
    lookup_timeout_ms: int = 50  # a batched EXISTS/HEAD gives up after this: misses, never a stall
    io_timeout_ms: int = 2000  # a batched GET, or one background put batch, gives up after this
    put_queue_bytes: int = 256 << 20  # values waiting for the background writer; beyond: dropped, counted
    key_prefix: str = "lmi-cache"  # first part of every key: several deployments can share one store
    ttl_s: int = 0  # Redis: expire values after this many seconds (0: keep until the store evicts)
    cluster: bool = False  # Redis/Valkey cluster mode (also ``?cluster=true`` in the URL)
    s3_endpoint_url: str | None = None  # S3-compatible stores (MinIO, ...); None: AWS from the region
    s3_region: str | None = None  # None: boto3's chain (AWS_REGION, config file, ...)
    max_workers: int = 16  # parallel S3 requests per batch
    backoff_initial_s: float = 0.5  # first wait after a failed call before the store is tried again
    backoff_max_s: float = 30.0  # longest wait between tries while the store stays down

    def __post_init__(self) -> None:
        check_serde(self.serde)
        if self.compression not in COMPRESSION_CHOICES:
            raise ConfigError(
                f"remote compression {self.compression!r} is not supported; use one of {', '.join(COMPRESSION_CHOICES)}"
            )
        for name in ("lookup_timeout_ms", "io_timeout_ms", "put_queue_bytes", "max_workers"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"remote setting {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.ttl_s < 0:
            raise ConfigError(f"remote setting ttl_s must be 0 (no expiry) or positive, got {self.ttl_s!r}")
        if not self.key_prefix or any(c in self.key_prefix for c in " \n\r\t{}"):
            raise ConfigError(f"remote key_prefix {self.key_prefix!r} must be non-empty, without spaces or braces")
        store_kind(self.url)

    @property
    def kind(self) -> str:
        return store_kind(self.url)

    @property
    def display_url(self) -> str:
        return redact_url(self.url)

    @property
    def wants_cluster(self) -> bool:
        query = dict(parse_qsl(urlsplit(self.url).query))
        return self.cluster or query.get("cluster", "").lower() in _TRUE


def check_serde(serde: str) -> None:
    if serde in LOSSLESS_SERDES:
        return
    if serde in LOSSY_SERDES:
        raise ConfigError(
            f"remote_serde: {serde!r} is a lossy KV encoding and would change outputs; "
            "use remote_serde: naive (lmi-cache compresses remote values losslessly instead)"
        )
    raise ConfigError(f"remote_serde: unknown value {serde!r}; use naive")


def store_kind(url: str) -> str:
    """"redis" or "s3" for a supported ``remote_url``; ConfigError naming the URL (redacted) otherwise."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in REDIS_SCHEMES:
        if scheme != "unix" and not parts.hostname:
            raise ConfigError(f"remote_url {redact_url(url)!r} has no host; e.g. redis://cache:6379")
        if scheme == "unix" and not parts.path:
            raise ConfigError(f"remote_url {redact_url(url)!r} has no socket path; e.g. unix:///run/redis.sock")
        try:
            parts.port
        except ValueError:
            raise ConfigError(f"remote_url {redact_url(url)!r} has a bad port; use a number 1-65535") from None
        return "redis"
    if scheme == "s3":
        if not parts.netloc or "@" in parts.netloc:
            raise ConfigError(f"remote_url {redact_url(url)!r} needs a bucket, e.g. s3://my-bucket/kv-cache")
        return "s3"
    raise ConfigError(
        f"remote_url {redact_url(url)!r}: unsupported scheme {scheme!r}; use redis://, rediss://, "
        "valkey://, valkeys://, unix:// or s3://"
    )


def redact_url(url: str) -> str:
    """``url`` without its userinfo (credentials never reach logs or messages)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        if "@" in parts.netloc:
            netloc = "***@" + netloc
        return f"{parts.scheme}://{netloc}{parts.path}"
    except ValueError:
        return "<unparseable url>"


def redis_client_url(url: str) -> str:
    """The URL redis-py understands: valkey schemes mapped, our own query options removed."""
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "cluster"])
    return f"{REDIS_SCHEMES[parts.scheme.lower()]}://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")


def s3_location(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix") (prefix without slashes at the ends)."""
    parts = urlsplit(url)
    return parts.netloc, parts.path.strip("/")
