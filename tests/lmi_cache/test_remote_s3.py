"""RemoteCache over S3 (a moto server on loopback): round trips, key layout, damaged values, MAC, faults."""
from __future__ import annotations

import logging
import time

import boto3
import pytest
from remote_fixtures import BUCKET, make_keys, make_object, moto_s3, payload_of  # noqa: F401

from lmi_cache.remote import RemoteSettings, open_remote
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.remote.value_codec import DecodedChunk, MissReason


def open_s3(endpoint: str, prefix: str, secret: bytes | None = None, **overrides: object) -> RemoteCache:
    options: dict[str, object] = dict(lookup_timeout_ms=2000, io_timeout_ms=2000, s3_endpoint_url=endpoint,
                                      s3_region="us-east-1", max_workers=8, backoff_initial_s=0.2)
    options.update(overrides)
    return open_remote(RemoteSettings(f"s3://{BUCKET}/{prefix}", **options), secret=secret)  # type: ignore[arg-type]


def fill(cache: RemoteCache, num: int, seed: int = 0) -> tuple[list, list[bytes]]:
    keys = make_keys(num, seed=seed)
    objs = [make_object(k, 4096, seed=i) for i, k in enumerate(keys)]
    for key, obj in zip(keys, objs):
        assert cache.write(key, obj)
    assert cache.flush(20)
    return keys, objs


def test_round_trip_batch_and_layout(moto_s3: str) -> None:
    cache = open_s3(moto_s3, "fleet/a", compression="zstd-planes")
    try:
        keys, objs = fill(cache, 10)
        missing = make_keys(2, seed=42)
        assert cache.has_many(keys + missing) == [True] * 10 + [False] * 2
        results = cache.read_many(keys + missing)
        assert [bytes(r.payload) for r in results[:10] if isinstance(r, DecodedChunk)] == [payload_of(o) for o in objs]
        assert results[10:] == [MissReason.NOT_FOUND] * 2
        s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
        names = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="fleet/a/")["Contents"]]
        assert sorted(names) == sorted(f"fleet/a/lmi-cache/v1/{k.hex}" for k in keys)
    finally:
        cache.close()


def test_damaged_values_and_mac(moto_s3: str) -> None:
    secret = b"s3-fleet-secret-0123456789"
    cache = open_s3(moto_s3, "mac", secret=secret)
    intruder = open_s3(moto_s3, "mac", secret=b"some-other-secret-of-16+")
    try:
        keys, objs = fill(cache, 3)
        s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
        name = cache.store.name_for(keys[0].digest)
        value = s3.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=name, Body=value[:-1] + bytes([value[-1] ^ 1]))
        s3.put_object(Bucket=BUCKET, Key=cache.store.name_for(keys[1].digest), Body=b"not ours")
        results = cache.read_many(keys)
        assert results[:2] == [MissReason.MAC_INVALID, MissReason.FOREIGN]
        assert isinstance(results[2], DecodedChunk) and bytes(results[2].payload) == payload_of(objs[2])
        assert intruder.read_many(keys[2:]) == [MissReason.MAC_INVALID]
    finally:
        cache.close()
        intruder.close()


def test_endpoint_down_is_a_bounded_miss(moto_s3: str, caplog: pytest.LogCaptureFixture) -> None:
    """A second moto server, stopped: requests are signed (moto_s3 set credentials) and reach a closed port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server.stop()  # the port this test owned now has nothing behind it
    # 1.5 s, not less: a refused connect is immediate, but boto3's own work before it can take over 300 ms on a
    # loaded CI machine, and then the warning names a timeout instead of the refused connection checked below.
    cache = open_s3(f"http://{host}:{port}", "down", lookup_timeout_ms=1500, io_timeout_ms=1500)
    keys = make_keys(4)
    try:
        with caplog.at_level(logging.WARNING):
            started = time.monotonic()
            assert cache.has_many(keys) == [False] * 4
            assert all(isinstance(r, MissReason) for r in cache.read_many(keys))
            assert time.monotonic() - started < 4.0  # one lookup and one read, each within its 1.5 s
        assert sum("is not answering" in r.message for r in caplog.records) == 1
        assert "Could not connect" in caplog.text or "Connect" in caplog.text  # the network path, not credentials
        assert cache.ping(timeout_s=1.0) is not None
    finally:
        cache.close()


def test_missing_bucket_reported_by_ping(moto_s3: str) -> None:
    cache = open_remote(RemoteSettings("s3://no-such-bucket/x", s3_endpoint_url=moto_s3, s3_region="us-east-1"))
    try:
        assert "did not answer" in (cache.ping() or "")
    finally:
        cache.close()
