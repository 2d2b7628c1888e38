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
from functools import cached_property

from lmi_cache.errors import ConfigError
from lmi_cache.remote.url import RemoteUrl, parse_remote_url
from lmi_cache.remote.value_codec import COMPRESSION_CHOICES

USERNAME_ENV = "LMI_CACHE_REMOTE_USERNAME"
PASSWORD_ENV = "LMI_CACHE_REMOTE_PASSWORD"
# LMCache's remote_serde values: only "naive" stores KV as is; the others are lossy encodings.
LOSSLESS_SERDES = ("naive",)
LOSSY_SERDES = ("cachegen", "kivi", "fp8")


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
        self.remote_url.store_kind()

    @cached_property
    def remote_url(self) -> RemoteUrl:
        """``url`` parsed once (checked in ``__post_init__``); kind, display and store clients read it."""
        return parse_remote_url(self.url)

    @property
    def kind(self) -> str:
        return self.remote_url.store_kind()

    @property
    def display_url(self) -> str:
        return self.remote_url.redacted

    @property
    def wants_cluster(self) -> bool:
        return self.cluster or self.remote_url.flag("cluster")


def check_serde(serde: str) -> None:
    if serde in LOSSLESS_SERDES:
        return
    if serde in LOSSY_SERDES:
        raise ConfigError(
            f"remote_serde: {serde!r} is a lossy KV encoding and would change outputs; "
            "use remote_serde: naive (lmi-cache compresses remote values losslessly instead)"
        )
    raise ConfigError(f"remote_serde: unknown value {serde!r}; use naive")
