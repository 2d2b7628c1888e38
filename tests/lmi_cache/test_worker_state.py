"""Worker side with a Mamba state group: one block's state of every layer saved and loaded as one payload (fake engine)."""
from __future__ import annotations

import torch
from test_worker_side import GEO, NUM_BLOCKS, FakeEngine, keys, tier_errors

from lmi_cache.keys.kv_groups import KvCacheGroup
from lmi_cache.transfer.state_copy import state_views
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.worker_side import WorkerSide

SHAPES, DTYPES = ((3, 8), (2, 4, 4)), ("float32", "float32")
STATE_BYTES = (3 * 8 + 2 * 4 * 4) * 4  # per layer: conv + ssm state, float32
PAGE_BYTES = STATE_BYTES + 64  # vLLM pads a state page to the attention page
MIXERS = ("model.layers.0.mixer", "model.layers.2.mixer")
ATTENTION = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
GROUPS = (KvCacheGroup(0, MIXERS, state_shapes=SHAPES, state_dtypes=DTYPES), KvCacheGroup(1, ATTENTION))


def make_worker() -> tuple[WorkerSide, FakeEngine, list[torch.Tensor], list[torch.Tensor]]:
    """A worker registered with what vLLM hands a connector: [blocks, 1, 1, page] int8 pages for Mamba layers."""
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=GEO, chunk_size_tokens=8, engine_factory=lambda: engine, groups=GROUPS)
    gen = torch.Generator().manual_seed(1)
    pages = [torch.randint(-128, 127, (NUM_BLOCKS, 1, 1, PAGE_BYTES), dtype=torch.int8, generator=gen) for _ in MIXERS]
    attention = [torch.randn(NUM_BLOCKS, 2, 4, 6, generator=gen) for _ in ATTENTION]
    worker.register_kv_caches({**dict(zip(MIXERS, pages)), **dict(zip(ATTENTION, attention))})
    return worker, engine, pages, attention


def states(pages: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """Every layer's state tensors at one block, as the model's layers see them."""
    return [view[block].clone() for page in pages
            for view in state_views(page, SHAPES, [getattr(torch, d) for d in DTYPES])]


def test_a_state_is_saved_from_its_block_and_loaded_into_another() -> None:
    worker, engine, pages, attention = make_worker()
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (3,), 0, 0, tiers=("cpu",)),
                                            ChunkTransfer("r", (k[1],), (1, 2), 0, 1, tiers=("cpu",))]))
    payload = engine.data[k[0].digest]
    assert (payload.dtype, tuple(payload.shape)) == (torch.uint8, (2 * STATE_BYTES,))  # no page padding stored
    assert engine.data[k[1].digest].shape[0] == 2  # the attention group's chunk holds its two layers only
    before_other = pages[0][5].clone()
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7,), 0, 0, source="cpu")],
                                     async_loads=["q"]))
    assert all(torch.equal(a, b) for a, b in zip(states(pages, 7), states(pages, 3), strict=True))
    assert torch.equal(pages[0][5], before_other)  # no other block is written
    # The padding after the state is not part of it: block 7's padding kept its own bytes.
    assert not torch.equal(pages[0][7, 0, 0, STATE_BYTES:], pages[0][3, 0, 0, STATE_BYTES:])
    assert worker.take_async_results() == ({"q"}, set())
    assert worker.stats.load_bytes == 2 * STATE_BYTES and worker.stats.num_chunks_loaded == 1


def test_a_state_of_another_geometry_is_a_load_fault_never_a_write() -> None:
    worker, engine, pages, _ = make_worker()
    k = keys(1)
    engine.data[k[0].digest] = torch.zeros(2 * STATE_BYTES - 4, dtype=torch.uint8)  # a smaller state
    before = [page.clone() for page in pages]
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (7,), 0, 0, source="cpu")],
                                     async_loads=["q"]))
    assert all(torch.equal(a, b) for a, b in zip(pages, before))
    assert worker.take_async_results() == (set(), {"q"})  # vLLM recomputes the request
    assert worker.stats.num_load_faults == 1 and ("connector", "load") in tier_errors(engine)


def test_the_state_payload_size_is_reported_for_the_directory() -> None:
    worker, engine, _, attention = make_worker()
    meta = worker.build_worker_meta()
    assert meta is not None
    chunk_bytes = 2 * attention[0][0].numel() * 4 * 2  # two blocks of two layers per 8-token chunk
    assert meta.chunk_bytes == {0: {0: 2 * STATE_BYTES, 1: chunk_bytes}}
    assert engine.expected_chunk_bytes == max(2 * STATE_BYTES, chunk_bytes)
