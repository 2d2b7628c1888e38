"""Each event is counted once: a rank's stats and ``CacheEngine.stats()`` read the Prometheus series back."""
from __future__ import annotations

import logging

import pytest

from lmi_cache.blend.worker_jobs import BlendWorkerStats
from lmi_cache.metrics import counts as counts_module
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.vllm_connector.worker_stats import WorkerStats

RANK = {"engine": "1", "rank": "3"}


def _series(metrics: CacheMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, RANK)


def test_an_event_is_counted_once_and_the_stats_read_the_series() -> None:
    metrics = CacheMetrics(rank_label="3", engine_label="1")
    stats = WorkerStats(lambda: metrics)
    for _ in range(7):
        stats.add(WorkerStats.num_chunks_loaded)
        stats.add(WorkerStats.load_seconds, 0.25)
    assert stats.num_chunks_loaded == _series(metrics, "lmi_cache_worker_loaded_chunks_total") == 7
    assert stats.load_seconds == _series(metrics, "lmi_cache_worker_load_seconds_total") == 1.75
    # No second store that could drift: the object holds no number of its own.
    assert not [v for v in vars(stats).values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    stats.add(WorkerStats.num_chunks_loaded, 5)
    assert stats.num_chunks_loaded == _series(metrics, "lmi_cache_worker_loaded_chunks_total") == 12
    with pytest.raises(AttributeError, match="is a counter"):
        stats.num_chunks_loaded = 0  # type: ignore[assignment]  # (no plain copy can shadow the counter)
    assert stats.num_chunks_loaded == 12
    assert stats.snapshot()["num_chunks_loaded"] == 12 and "num_chunks_loaded=12" in repr(stats)


def test_every_count_is_present_at_zero_once_attached() -> None:
    metrics = CacheMetrics(rank_label="3", engine_label="1")
    stats = BlendWorkerStats()
    assert stats.num_blends == 0 and _series(metrics, "lmi_cache_blend_jobs_total") is None
    stats.attach(metrics)
    for count in BlendWorkerStats.counts():
        assert _series(metrics, f"{count.name}_total") == 0, count.name
    assert set(stats.snapshot()) == {c.field for c in BlendWorkerStats.counts()}


def test_counts_without_an_engine_stay_with_the_object() -> None:
    stats = WorkerStats(rank_label="2")  # a stand-in engine, or none yet: the counts still add up
    stats.add(WorkerStats.num_chunks_saved, 2)
    stats.add(WorkerStats.num_chunks_saved, 3)
    assert stats.num_chunks_saved == 5 and stats.num_save_faults == 0


def test_engine_stats_are_read_from_the_series() -> None:
    metrics = CacheMetrics(rank_label="3", engine_label="1")
    metrics.stored("cpu", 16, 4096, 0.001)
    metrics.stored("cpu", 16, 4096, 0.001)
    metrics.dropped("cpu", "full")
    metrics.dropped("cpu", "too_large")
    metrics.dropped("cpu", "full")
    metrics.loaded("disk", 0.002)
    metrics.loaded_tokens("disk", 16)
    metrics.error("connector", "load")
    metrics.usage("cpu", 8192, 65536)
    assert not [v for v in vars(metrics).values() if isinstance(v, dict)]  # no second store beside the registry
    assert metrics.snapshot() == {
        "cpu_stored_chunks": 2, "cpu_stored_bytes": 8192, "cpu_dropped_full": 2, "cpu_dropped_too_large": 1,
        "cpu_dropped_stores": 3, "disk_loads": 1, "disk_loaded_tokens": 16, "connector_errors_load": 1,
        "cpu_usage_bytes": 8192, "cpu_capacity_bytes": 65536,
    }
    assert _series(metrics, "lmi_cache_stored_chunks_total") is None  # (tier is a label: read with it)
    assert metrics.registry.get_sample_value("lmi_cache_stored_chunks_total", {**RANK, "tier": "cpu"}) == 2


def test_a_negative_count_turns_the_counts_off_without_an_error(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counts_module.logger, "disabled", False)
    caplog.set_level(logging.WARNING, logger=counts_module.logger.name)
    stats = WorkerStats(lambda: CacheMetrics())
    stats.add(WorkerStats.num_load_faults, 2)
    stats.add(WorkerStats.num_load_faults, -1)  # a counter only grows: a metrics fault, never an exception
    stats.add(WorkerStats.num_load_faults)
    assert stats.off and stats.num_load_faults == 2
    assert sum("worker metrics turned off" in r.getMessage() for r in caplog.records) == 1
