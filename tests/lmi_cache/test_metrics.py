"""Tests for lmi_cache.metrics: Prometheus series of one engine, rate-limited warnings."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from lmi_cache.chunk_hashing import KeyNamespace
from lmi_cache.config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner

NS = KeyNamespace("m", "float32", "v1")


def sample(metrics: CacheMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"rank": metrics.rank_label, **labels})


def test_engine_updates_series(tmp_path: Path) -> None:
    config = CacheConfig(chunk_size=4, max_local_cpu_size=2 * 4096 / 1024**3, local_disk=(str(tmp_path),),
                         max_local_disk_size=1 / 1024)
    metrics = CacheMetrics(rank_label="3")
    with CacheEngine(config, metrics=metrics) as engine:
        keys = engine.keys_for(list(range(16)), NS)
        for key in keys:
            engine.store(key, torch.ones(4, 8))
            engine.flush()  # written through: the CPU entry is no longer pinned, so it can be evicted
        assert engine.lookup(keys) == 16
        assert engine.retrieve(keys[0]) is not None  # evicted from CPU: a disk load
    assert sample(metrics, "lmi_cache_lookups_total") == 1
    assert sample(metrics, "lmi_cache_requested_tokens_total") == 16
    assert sample(metrics, "lmi_cache_hit_tokens_total", tier="cpu") == 8
    assert sample(metrics, "lmi_cache_hit_tokens_total", tier="disk") == 8
    assert sample(metrics, "lmi_cache_stored_chunks_total", tier="cpu") == 5  # 4 + the promotion
    assert sample(metrics, "lmi_cache_stored_tokens_total", tier="disk") == 16
    assert sample(metrics, "lmi_cache_evictions_total", tier="cpu") == 3
    assert sample(metrics, "lmi_cache_tier_usage_bytes", tier="cpu") == 2 * 4096
    assert sample(metrics, "lmi_cache_tier_capacity_bytes", tier="disk") == 1024**2
    assert sample(metrics, "lmi_cache_load_seconds_count", tier="disk") == 1
    assert sample(metrics, "lmi_cache_store_seconds_count", tier="disk") == 4
    text = generate_latest(metrics.registry).decode()
    assert 'lmi_cache_stored_bytes_total{rank="3",tier="disk"}' in text


def test_registries_are_separate() -> None:
    first, second = CacheMetrics(), CacheMetrics()
    first.dropped("cpu", "full")
    assert sample(first, "lmi_cache_dropped_stores_total", tier="cpu", reason="full") == 1
    assert sample(second, "lmi_cache_dropped_stores_total", tier="cpu", reason="full") is None
    assert first.snapshot()["cpu_dropped_full"] == 1 and "cpu_dropped_full" not in second.snapshot()


def test_rate_limited_warner(caplog: pytest.LogCaptureFixture) -> None:
    warner = RateLimitedWarner(logging.getLogger("t"), interval_s=60)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            warner.warn("disk-EIO", "disk read failed")
        warner.warn("other", "another kind")
    assert [r.message for r in caplog.records] == ["disk read failed", "another kind"]
    fast = RateLimitedWarner(logging.getLogger("t"), interval_s=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fast.warn("k", "a")
        fast.warn("k", "b")
    assert len(caplog.records) == 2
