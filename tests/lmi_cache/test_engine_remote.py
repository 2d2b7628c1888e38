"""The engine with a remote tier behind CPU (and disk), against a real redis-server and moto S3.

Two engines stand for two servers of a fleet: what one stores, the other
loads (verified, promoted into its CPU tier, reported to the scheduler's
index); damaged values, a store that is down and a full queue are misses,
never errors or wrong bytes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from remote_fixtures import BUCKET, moto_s3, redis_server  # noqa: E402,F401

from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys  # noqa: E402
from lmi_cache.config.cache_config import CacheConfig, config_from_dict  # noqa: E402
from lmi_cache.engine import CacheEngine  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer, free_port  # noqa: E402
from engine_verbs import held_by, load, save  # noqa: E402

CHUNK = 16
SHAPE = (2, CHUNK, 4, 8)  # per chunk: K/V x tokens x heads x head size


def fleet_config(url: str, prefix: str, **fields: Any) -> CacheConfig:
    extra = {"remote_key_prefix": prefix, **fields.pop("extra", {})}
    config, warnings = config_from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.01, "remote_url": url,
                                         "lookup_timeout_ms": 500, "extra_config": extra, **fields}, "fleet.yaml")
    assert warnings == []
    return config


def keys_and_data(num: int, seed: int = 0) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 30000, size=num * CHUNK)
    engine_keys = chunk_keys(tokens, KeyNamespace("m", "bfloat16", "test-v1"), CHUNK)
    data = [torch.from_numpy(rng.normal(size=SHAPE).astype(np.float32)).to(torch.bfloat16) for _ in range(num)]
    return engine_keys, data


def test_a_second_engine_loads_what_the_first_stored(redis_server: RedisServer) -> None:
    keys, data = keys_and_data(4)
    with CacheEngine(fleet_config(redis_server.url, "two-engines")) as first:
        assert all(save(first, k, d) for k, d in zip(keys, data))
        first.flush(10.0)
        assert first.stats()["remote_puts_stored"] == 4
    with CacheEngine(fleet_config(redis_server.url, "two-engines")) as second:
        assert held_by(second, keys[0]) is None  # its own tiers are empty
        batches = list(second.load(keys, ["remote"] * len(keys), [True] * len(keys)))  # promoted, as planned
        assert len(batches) == 1 and len(batches[0]) == 4  # one batched GET for the whole step
        for (position, obj), expected in zip(batches[0], data):
            assert torch.equal(obj.payload_tensor(), data[position])
            obj.release()
        assert held_by(second, keys[0]) == "cpu"  # promoted (by reference)
        stored, _ = second.drain_events()
        assert {(e.tier, e.digest) for e in stored} == {("cpu", k.digest) for k in keys}  # the directory learns them
        stats = second.stats()
        assert stats["redis_loaded_tokens"] == 4 * CHUNK and stats["redis_loads"] == 4  # tier label "redis"
        assert stats["remote_get_hits"] == 4
        assert "cpu_loaded_tokens" not in stats


def test_without_local_tiers_the_remote_store_serves_alone(redis_server: RedisServer) -> None:
    keys, data = keys_and_data(2, seed=1)
    config = fleet_config(redis_server.url, "remote-only", local_cpu=False)
    with CacheEngine(config) as first:
        assert save(first, keys[0], data[0]) and save(first, keys[1], data[1])
        assert first.drain_events() == ([], [])  # nothing local: the scheduler's local index is not told
        first.flush(10.0)
    with CacheEngine(config) as second:
        got = load(second, keys[1])
        assert got is not None and torch.equal(got, data[1])


def test_damaged_and_foreign_values_are_misses(redis_server: RedisServer) -> None:
    import redis

    keys, data = keys_and_data(3, seed=2)
    with CacheEngine(fleet_config(redis_server.url, "damaged")) as first:
        for key, value in zip(keys, data):
            save(first, key, value)
        first.flush(10.0)
    client = redis.Redis.from_url(redis_server.url)
    names = sorted(n for n in client.keys("damaged:*"))
    assert len(names) == 3
    value = bytearray(client.get(names[0]) or b"")
    value[-1] ^= 0xFF
    client.set(names[0], bytes(value))  # one flipped bit
    client.set(names[1], b"not a chunk at all")  # another program's value
    client.set(names[2], client.get(names[2])[:100])  # type: ignore[index]  # truncated
    with CacheEngine(fleet_config(redis_server.url, "damaged")) as second:
        assert list(second.load(keys, ["remote"] * len(keys))) == []
        refused = sum(v for k, v in second.stats().items() if k.startswith("remote_miss_"))
        assert refused == 3  # each value was fetched once, in one batch
        assert held_by(second, keys[0]) is None  # nothing damaged was promoted
        assert second.stats()["remote_miss_corrupted"] + second.stats().get("remote_miss_truncated", 0) >= 1


def test_a_store_that_is_down_costs_misses_not_requests() -> None:
    keys, data = keys_and_data(2, seed=3)
    config = fleet_config(f"redis://127.0.0.1:{free_port()}", "down", extra={"remote_io_timeout_ms": 300})
    with CacheEngine(config) as engine:
        assert save(engine, keys[0], data[0])  # the CPU tier still takes it
        started = time.perf_counter()
        assert load(engine, keys[1]) is None
        assert list(engine.load(keys[1:], ["remote"])) == []
        assert time.perf_counter() - started < 2.0
        got = load(engine, keys[0])
        assert got is not None and torch.equal(got, data[0])


def test_s3_store_round_trip(moto_s3: str) -> None:
    keys, data = keys_and_data(2, seed=4)
    config = fleet_config(f"s3://{BUCKET}/engine", "s3-engine", lookup_timeout_ms=3000,
                          extra={"s3_endpoint_url": moto_s3, "s3_region": "us-east-1",
                                 "remote_io_timeout_ms": 5000, "remote_compression": "zstd-planes"})
    with CacheEngine(config) as first:
        for key, value in zip(keys, data):
            save(first, key, value)
        first.flush(10.0)
    with CacheEngine(config) as second:
        for key, expected in zip(keys, data):
            got = load(second, key)
            assert got is not None and torch.equal(got, expected)


def test_config_refuses_a_lossy_serde_and_a_bad_store_url() -> None:
    from lmi_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="remote_serde.*lossy"):
        config_from_dict({"remote_url": "redis://cache:6379", "remote_serde": "cachegen"}, "c.yaml")
    with pytest.raises(ConfigError, match="c.yaml: key 'remote_url': remote_url 's3://' needs a bucket"):
        config_from_dict({"remote_url": "s3://"}, "c.yaml")
    with pytest.raises(ConfigError, match="extra_config.remote_compression"):
        config_from_dict({"remote_url": "redis://cache:6379", "extra_config": {"remote_compression": "lz9"}}, "c.yaml")
    config, _ = config_from_dict({"remote_url": "valkeys://cache:6380", "lookup_timeout_ms": 20,
                                  "extra_config": {"remote_ttl_s": 3600, "remote_cluster": "true"}}, "c.yaml")
    from lmi_cache.config.remote import remote_settings

    settings = remote_settings(config)
    assert settings is not None and settings.lookup_timeout_ms == 20 and settings.ttl_s == 3600 and settings.cluster


@pytest.mark.parametrize("compression", ["off", "zstd-planes"])
def test_a_remote_hit_is_received_into_the_object_it_becomes(redis_server: RedisServer, compression: str) -> None:
    """Uncompressed values land in the host buffer that becomes the chunk object (one allocation, no
    copy after the socket); compressed ones are decompressed into a new object and their receive
    buffer goes back to the pool."""
    keys, data = keys_and_data(3, seed=7)
    config = fleet_config(redis_server.url, f"in-place-{compression}", extra={"remote_compression": compression})
    with CacheEngine(config) as first:
        assert all(save(first, k, d) for k, d in zip(keys, data))
        first.flush(10.0)
    with CacheEngine(config) as second:
        allocator = second.allocator
        given: list[int] = []
        allocate = allocator.allocate

        def counting(num_bytes: int) -> torch.Tensor | None:
            buffer = allocate(num_bytes)
            if buffer is not None:
                given.append(buffer.data_ptr())
            return buffer

        allocator.allocate = counting  # type: ignore[method-assign]
        pooled_before = allocator.pooled_bytes
        (batch,) = list(second.load(keys, ["remote"] * len(keys)))
        assert sorted(position for position, _ in batch) == [0, 1, 2]
        for position, obj in batch:
            assert torch.equal(obj.payload_tensor(), data[position])
        if compression == "off":
            assert len(given) == 3 and {obj.buffer.data_ptr() for _, obj in batch} == set(given)
        else:
            assert len(given) == 6  # a receive buffer, then an object, per value
            assert allocator.pooled_bytes > pooled_before  # receive buffers went back to the pool
        for _, obj in batch:
            obj.release()


def test_the_directory_names_the_shared_store_remote_whatever_backs_it(redis_server: RedisServer) -> None:
    """Instructions say "remote" for the shared store; the tier itself is labelled "redis" in metrics."""
    keys, data = keys_and_data(2, seed=3)
    fill = lambda key_data: (lambda outs: outs[0].copy_(key_data))  # noqa: E731
    with CacheEngine(fleet_config(redis_server.url, "directed")) as first:
        assert first.save_many([keys[0]], SHAPE, torch.bfloat16, fill(data[0]), [("remote",)]) == [True]
        assert first.save_many([keys[1]], SHAPE, torch.bfloat16, fill(data[1]), [("cpu",)]) == [True]
        first.flush(10.0)
        assert first.stats()["remote_puts_stored"] == 1 and held_by(first, keys[0]) is None  # only where told
    with CacheEngine(fleet_config(redis_server.url, "directed")) as second:
        got = [item for batch in second.load(keys, ["remote", "remote"], [False, False]) for item in batch]
        assert [position for position, _ in got] == [0]  # keys[1] never reached the store
        assert torch.equal(got[0][1].payload_tensor(), data[0]) and held_by(second, keys[0]) is None  # not promoted
        got[0][1].release()
