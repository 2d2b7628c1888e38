"""RemoteCache over a real redis-server: round trips, batching, TTL, eviction, damaged values, MAC, credentials."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import redis
from remote_fixtures import (  # noqa: F401
    make_keys,
    make_object,
    make_tls_files,
    own_redis,
    payload_of,
    redis_server,
    redis_settings,
)

from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.remote import open_remote
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.devtools.redis_server import RedisServer
from lmi_cache.remote.value_codec import DecodedChunk, MissReason

SECRET = b"fleet-secret-0123456789"


def fill(cache: RemoteCache, num: int, size: int = 4096, seed: int = 0) -> tuple[list, list[bytes]]:
    keys = make_keys(num, seed=seed)
    objs = [make_object(k, size, seed=i) for i, k in enumerate(keys)]
    for key, obj in zip(keys, objs):
        assert cache.write(key, obj)
    assert cache.flush(10)
    return keys, objs


def payloads(results: list) -> list[bytes | None]:
    return [bytes(r.payload) if isinstance(r, DecodedChunk) else None for r in results]


@pytest.mark.parametrize("compression", ["off", "zstd-planes"])
def test_round_trip_and_batching(redis_server: RedisServer, compression: str) -> None:
    metrics = CacheMetrics()
    cache = open_remote(redis_settings(redis_server.url, f"rt-{compression}", compression=compression),
                        secret=SECRET, metrics=metrics)
    try:
        keys, objs = fill(cache, 12)
        client = redis.Redis.from_url(redis_server.url)
        client.config_resetstat()
        assert cache.has_many(keys) == [True] * 12
        other = make_keys(3, seed=99)
        assert cache.has_many(other) == [False] * 3
        results = cache.read_many(keys + other)
        assert payloads(results) == [payload_of(o) for o in objs] + [None] * 3
        assert results[-1] == MissReason.NOT_FOUND
        stats = client.info("commandstats")
        # One key first (the value size is not known yet), then the rest in one MGET of under 8 MiB.
        assert stats["cmdstat_mget"]["calls"] == 2
        assert stats["cmdstat_exists"]["calls"] == 15  # pipelined: one EXISTS per key
        assert cache.stats()["puts_stored"] == 12 and cache.stats()["get_hits"] == 12
        assert metrics.snapshot()["redis_stored_chunks"] == 12
        raw_key = client.keys(f"rt-{compression}:*")[0]
        stored_key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        assert stored_key.startswith(f"rt-{compression}:v1:") and len(stored_key.rsplit(":", 1)[1]) == 32
    finally:
        cache.close()


def test_deployments_with_other_prefixes_do_not_meet(redis_server: RedisServer) -> None:
    a = open_remote(redis_settings(redis_server.url, "deploy-a"))
    b = open_remote(redis_settings(redis_server.url, "deploy-b"))
    try:
        keys, _ = fill(a, 2)
        assert b.has_many(keys) == [False, False]
    finally:
        a.close()
        b.close()


def test_ttl_expires_values(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "ttl", ttl_s=1))
    try:
        keys, _ = fill(cache, 2)
        client = redis.Redis.from_url(redis_server.url)
        pttl = client.pttl(cache.store.name_for(keys[0].digest))
        assert pttl == -2 or 0 < pttl <= 1000  # -1 would be a key without expiry; -2: already expired (slow host)
        deadline = time.monotonic() + 5
        while cache.has_many(keys) != [False, False]:
            assert time.monotonic() < deadline, "values did not expire"
            time.sleep(0.1)
        assert cache.read_many(keys) == [MissReason.NOT_FOUND] * 2
    finally:
        cache.close()


def test_store_side_lru_eviction_is_a_miss_not_an_error() -> None:
    with RedisServer(extra_args=["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"]) as server:
        # Generous timeouts: this is about eviction, and a loaded host must not turn reads into timeout misses.
        cache = open_remote(redis_settings(server.url, "lru", lookup_timeout_ms=10_000, io_timeout_ms=20_000))
        try:
            keys, objs = fill(cache, 60, size=64 << 10)  # ~4 MB into a 3 MB store
            present = cache.has_many(keys)
            assert 0 < sum(present) < len(keys)
            results = cache.read_many(keys)
            # The store may still evict while it serves the read (its evicted_keys can grow during the MGETs),
            # so a value present at the lookup may be gone by the read: that too must be a plain miss.
            for result, obj, here in zip(results, objs, present):
                if here and isinstance(result, DecodedChunk):
                    assert bytes(result.payload) == payload_of(obj)
                else:
                    assert result == MissReason.NOT_FOUND
            assert any(isinstance(result, DecodedChunk) for result in results)
            stats = cache.stats()
            assert stats["puts_stored"] == 60 and "put_errors" not in stats
        finally:
            cache.close()


def test_damaged_and_foreign_values_are_misses(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    metrics = CacheMetrics()
    cache = open_remote(redis_settings(redis_server.url, "damage"), metrics=metrics)
    try:
        keys, objs = fill(cache, 4)
        client = redis.Redis.from_url(redis_server.url)
        names = [cache.store.name_for(k.digest) for k in keys]
        value = client.get(names[0])
        assert isinstance(value, bytes)
        client.set(names[0], value[:-7])  # truncated
        flipped = bytearray(value)
        flipped[-3] ^= 0xFF
        client.set(names[1], bytes(flipped))  # corrupted payload
        client.set(names[2], b"a value some other program wrote")  # foreign
        with caplog.at_level(logging.WARNING):
            results = cache.read_many(keys)
        assert results[:3] == [MissReason.TRUNCATED, MissReason.CORRUPTED, MissReason.FOREIGN]
        assert payloads(results)[3] == payload_of(objs[3])
        assert metrics.snapshot()["redis_corrupted_reads"] == 2
        assert any("refused" in r.message for r in caplog.records)
    finally:
        cache.close()


def test_mac_between_fleet_members(redis_server: RedisServer) -> None:
    """A signing fleet accepts its own values, refuses unsigned or foreign-signed ones."""
    signer = open_remote(redis_settings(redis_server.url, "mac"), secret=SECRET)
    intruder = open_remote(redis_settings(redis_server.url, "mac"), secret=b"not-the-fleet-secret-at-all")
    unsigned = open_remote(redis_settings(redis_server.url, "mac"), secret=None)
    try:
        keys, objs = fill(signer, 1)
        assert payloads(signer.read_many(keys)) == [payload_of(objs[0])]
        assert intruder.read_many(keys) == [MissReason.MAC_INVALID]
        assert payloads(unsigned.read_many(keys)) == [payload_of(objs[0])]  # no secret: checksum-verified only
        forged_keys, _ = fill(unsigned, 1, seed=5)  # a writer without the secret
        assert signer.read_many(forged_keys) == [MissReason.MAC_MISSING]
    finally:
        for cache in (signer, intruder, unsigned):
            cache.close()


def test_credentials_from_url_and_env_never_logged(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    password = "pw-7Hq2-never-print-me"
    with RedisServer(password=password) as server:
        cache = open_remote(redis_settings(server.url, "auth"))
        keys, _ = fill(cache, 1)
        assert cache.has_many(keys) == [True]
        cache.close()
        monkeypatch.setenv("LMI_CACHE_REMOTE_PASSWORD", password)
        from_env = open_remote(redis_settings(f"redis://127.0.0.1:{server.port}", "auth"))
        assert from_env.has_many(keys) == [True]
        from_env.close()
        monkeypatch.delenv("LMI_CACHE_REMOTE_PASSWORD")
        wrong = open_remote(redis_settings(f"redis://admin:{password}x@127.0.0.1:{server.port}", "auth"))
        with caplog.at_level(logging.DEBUG):
            assert wrong.has_many(keys) == [False]
            assert wrong.ping() is not None
            assert password not in (wrong.ping() or "")
        wrong.close()
    assert password not in caplog.text and "***@" in caplog.text


def test_unix_socket_and_valkey_scheme() -> None:
    with RedisServer(unix_socket=True) as server:
        for seed, url in enumerate((f"unix://{server.unix_path}", f"valkey://127.0.0.1:{server.port}")):
            cache = open_remote(redis_settings(url, "schemes"))
            try:
                keys, objs = fill(cache, 2, seed=seed)
                assert payloads(cache.read_many(keys)) == [payload_of(o) for o in objs]
                assert cache.ping() is None
            finally:
                cache.close()


def test_large_batch_is_decoded_in_parallel_and_still_verified(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "parallel", compression="zstd-planes", io_timeout_ms=5000),
                        secret=SECRET)
    try:
        keys, objs = fill(cache, 4, size=3 << 20)  # 12 MiB: above the parallel-decode threshold
        client = redis.Redis.from_url(redis_server.url)
        name = cache.store.name_for(keys[1].digest)
        value = client.get(name)
        assert isinstance(value, bytes)
        client.set(name, value[:-1] + bytes([value[-1] ^ 1]))
        results = cache.read_many(keys)
        assert results[1] == MissReason.MAC_INVALID
        assert payloads(results)[:1] + payloads(results)[2:] == [payload_of(o) for o in objs[:1] + objs[2:]]
        assert any(t.name.startswith("lmi-cache-remote-decode") for t in threading.enumerate())
    finally:
        cache.close()


def test_large_values_come_in_mgets_of_about_8_mib(redis_server: RedisServer) -> None:
    """redis-server sends a reply of tens of MiB far slower than several smaller ones."""
    from lmi_cache.remote.redis_store import MGET_REPLY_BYTES

    cache = open_remote(redis_settings(redis_server.url, "mget-size", io_timeout_ms=10000))
    try:
        keys, objs = fill(cache, 9, size=3 << 20)
        missing = make_keys(2, seed=77)
        client = redis.Redis.from_url(redis_server.url)
        client.config_resetstat()
        batch = keys[:4] + missing[:1] + keys[4:] + missing[1:]
        results = cache.read_many(batch)
        expected = [payload_of(o) for o in objs]
        assert payloads(results) == expected[:4] + [None] + expected[4:] + [None]
        per_mget = MGET_REPLY_BYTES // (3 << 20)
        assert per_mget == 2
        # 1 key, then 10 more in MGETs of 2; a second batch knows the size from the start.
        assert client.info("commandstats")["cmdstat_mget"]["calls"] == 1 + 5
        assert payloads(cache.read_many(keys[:4])) == expected[:4]
        assert client.info("commandstats")["cmdstat_mget"]["calls"] == 6 + 2
    finally:
        cache.close()


def test_tls_verifies_the_server_certificate(tmp_path: Path) -> None:
    cert, key, ca = make_tls_files(str(tmp_path))
    with RedisServer(tls_files=(cert, key, ca)) as server:
        trusted = open_remote(redis_settings(f"rediss://127.0.0.1:{server.tls_port}?ssl_ca_certs={ca}", "tls"))
        untrusted = open_remote(redis_settings(f"valkeys://127.0.0.1:{server.tls_port}", "tls"))
        try:
            keys, objs = fill(trusted, 2)
            assert payloads(trusted.read_many(keys)) == [payload_of(o) for o in objs]
            assert "CERTIFICATE_VERIFY_FAILED" in (untrusted.ping() or "")  # an unknown CA is refused
            assert untrusted.has_many(keys) == [False, False]
        finally:
            trusted.close()
            untrusted.close()


def test_write_of_a_mismatched_object_is_dropped_not_stored(redis_server: RedisServer) -> None:
    cache = open_remote(redis_settings(redis_server.url, "mismatch"))
    try:
        keys = make_keys(2)
        assert cache.write(keys[1], make_object(keys[0]))  # queued: the writer checks it off the serving path
        assert cache.flush(5)
        assert cache.stats()["puts_dropped_error"] == 1 and cache.has_many(keys[1:]) == [False]
    finally:
        cache.close()
