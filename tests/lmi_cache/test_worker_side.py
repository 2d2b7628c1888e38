"""Worker half of the connector with a dict-backed fake engine: loads, saves and every fault path."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from lmi_cache.keys.hashing import KeyNamespace, chunk_keys
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.transfer.layouts import ExpectedGeometry, KvLayoutError
from lmi_cache.placement.messages import Eviction, TierEvent
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.worker_side import WorkerSide

GEO = ExpectedGeometry(block_size_tokens=4, num_kv_heads=2, head_size=3)
NUM_BLOCKS, NUM_LAYERS = 10, 2


class FakeObject:
    """What the engine's load yields: a chunk with a reference the worker must release."""

    def __init__(self, engine: FakeEngine, key: Any, chunk: torch.Tensor) -> None:
        self.key, self._chunk, self._engine = key, chunk, engine
        engine.outstanding += 1

    def payload_tensor(self) -> torch.Tensor:
        return self._chunk

    def release(self) -> None:
        self._engine.outstanding -= 1


def tier_errors(engine: FakeEngine) -> dict[tuple[str, str], float]:
    """lmi_cache_tier_errors_total of the engine's rank, by (tier, op)."""
    return {(s.labels["tier"], s.labels["op"]): s.value for m in engine.metrics.registry.collect() for s in m.samples
            if s.name == "lmi_cache_tier_errors_total"}


class FakeEngine:
    def __init__(self) -> None:
        self.data: dict[bytes, torch.Tensor] = {}
        self.events: tuple[list[TierEvent], list[TierEvent]] = ([], [])
        self.evicted: list[tuple[str, bytes, str | None]] = []
        self.fail_store = False
        self.flushed = self.closed = False
        self.outstanding = 0  # objects handed out by load and not released yet
        self.load_calls = 0
        self.metrics = CacheMetrics(rank_label="0", engine_label="e")  # the rank's registry, as a real engine's

    def expect_chunks(self, payload_bytes: int) -> None:
        self.expected_chunk_bytes = payload_bytes

    def save_many(self, keys: list[Any], shape: tuple[int, ...], dtype: torch.dtype, fill: Any,
                  tiers: Any) -> list[bool]:
        if self.fail_store:
            raise OSError("disk on fire")
        outs = [torch.empty(shape, dtype=dtype) for _ in keys]
        fill(outs)  # a real engine hands out its own memory; the worker must gather into it
        for position, (key, out) in enumerate(zip(keys, outs)):
            self.data[key.digest] = out
            for tier in tiers[position]:
                if tier != "full":  # a tier that refuses every put
                    self.events[0].append(TierEvent(tier, key.digest, out.numel() * 4))
        return [True] * len(keys)

    def load(self, keys: list[Any], sources: Any = None, promote: Any = None) -> Iterator[list[tuple[int, FakeObject]]]:
        self.load_calls += 1
        self.last_sources = sources
        for position, key in enumerate(keys):  # one batch per hit, like disk reads finishing one by one
            chunk = self.data.get(key.digest)
            if chunk is not None:
                if promote is not None and promote[position]:
                    self.events[0].append(TierEvent("cpu", key.digest))
                yield [(position, FakeObject(self, key, chunk))]

    def evict(self, tier: str, digest: bytes, demote_to: str | None = None) -> None:
        self.evicted.append((tier, digest, demote_to))
        self.data.pop(digest, None)

    def drain_events(self) -> tuple[list[TierEvent], list[TierEvent]]:
        events, self.events = self.events, ([], [])
        return events

    def flush(self, timeout_s: float) -> None:
        self.flushed = True

    def close(self) -> None:
        self.closed = True


def keys(n: int) -> list[Any]:
    ns = KeyNamespace(model="m", kv_dtype="float32", layout="t")
    return chunk_keys(list(range(n * 8)), ns, 8)


def make_worker(seed: int = 0) -> tuple[WorkerSide, FakeEngine, list[torch.Tensor]]:
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=GEO, chunk_size_tokens=8, engine_factory=lambda: engine)
    whole = torch.randn(NUM_LAYERS, NUM_BLOCKS, 2, 4, 6, generator=torch.Generator().manual_seed(seed))
    layers = [whole[i] for i in range(NUM_LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)})
    return worker, engine, layers


def test_save_then_load_into_other_blocks() -> None:
    worker, engine, layers = make_worker()
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu",)), ChunkTransfer("r", (k[1],), (3, 4), tiers=("cpu",))]))
    assert worker.stats.num_chunks_saved == 2 and len(engine.data) == 2
    meta = worker.build_worker_meta()
    assert meta is not None and [e.digest for e in meta.stored[0]] == [k[0].digest, k[1].digest]
    assert meta.layout_tags == {0: worker.layout.tag}  # type: ignore[union-attr]
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8)), ChunkTransfer("q", (k[1],), (9,))]))
    assert torch.equal(layers[1][7], layers[1][1]) and torch.equal(layers[1][8], layers[1][2])
    assert torch.equal(layers[0][9], layers[0][3])
    assert worker.take_failed_block_ids() == set() and worker.stats.num_chunks_loaded == 2
    assert engine.expected_chunk_bytes == worker.copier.chunk_bytes  # type: ignore[union-attr]  # told at register
    assert engine.load_calls == 1  # the whole step in one engine call
    assert engine.outstanding == 0  # CPU copies are complete on return: every chunk object given back


def test_cpu_backend_copies_a_steps_hits_in_one_call_after_the_reads() -> None:
    """Hits arriving in several batches (disk reads finishing) are scattered once on the CPU backend:
    a copy started while reads still run would wait for the cores the reader threads hold."""
    worker, engine, layers = make_worker()
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu",)), ChunkTransfer("r", (k[1],), (3, 4), tiers=("cpu",))]))
    assert worker.copier is not None and not worker.copier.overlaps_host_work
    calls: list[int] = []
    scatter = worker.copier.scatter_many

    def counting(chunks: list[torch.Tensor], *args: Any) -> Any:
        calls.append(len(chunks))
        return scatter(chunks, *args)

    worker.copier.scatter_many = counting  # type: ignore[method-assign]
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (5, 6)), ChunkTransfer("q", (k[1],), (7, 8))]))
    assert calls == [2]  # the fake engine yields one batch per hit
    assert torch.equal(layers[0][5], layers[0][1]) and torch.equal(layers[1][8], layers[1][4])
    assert worker.stats.num_chunks_loaded == 2 and engine.outstanding == 0


class PendingEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_async_copies_keep_chunk_objects_until_their_event_completes() -> None:
    worker, engine, _ = make_worker()
    k = keys(1)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu",))]))
    event = PendingEvent()
    assert worker.copier is not None
    worker.copier.scatter_many = lambda *args: event  # type: ignore[method-assign]  # as on CUDA
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8))]))
    assert engine.outstanding == 1  # the host->device copy may still read the buffer
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8))]))
    assert engine.outstanding == 2
    event.done = True
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8))]))
    assert engine.outstanding == 0  # released at the next step once the copies completed
    event.done = False
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8))]))
    worker.shutdown()  # waits for the last copies, then gives everything back
    assert engine.outstanding == 0


def test_missing_chunk_reports_blocks_removes_digest_and_skips_saves() -> None:
    worker, engine, layers = make_worker()
    k = keys(3)
    before = layers[0][5].clone()
    meta = LmiConnectorMetadata(
        loads=[ChunkTransfer("q", (k[0],), (5, 6)), ChunkTransfer("q", (k[1],), (7, 8))],
        saves=[ChunkTransfer("q", (k[2],), (1, 2)), ChunkTransfer("other", (k[2],), (3, 4))],
    )
    worker.load(meta)
    worker.save(meta)
    assert worker.take_failed_block_ids() == {5, 6, 7, 8}
    assert worker.take_failed_block_ids() == set()
    assert torch.equal(layers[0][5], before)
    assert worker.stats.num_load_faults == 1
    assert tier_errors(engine) == {("connector", "load"): 1}
    assert [t for t in engine.data] == [k[2].digest]  # only the healthy request saved
    wmeta = worker.build_worker_meta()
    assert wmeta is not None and k[0].digest in [e.digest for e in wmeta.dropped[0]] and worker.stats.num_load_faults == 1
    # The poisoning lasts one step only.
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("q", (keys(4)[3],), (1, 2))]))
    assert worker.stats.num_chunks_saved == 2


def test_wrong_shape_chunk_is_a_fault_not_an_exception() -> None:
    worker, engine, _ = make_worker()
    k = keys(1)
    engine.data[k[0].digest] = torch.zeros(3, 3)
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (1, 2))]))
    assert worker.take_failed_block_ids() == {1, 2}


def test_store_exception_is_counted() -> None:
    worker, engine, _ = make_worker()
    engine.fail_store = True
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (keys(1)[0],), (1, 2))]))
    assert worker.stats.num_save_faults == 1 and worker.stats.num_chunks_saved == 0
    assert tier_errors(engine) == {("connector", "save"): 1}


def test_bad_block_id_is_a_fault() -> None:
    worker, engine, _ = make_worker()
    k = keys(1)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu",))]))
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (1, NUM_BLOCKS + 5))]))
    assert worker.take_failed_block_ids() == {1, NUM_BLOCKS + 5}


def test_unknown_layout_refused_before_engine_exists() -> None:
    created: list[int] = []
    worker = WorkerSide(rank_index=0, geometry=GEO, chunk_size_tokens=8, engine_factory=lambda: created.append(1))
    with pytest.raises(KvLayoutError):
        worker.register_kv_caches({"l0": torch.zeros(NUM_BLOCKS, 4, 2, 6)})
    assert created == [] and worker.build_worker_meta() is None


def test_shutdown_flushes_and_closes() -> None:
    worker, engine, _ = make_worker()
    worker.shutdown()
    assert engine.flushed and engine.closed and worker.engine is None


def test_save_and_load_seconds_reach_the_ranks_worker_series() -> None:
    """The connector's own time on the model thread is on /metrics (no tier series shows it)."""
    worker, engine, _ = make_worker()
    metrics = engine.metrics
    k = keys(2)
    labels = {"engine": "e", "rank": "0"}
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu",)), ChunkTransfer("r", (k[1],), (3, 4), tiers=("cpu",))]))
    worker.build_worker_meta()
    first = metrics.registry.get_sample_value("lmi_cache_worker_save_seconds_total", labels)
    assert first is not None and first == pytest.approx(worker.stats.save_seconds) and first > 0
    assert metrics.registry.get_sample_value("lmi_cache_worker_load_seconds_total", labels) == 0
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8))]))
    worker.build_worker_meta()
    assert metrics.registry.get_sample_value("lmi_cache_worker_load_seconds_total", labels) == pytest.approx(
        worker.stats.load_seconds) and worker.stats.load_seconds > 0
    assert metrics.registry.get_sample_value("lmi_cache_worker_save_seconds_total", labels) == pytest.approx(first)


def test_directed_work_follows_the_directory_and_every_planned_store_is_answered() -> None:
    """Evictions are applied before the loads; loads name their tier; a store lands or is reported failed."""
    worker, engine, layers = make_worker()
    k = keys(4)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), tiers=("cpu", "disk")),
                                            ChunkTransfer("r", (k[1],), (3, 4), tiers=("full",))]))
    report = worker.build_worker_meta()
    assert report is not None
    assert [(e.tier, e.digest) for e in report.stored[0]] == [("cpu", k[0].digest), ("disk", k[0].digest)]
    assert [(e.tier, e.digest) for e in report.failed[0]] == [("full", k[1].digest)]
    assert report.chunk_bytes == {0: {0: worker.copier.chunk_bytes}}  # type: ignore[union-attr]
    order: list[str] = []
    evict, load = engine.evict, engine.load
    engine.evict = lambda *a: (order.append("evict"), evict(*a))[1]  # type: ignore[method-assign]
    engine.load = lambda *a: (order.append("load"), load(*a))[1]  # type: ignore[method-assign]
    worker.load(LmiConnectorMetadata(
        evictions={0: [Eviction(0, "cpu", k[1].digest), Eviction(0, "cpu", k[3].digest, "disk")],
                   1: [Eviction(1, "cpu", k[2].digest)]},
        loads=[ChunkTransfer("q", (k[0],), (7, 8), source="disk", promote_to="cpu")]))
    assert order == ["evict", "evict", "load"]  # rank 1's eviction is not this rank's
    assert engine.evicted == [("cpu", k[1].digest, None), ("cpu", k[3].digest, "disk")]
    assert engine.last_sources == ["disk"] and torch.equal(layers[0][7], layers[0][1])
    report = worker.build_worker_meta()
    assert report is not None and ("cpu", k[0].digest) in [(e.tier, e.digest) for e in report.stored[0]]
    # The demotion was planned too: it did not land in this fake, so it is reported failed.
    assert [(e.tier, e.digest) for e in report.failed[0]] == [("disk", k[3].digest)]


def test_a_failed_load_is_reported_with_its_reason() -> None:
    """A load a tier refused for its token fingerprint says key_mismatch; one that is simply missing, failed_load."""
    worker, engine, _ = make_worker()
    k = keys(2)
    real_load = engine.load

    def refusing_load(load_keys: list[Any], sources: Any = None, promote: Any = None) -> Any:
        engine.metrics.fingerprint_mismatch("cpu")  # the tier found another prompt's chunk under the key
        return real_load(load_keys, sources, promote)

    engine.load = refusing_load  # type: ignore[method-assign]
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (5, 6)), ChunkTransfer("r", (k[1],), (7, 8))]))
    wmeta = worker.build_worker_meta()
    assert wmeta is not None
    assert [e.reason for e in wmeta.dropped[0]] == ["key_mismatch", "failed_load"]


def test_the_layout_is_sent_until_the_scheduler_has_it() -> None:
    worker, _, _ = make_worker()
    first = worker.build_worker_meta()
    assert first is not None and first.layout_tags == {0: worker.layout_tag} and first.chunk_bytes
    worker.load(LmiConnectorMetadata())  # the scheduler does not have every rank's yet
    again = worker.build_worker_meta()
    assert again is not None and again.layout_tags == {0: worker.layout_tag}
    worker.load(LmiConnectorMetadata(layout_known=True))
    later = worker.build_worker_meta()
    assert later is not None and later.layout_tags == {} and later.chunk_bytes == {}
