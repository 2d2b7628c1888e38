"""Redis faults: down at start, killed mid-run, hung (SIGSTOP), restarted, a full put queue.

Every call must come back within its timeout (plus scheduling slack) as a miss
or a dropped put, with one warning per outage, and the client must find the
store again after it returns. Bounds are generous: they catch hangs, not speed.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

import pytest
from remote_fixtures import make_keys, make_object, own_redis, payload_of, redis_settings  # noqa: F401

from lmi_cache.remote import open_remote, probe_remote
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.devtools.redis_server import RedisServer
from lmi_cache.remote.value_codec import DecodedChunk, MissReason

T = TypeVar("T")
LOOKUP_MS, IO_MS = 200, 500
SLACK_S = 1.0
KEYS = make_keys(6)
OBJS = [make_object(k, 8192, seed=i) for i, k in enumerate(KEYS)]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def open_cache(server: RedisServer, **overrides: object) -> RemoteCache:
    return open_remote(redis_settings(server.url, "faults", lookup_timeout_ms=LOOKUP_MS, io_timeout_ms=IO_MS,
                                      **overrides))


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def fill(cache: RemoteCache) -> None:
    for key, obj in zip(KEYS, OBJS):
        assert cache.write(key, obj)
    assert cache.flush(10)


def assert_all_hits(cache: RemoteCache) -> None:
    results = cache.read_many(KEYS)
    assert [bytes(r.payload) for r in results if isinstance(r, DecodedChunk)] == [payload_of(o) for o in OBJS]


def test_down_at_start_then_comes_up(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    own_redis.kill()  # nothing listens on the port this test owns
    cache = open_cache(own_redis)
    try:
        with caplog.at_level(logging.WARNING):
            found, seconds = timed(lambda: cache.has_many(KEYS))
            assert found == [False] * 6 and seconds < LOOKUP_MS / 1000 + SLACK_S
            assert cache.read_many(KEYS) == [MissReason.UNAVAILABLE] * 6  # backing off: not even tried
            assert not cache.write(KEYS[0], OBJS[0])
        assert sum("is not answering" in r.message for r in caplog.records) == 1
        assert cache.stats()["puts_dropped_unavailable"] == 1
        own_redis.start()
        assert wait_until(lambda: cache.has_many(KEYS[:1]) == [False] and cache.stats()["down"] == 0)
        fill(cache)
        assert_all_hits(cache)
        assert cache.stats()["reconnects"] >= 1
    finally:
        cache.close()


def test_killed_mid_run_then_restarted(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    cache = open_cache(own_redis)
    try:
        fill(cache)
        assert_all_hits(cache)
        own_redis.kill()
        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                results, seconds = timed(lambda: cache.read_many(KEYS))
                assert all(isinstance(r, MissReason) for r in results) and seconds < IO_MS / 1000 + SLACK_S
                found, seconds = timed(lambda: cache.has_many(KEYS))
                assert found == [False] * 6 and seconds < LOOKUP_MS / 1000 + SLACK_S
                cache.write(KEYS[0], OBJS[0])
        assert sum("is not answering" in r.message for r in caplog.records) == 1
        own_redis.start()  # same port, empty (no persistence)
        assert wait_until(lambda: cache.read_many(KEYS[:1]) == [MissReason.NOT_FOUND])
        fill(cache)
        assert_all_hits(cache)
    finally:
        cache.close()


def test_hung_server_sigstop(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    cache = open_cache(own_redis)
    try:
        fill(cache)
        own_redis.pause()
        with caplog.at_level(logging.WARNING):
            found, seconds = timed(lambda: cache.has_many(KEYS))
            assert found == [False] * 6 and seconds < LOOKUP_MS / 1000 + SLACK_S
            for _ in range(10):
                results, seconds = timed(lambda: cache.read_many(KEYS))
                assert all(isinstance(r, MissReason) for r in results) and seconds < IO_MS / 1000 + SLACK_S
                _, seconds = timed(lambda: cache.write(KEYS[0], OBJS[0]))
                assert seconds < 0.5  # never waits on the network
        assert sum("is not answering" in r.message for r in caplog.records) == 1
        own_redis.resume()
        assert wait_until(lambda: cache.has_many(KEYS) == [True] * 6)
        assert_all_hits(cache)
        stats = cache.stats()
        assert stats["lookup_timeouts"] >= 1 and stats["reconnects"] >= 1
    finally:
        own_redis.resume()
        cache.close()


def test_full_put_queue_drops_and_counts(own_redis: RedisServer) -> None:
    cache = open_cache(own_redis, put_queue_bytes=3 * len(OBJS[0]))
    try:
        own_redis.pause()  # the writer's first batch (at most 16 values) hangs until the I/O timeout
        keys = make_keys(40, seed=7)
        accepted = [cache.write(k, make_object(k, 8192)) for k in keys]
        assert accepted.count(False) >= 40 - 16 - 3  # beyond one in-flight batch and a 3-value queue
        assert cache.stats()["puts_dropped_queue_full"] == accepted.count(False)
        assert cache.flush(IO_MS / 1000 * 4 + SLACK_S)  # the queue empties (written or dropped) despite the hang
    finally:
        own_redis.resume()
        cache.close()


def test_close_never_hangs_on_a_hung_store(own_redis: RedisServer) -> None:
    cache = open_cache(own_redis)
    fill(cache)
    own_redis.pause()
    try:
        for key, obj in zip(KEYS, OBJS):
            cache.write(key, obj)
        threads_before = {t.name for t in threading.enumerate()}
        assert "lmi-cache-remote-writer" in threads_before
        _, seconds = timed(lambda: cache.close(flush_timeout_s=0.2))
        assert seconds < IO_MS / 1000 + 1.0 + SLACK_S
        assert cache.has_many(KEYS) == [False] * 6 and not cache.write(KEYS[0], OBJS[0])
        assert wait_until(lambda: "lmi-cache-remote-writer" not in {t.name for t in threading.enumerate()},
                          IO_MS / 1000 + SLACK_S)
    finally:
        own_redis.resume()


def test_probe_says_whether_the_store_answers(own_redis: RedisServer) -> None:
    settings = redis_settings(own_redis.url, "probe")
    assert probe_remote(settings, timeout_s=2.0) is None
    own_redis.pause()
    try:
        answer, seconds = timed(lambda: probe_remote(settings, timeout_s=0.3))
        assert answer is not None and "did not answer" in answer and seconds < 0.3 + SLACK_S
    finally:
        own_redis.resume()
    own_redis.kill()
    assert "did not answer" in (probe_remote(settings, timeout_s=1.0) or "")


def test_async_lookup_polls_without_blocking(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    cache = open_cache(own_redis)
    try:
        fill(cache)
        pending = cache.has_many_async(KEYS)
        assert wait_until(lambda: pending.poll() is not None)
        assert pending.poll() == [True] * 6
        own_redis.pause()
        with caplog.at_level(logging.WARNING):
            pending = cache.has_many_async(KEYS)
            started = time.monotonic()
            polls = 0
            while (found := pending.poll()) is None:
                polls += 1
                time.sleep(0.01)
            assert found == [False] * 6 and polls > 0  # "not yet" until the lookup timeout, then misses
            assert time.monotonic() - started < LOOKUP_MS / 1000 + SLACK_S
            _, seconds = timed(lambda: cache.has_many_async(KEYS).poll())
            assert seconds < 0.1  # backing off: answered at once
        assert sum("is not answering" in r.message for r in caplog.records) == 1
        assert cache.stats()["lookup_timeouts"] == 1
    finally:
        own_redis.resume()
        cache.close()
