"""S3 (or S3-compatible) remote store over boto3 (vLLM worker process).

Objects live at ``<url prefix>/<key prefix>/v1/<digest hex>``: the hex right
after fixed parts spreads keys over S3's request-rate partitions. A batch runs
its HEAD/GET/PUT requests in parallel on a bounded thread pool. Credentials
and region come from boto3's standard chain (``s3_region`` and
``s3_endpoint_url`` override); botocore's retries are off (``RemoteCache``
backs off instead) and every request has connect and read timeouts. Expiry is
the bucket's business (an S3 lifecycle rule), not a per-object setting.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from lmi_cache.errors import ConfigError
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.store import RemoteStore, StoreError
from lmi_cache.remote.value_codec import KEY_VERSION
from lmi_cache.thread_affinity import unpin_current_thread

logger = logging.getLogger(__name__)
T = TypeVar("T")
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}


def _import_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise ConfigError("remote_url is an s3:// URL but boto3 is missing; pip install 'lmi-cache[remote]'") from None
    return boto3


class S3Store(RemoteStore):
    name = "s3"

    def __init__(self, settings: RemoteSettings) -> None:
        super().__init__(settings.key_prefix)
        boto3 = _import_boto3()
        from botocore.config import Config

        self.bucket, self._prefix = settings.remote_url.s3_location()
        if settings.ttl_s:
            logger.warning("remote ttl_s=%d has no effect on S3: expire objects with a lifecycle rule on "
                           "bucket %s instead", settings.ttl_s, self.bucket)
        workers = settings.max_workers
        session = boto3.session.Session()

        def client(timeout_s: float) -> Any:
            config = Config(
                connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=workers,
                retries={"mode": "standard", "total_max_attempts": 1},
                # values carry their own checksum (and MAC): skip botocore's extra CRC pass over every body
                request_checksum_calculation="when_required", response_checksum_validation="when_required",
            )
            return session.client(
                "s3", region_name=settings.s3_region, endpoint_url=settings.s3_endpoint_url, config=config
            )

        self._lookup_client = client(settings.lookup_timeout_ms / 1000)
        self._io_client = client(settings.io_timeout_ms / 1000)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmi-cache-s3",
                                        initializer=unpin_current_thread)

    def name_for(self, digest: bytes) -> str:
        parts = [p for p in (self._prefix, self.key_prefix, KEY_VERSION, digest.hex()) if p]
        return "/".join(parts)

    def _parallel(self, op: str, fn: Callable[[str], T], names: Sequence[str]) -> list[T]:
        try:
            return list(self._pool.map(fn, names))
        except StoreError:
            raise
        except Exception as err:
            raise _error(op, err) from None

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        def head(key: str) -> bool:
            try:
                self._lookup_client.head_object(Bucket=self.bucket, Key=key)
                return True
            except Exception as err:
                if _is_missing(err):
                    return False
                raise _error("head", err) from None

        return self._parallel("head", head, names)

    def fetch_many(self, names: Sequence[str]) -> list[bytes | None]:
        def get(key: str) -> bytes | None:
            try:
                body: bytes = self._io_client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                return body
            except Exception as err:
                if _is_missing(err):
                    return None
                raise _error("get", err) from None

        return self._parallel("get", get, names)

    def upload_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        def put(item: tuple[str, bytes]) -> None:
            try:
                self._io_client.put_object(Bucket=self.bucket, Key=item[0], Body=item[1])
            except Exception as err:
                raise _error("put", err) from None

        try:
            list(self._pool.map(put, items))
        except StoreError:
            raise
        except Exception as err:
            raise _error("put", err) from None

    def ping(self) -> None:
        try:
            self._lookup_client.head_bucket(Bucket=self.bucket)
        except Exception as err:
            raise _error("ping", err) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _is_missing(err: Exception) -> bool:
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return False
    return str(response.get("Error", {}).get("Code", "")) in _MISSING_CODES


def _error(op: str, err: Exception) -> StoreError:
    timeout = "timeout" in type(err).__name__.lower() or "timed out" in str(err).lower()
    return StoreError(f"s3 {op} failed ({type(err).__name__}: {err})", timeout=timeout)
