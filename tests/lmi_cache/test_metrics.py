"""Tests for lmi_cache.metrics.scheduler_series and worker_series: the series of one engine and one scheduler, multiprocess aggregation, warnings."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from lmi_cache.keys.hashing import KeyNamespace
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from directed_engine import Directed  # noqa: E402
from engine_verbs import keys_for, load, lookup, save  # noqa: E402

NS = KeyNamespace("m", "float32", "v1")
REPO = Path(__file__).resolve().parents[2]


def sample(metrics: CacheMetrics, name: str, **labels: str) -> float | None:
    ids = {"engine": metrics.engine_label, "rank": metrics.rank_label}
    return metrics.registry.get_sample_value(name, {**ids, **labels})


def test_engine_updates_series(tmp_path: Path) -> None:
    config = CacheConfig(chunk_size=4, max_local_cpu_size=2 * 4096 / 1024**3, local_disk=(str(tmp_path),),
                         max_local_disk_size=1 / 1024)
    metrics = CacheMetrics(rank_label="3", engine_label="1")
    with Directed(config, 4 * 8 * 4, metrics=metrics) as d:
        engine = d.engine
        keys = keys_for(engine, list(range(16)), NS)
        for key in keys:
            d.save(key, torch.ones(4, 8))
            engine.flush()
        assert lookup(engine, keys) == 16
        assert d.load(keys[0]) is not None  # evicted from CPU by the directory: a disk load, promoted
        assert d.load(keys[3]) is not None  # still in CPU
        assert engine.stats()["disk_loaded_tokens"] == 4
        assert sample(metrics, "lmi_cache_tier_usage_bytes", tier="cpu") == 2 * 4096
    assert sample(metrics, "lmi_cache_tier_usage_bytes", tier="cpu") == 0  # closed: references given back
    assert sample(metrics, "lmi_cache_loaded_tokens_total", tier="disk") == 4
    assert sample(metrics, "lmi_cache_loaded_tokens_total", tier="cpu") == 4
    assert sample(metrics, "lmi_cache_stored_chunks_total", tier="cpu") == 5  # 4 + the promotion
    assert sample(metrics, "lmi_cache_stored_tokens_total", tier="disk") == 16
    assert sample(metrics, "lmi_cache_evictions_total", tier="cpu") == 3
    assert sample(metrics, "lmi_cache_tier_capacity_bytes", tier="disk") == 1024**2
    assert sample(metrics, "lmi_cache_load_seconds_count", tier="disk") == 1
    assert sample(metrics, "lmi_cache_store_seconds_count", tier="disk") == 4
    text = generate_latest(metrics.registry).decode()
    assert 'lmi_cache_stored_bytes_total{engine="1",rank="3",tier="disk"}' in text
    # The engine's own lookup is not a metric: under vLLM the scheduler counts lookups.
    assert "lmi_cache_lookups" not in text and "lmi_cache_hit_tokens" not in text


def test_scheduler_series() -> None:
    metrics = SchedulerMetrics(engine_label="2")
    metrics.lookup(1000, 768, 512)
    metrics.lookup(300, 0, 0)
    value = metrics.registry.get_sample_value
    assert value("lmi_cache_lookups_total", {"engine": "2"}) == 2
    assert value("lmi_cache_requested_tokens_total", {"engine": "2"}) == 1300
    assert value("lmi_cache_hit_tokens_total", {"engine": "2"}) == 768
    assert value("lmi_cache_load_tokens_total", {"engine": "2"}) == 512


def test_registries_are_separate() -> None:
    first, second = CacheMetrics(), CacheMetrics()
    first.dropped("cpu", "full")
    assert sample(first, "lmi_cache_dropped_stores_total", tier="cpu", reason="full") == 1
    assert sample(second, "lmi_cache_dropped_stores_total", tier="cpu", reason="full") is None
    assert first.snapshot()["cpu_dropped_full"] == 1 and "cpu_dropped_full" not in second.snapshot()


# One vLLM process each: a scheduler per data-parallel replica and a worker per (replica, rank).
_WRITER = """
import sys
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.metrics.worker_series import CacheMetrics
role, engine = sys.argv[1], sys.argv[2]
if role == "scheduler":
    SchedulerMetrics(engine_label=engine).lookup(100, 64, 32)
else:
    m = CacheMetrics(role, engine_label=engine)
    m.loaded_tokens("cpu", 10 + int(role))
    m.usage("cpu", 1000 + int(role), 4096)
    m.usage("cpu", 2000 + int(role), 4096)
    # stats() reads this process's values back, from the multiprocess files as well
    assert m.snapshot() == {"cpu_loaded_tokens": 10 + int(role), "cpu_usage_bytes": 2000 + int(role),
                            "cpu_capacity_bytes": 4096}, m.snapshot()
"""


def test_multiprocess_mode_keeps_processes_ranks_and_replicas_apart(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for role, engine in [("scheduler", "0"), ("scheduler", "1"), ("0", "0"), ("1", "0"), ("0", "1")]:
        subprocess.run([sys.executable, "-c", _WRITER, role, engine], env=env, check=True, timeout=60)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # what vLLM's /metrics does
    value = registry.get_sample_value
    for engine in ("0", "1"):
        assert value("lmi_cache_lookups_total", {"engine": engine}) == 1
        assert value("lmi_cache_hit_tokens_total", {"engine": engine}) == 64
    assert value("lmi_cache_loaded_tokens_total", {"engine": "0", "rank": "0", "tier": "cpu"}) == 10
    assert value("lmi_cache_loaded_tokens_total", {"engine": "0", "rank": "1", "tier": "cpu"}) == 11
    assert value("lmi_cache_loaded_tokens_total", {"engine": "1", "rank": "0", "tier": "cpu"}) == 10
    # Gauges: the last value each process set, one series per (engine, rank, tier), no pid label.
    assert value("lmi_cache_tier_usage_bytes", {"engine": "0", "rank": "1", "tier": "cpu"}) == 2001
    text = generate_latest(registry).decode()
    assert "pid=" not in text


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
