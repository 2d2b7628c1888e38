"""Worker side with vLLM's KV cache groups: each group's chunks hold its own layers only (fake engine)."""
from __future__ import annotations

import torch
from test_worker_side import GEO, NUM_BLOCKS, FakeEngine, keys

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.worker_side import WorkerSide

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
# Gemma 2's pattern: even layers windowed (group 0), odd layers full attention (group 1).
GROUPS = (KvCacheGroup(0, (NAMES[0], NAMES[2]), 8), KvCacheGroup(1, (NAMES[1], NAMES[3])))


def make_worker() -> tuple[WorkerSide, FakeEngine, list[torch.Tensor]]:
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=GEO, chunk_size_tokens=8, engine_factory=lambda: engine, groups=GROUPS)
    whole = torch.randn(4, NUM_BLOCKS, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    layers = [whole[i] for i in range(4)]
    worker.register_kv_caches(dict(zip(NAMES, layers)))
    return worker, engine, layers


def test_each_group_saves_and_loads_its_own_layers() -> None:
    worker, engine, layers = make_worker()
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), 0, 0, tiers=("cpu",)),
                                            ChunkTransfer("r", (k[1],), (3, 4), 0, 1, tiers=("cpu",))]))
    assert engine.data[k[0].digest].shape[0] == 2  # two layers per chunk, not four
    assert torch.equal(engine.data[k[0].digest][1, 0], layers[2][1])  # group 0's second layer is layer 2
    assert torch.equal(engine.data[k[1].digest][0, 1], layers[1][4])
    # A sliding-window load of the tail block only (its window starts mid-chunk).
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (8,), 1, 0),
                                            ChunkTransfer("q", (k[1],), (6, 7), 0, 1)]))
    assert torch.equal(layers[0][8], layers[0][2]) and torch.equal(layers[2][8], layers[2][2])
    assert torch.equal(layers[1][6], layers[1][3]) and torch.equal(layers[3][7], layers[3][4])
    assert not torch.equal(layers[1][8], layers[1][2])  # group 1's layers were not written by group 0's load
    block_bytes = 2 * layers[0][0].numel() * layers[0].element_size()
    assert worker.stats.load_bytes == 3 * block_bytes
    assert worker.stats.num_chunks_loaded == 2 and worker.take_failed_block_ids() == set()


def test_asynchronous_loads_are_reported_by_request_never_by_block() -> None:
    worker, engine, layers = make_worker()
    k = keys(3)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), 0, 0, tiers=("cpu",))]))
    worker.load(LmiConnectorMetadata(
        loads=[ChunkTransfer("ok", (k[0],), (5, 6), 0, 0), ChunkTransfer("bad", (k[2],), (7, 8), 0, 1)],
        async_loads=["ok", "bad", "nothing-planned"],
    ))
    assert torch.equal(layers[0][5], layers[0][1])
    assert worker.take_async_results() == ({"ok"}, {"bad", "nothing-planned"})
    # Block ids of several groups are not unique: vLLM must not get them (it stops on them with several groups).
    assert worker.take_failed_block_ids() == set()
    assert worker.take_async_results() == (set(), set())
