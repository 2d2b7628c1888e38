"""The lmi_cache_blend_* series: driven through BlendScheduler and the connector's blending component, read back
from the same registries as the other lmi_cache series (and from a multiprocess directory)."""
from __future__ import annotations

import logging

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from blend_models import DictEngine, paged_blend_worker

from lmi_cache.blend.blender import prefill
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.jobs import (
    BlendConnectorMetadata,
    BlendJob,
    BlendPiece,
    SegmentStore,
)
from lmi_cache.blend.scheduler_plan import BlendScheduler
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.keys.hashing import ChunkKey, KeySpace
from lmi_cache.metrics.scheduler_series import BlendSchedulerMetrics, SchedulerMetrics
from lmi_cache.metrics.worker_series import CacheMetrics

from lmi_cache.vllm_connector.blending import BlendContext, ConnectorBlending
from placement_helpers import confirm_stored, directory

REPO = Path(__file__).resolve().parents[2]
SEP = (9, 9)
N = 16  # tokens per block


def _sched_value(metrics: SchedulerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"engine": metrics.engine_label})


def _rank_value(metrics: CacheMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"engine": metrics.engine_label, "rank": metrics.rank_label})


# -- scheduler ------------------------------------------------------------------------------


def _space(layout: str) -> KeySpace:
    return KeySpace(model="m", kv_dtype="float32", layout=layout, chunk_size=N)


def _request(req_id: str, prompt: list[int], params: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, cache_salt=None, kv_transfer_params=params,
                           lora_request=None)


def _output(*new: tuple[str, list[int]]) -> Any:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
                           finished_req_ids=set())


def test_scheduler_series_follow_plans_stores_and_bad_requests() -> None:
    base = SchedulerMetrics(engine_label="1")
    blend_metrics = BlendSchedulerMetrics(base.registry, base.engine_label)  # as the blending component builds them
    sched = BlendScheduler(BlendSettings(enabled=True, min_tokens=4), SEP, _space, directory(4), blend_metrics)
    prompt = [1] * 10 + list(SEP) + [2] * 10 + list(SEP) + [5, 6, 7]
    first = _request("a", prompt)
    assert sched.plan(first, 0, 0, "L") is None  # cold: prefilled, its two segments stored
    sched.take_jobs(_output(("a", [1, 2])), BlendConnectorMetadata())
    assert _sched_value(base, "lmi_cache_blend_segment_stores_total") == 2
    assert _sched_value(base, "lmi_cache_blend_planned_requests_total") == 0  # nothing blended yet
    state = sched.state("a")
    assert state is not None
    confirm_stored(sched.directory, state.segment_keys)
    second = _request("b", prompt)
    assert sched.plan(second, 0, 0, "L") == 24
    sched.confirm("b", 24)
    assert _sched_value(base, "lmi_cache_blend_planned_requests_total") == 1
    assert _sched_value(base, "lmi_cache_blend_planned_tokens_total") == 24
    sched.plan(_request("c", prompt, {"blend_segment_ends": [5, 3]}), 0, 0, "L")  # not increasing
    assert _sched_value(base, "lmi_cache_blend_bad_requests_total") == 1
    assert sched.stats.num_bad_requests == 1 and sched.stats.num_blend_plans == 1
    # The stats are the series read back (no second count that could drift).
    assert sched.stats.snapshot() == {"num_blend_plans": 1, "num_blend_tokens": 24, "num_segment_stores": 2,
                                      "num_bad_requests": 1}


# -- worker -----------------------------------------------------------------------------------


class FakeWorkerSide:
    """The connector's worker side, reduced to what the blending component reads (no chunk load failed)."""

    def __init__(self, engine: DictEngine) -> None:
        self.engine = engine
        self.rank_index = 0
        self.expected: list[Any] = []

    def load_failed(self, req_id: str) -> bool:
        return False

    def expect_stores(self, events: Any) -> None:
        self.expected.extend(events)


class Connector:
    """The connector's worker hooks as they call the blending component (after the prefix path's loads and saves)."""

    def __init__(self, blending: ConnectorBlending, side: FakeWorkerSide) -> None:
        self.blending, self.side, self.meta = blending, side, BlendConnectorMetadata()

    def start_load_kv(self) -> None:
        self.blending.run_blends(self.meta, self.side)  # type: ignore[arg-type]

    def wait_for_save(self) -> None:
        self.blending.run_stores(self.meta, self.side)  # type: ignore[arg-type]


def _connector(ratio: float, metrics: CacheMetrics) -> tuple[Connector, HFLayerwiseModel]:
    """The blending component past register: a real BlendWorker over a tiny Llama and CPU paged tensors."""
    worker, model, _ = paged_blend_worker(ratio, N)
    context = BlendContext(worker.settings, SimpleNamespace(), _space, N)  # type: ignore[arg-type]
    blending = ConnectorBlending(context, scheduler=False)
    blending.worker = worker
    return Connector(blending, FakeWorkerSide(DictEngine(metrics))), model


def _key_of(n: int, tag: int) -> ChunkKey:
    return ChunkKey(bytes([tag]) * 16, 0, n, tag)


def test_worker_series_follow_each_step_of_the_connector() -> None:
    metrics = CacheMetrics(rank_label="3", engine_label="1")
    connector, model = _connector(0.5, metrics)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (20,), generator=gen)
    seg_a, seg_b = torch.randint(0, 256, (30,), generator=gen), torch.randint(0, 256, (26,), generator=gen)
    connector.meta = BlendConnectorMetadata(segment_stores=[
        SegmentStore("r", tuple(seg_a.tolist()), (_key_of(30, 1),), ("cpu",)),
        SegmentStore("r", tuple(seg_b.tolist()), (_key_of(26, 2),), ("cpu",))])
    connector.wait_for_save()  # the step that stores the segments
    assert _rank_value(metrics, "lmi_cache_blend_segments_stored_total") == 2
    assert _rank_value(metrics, "lmi_cache_blend_segment_store_seconds_total") > 0
    assert _rank_value(metrics, "lmi_cache_blend_jobs_total") == 0  # present from the first step, at 0

    block_ids = tuple(range(3, 3 + 6))
    with torch.inference_mode():
        prefix_kv, _ = prefill(model, prefix)
    connector.blending.worker.paged.write(block_ids, 0, prefix_kv.k, prefix_kv.v)
    del connector.side.engine.objects[bytes([1]) * 16]  # segment a lost: computed in full
    job = BlendJob("r", 20, tuple(torch.cat((seg_b, seg_a)).tolist()),
                   (BlendPiece(20, 46, (_key_of(26, 2),), "cpu"), BlendPiece(46, 76, (_key_of(30, 1),), "cpu")), block_ids)
    broken = BlendJob("s", 16, tuple(range(40)), (BlendPiece(16, 56, (_key_of(40, 4),), "cpu"),), (1, 2))  # too few blocks
    connector.meta = BlendConnectorMetadata(blends=[job, broken])
    connector.start_load_kv()
    stats = connector.blending.worker.stats
    assert stats.num_blends == 1 and stats.num_blend_faults == 1
    assert _rank_value(metrics, "lmi_cache_blend_jobs_total") == 1
    assert _rank_value(metrics, "lmi_cache_blend_job_faults_total") == 1
    assert _rank_value(metrics, "lmi_cache_blend_segments_loaded_total") == 1
    assert _rank_value(metrics, "lmi_cache_blend_segment_misses_total") == stats.num_segment_misses == 2  # a, and the broken job's
    assert _rank_value(metrics, "lmi_cache_blend_blended_tokens_total") == stats.num_blended_tokens == 26
    assert _rank_value(metrics, "lmi_cache_blend_recomputed_tokens_total") == stats.num_recomputed_tokens > 0
    assert _rank_value(metrics, "lmi_cache_blend_seconds_total") == pytest.approx(stats.blend_seconds)
    assert 0 < _rank_value(metrics, "lmi_cache_blend_write_seconds_total") <= stats.blend_seconds
    assert connector.blending.take_failed_block_ids() >= {2}
    connector.start_load_kv()  # the same jobs again: only what this step did is added
    assert _rank_value(metrics, "lmi_cache_blend_jobs_total") == 2
    assert _rank_value(metrics, "lmi_cache_blend_job_faults_total") == 2
    assert _rank_value(metrics, "lmi_cache_blend_segments_stored_total") == 2


def test_a_metrics_fault_never_breaks_a_step(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A library imported earlier in the session may configure logging with disable_existing_loggers.
    from prometheus_client import Counter

    from lmi_cache.metrics import counts as counts_module

    monkeypatch.setattr(counts_module.logger, "disabled", False)
    caplog.set_level(logging.WARNING, logger=counts_module.logger.name)
    metrics = CacheMetrics()
    Counter("lmi_cache_blend_jobs", "taken", registry=metrics.registry)  # the rank's counters cannot join it
    connector, _ = _connector(0.0, metrics)
    engine = connector.side.engine
    connector.meta = BlendConnectorMetadata(segment_stores=[SegmentStore("r", (1, 2, 3), (_key_of(3, 5),), ("cpu",))])
    connector.wait_for_save()
    assert bytes([5]) * 16 in engine.objects  # the store itself went through
    connector.meta = BlendConnectorMetadata(segment_stores=[SegmentStore("r", (4, 5, 6), (_key_of(3, 6),), ("cpu",))])
    connector.wait_for_save()  # turned off on this rank after one warning: no second try, no error
    assert bytes([6]) * 16 in engine.objects and connector.blending.worker.stats.off
    assert sum("blend metrics turned off" in r.getMessage() for r in caplog.records) == 1


def test_blend_series_add_up_across_processes(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR (as under lmi-cache serve) the series join vLLM's /metrics like the others."""
    code = (
        "from lmi_cache.blend.worker_jobs import BlendWorkerStats\n"
        "from lmi_cache.metrics.scheduler_series import BlendSchedulerMetrics, SchedulerMetrics\n"
        "from lmi_cache.metrics.worker_series import CacheMetrics\n"
        "import sys\n"
        "rank = sys.argv[1]\n"
        "if rank == 'scheduler':\n"
        "    BlendSchedulerMetrics(SchedulerMetrics('0').registry, '0').blended(100)\n"
        "else:\n"
        "    c = CacheMetrics(rank, engine_label='0')\n"
        "    stats = BlendWorkerStats(lambda: c)\n"
        "    stats.add(BlendWorkerStats.num_blends, 2)\n"
        "    stats.add(BlendWorkerStats.num_blended_tokens, 50)\n"
        "    assert stats.num_blends == 2  # the view reads the per-process file's value back\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    for who in ("scheduler", "0", "1"):
        subprocess.run([sys.executable, "-c", code, who], env=env, check=True, timeout=60)
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("lmi_cache_blend_planned_tokens_total", {"engine": "0"}) == 100
    for rank in ("0", "1"):
        labels = {"engine": "0", "rank": rank}
        assert registry.get_sample_value("lmi_cache_blend_jobs_total", labels) == 2
        assert registry.get_sample_value("lmi_cache_blend_blended_tokens_total", labels) == 50
