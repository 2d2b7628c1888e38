"""Worker half of the connector with a dict-backed fake engine: loads, saves and every fault path."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmi_cache.chunk_hashing import KeyNamespace, chunk_keys
from lmi_cache.transfer.layouts import ExpectedGeometry, KvLayoutError
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.worker_side import WorkerSide

GEO = ExpectedGeometry(block_size_tokens=4, num_kv_heads=2, head_size=3)
NUM_BLOCKS, NUM_LAYERS = 10, 2


class FakeEngine:
    def __init__(self) -> None:
        self.data: dict[bytes, torch.Tensor] = {}
        self.events: tuple[list[bytes], list[bytes]] = ([], [])
        self.fail_store = False
        self.flushed = self.closed = False
        self.metrics = SimpleNamespace(errors=[])
        self.metrics.error = lambda tier, op: self.metrics.errors.append((tier, op))

    def store(self, key: Any, chunk: torch.Tensor) -> bool:
        if self.fail_store:
            raise OSError("disk on fire")
        self.data[key.digest] = chunk.clone()
        self.events[0].append(key.digest)
        return True

    def store_from(self, key: Any, shape: tuple[int, ...], dtype: torch.dtype, fill: Any) -> bool:
        out = torch.empty(shape, dtype=dtype)
        fill(out)  # a real engine hands out its own memory; the worker must gather into it
        return self.store(key, out)

    def retrieve(self, key: Any, out: torch.Tensor | None = None) -> torch.Tensor | None:
        chunk = self.data.get(key.digest)
        if chunk is None or out is None:
            return chunk
        return out.copy_(chunk)  # like the engine: the caller's buffer is filled and returned

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
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
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2)), ChunkTransfer("r", (k[1],), (3, 4))]))
    assert worker.stats.num_chunks_saved == 2 and len(engine.data) == 2
    meta = worker.build_worker_meta()
    assert meta is not None and meta.stored_digests == {0: [k[0].digest, k[1].digest]}
    assert meta.layout_tags == {0: worker.layout.tag}  # type: ignore[union-attr]
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7, 8)), ChunkTransfer("q", (k[1],), (9,))]))
    assert torch.equal(layers[1][7], layers[1][1]) and torch.equal(layers[1][8], layers[1][2])
    assert torch.equal(layers[0][9], layers[0][3])
    assert worker.take_failed_block_ids() == set() and worker.stats.num_chunks_loaded == 2


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
    assert engine.metrics.errors == [("connector", "load")]
    assert [t for t in engine.data] == [k[2].digest]  # only the healthy request saved
    wmeta = worker.build_worker_meta()
    assert wmeta is not None and k[0].digest in wmeta.removed_digests[0] and wmeta.num_load_faults == 1
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
    assert engine.metrics.errors == [("connector", "save")]


def test_bad_block_id_is_a_fault() -> None:
    worker, engine, _ = make_worker()
    k = keys(1)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2))]))
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
