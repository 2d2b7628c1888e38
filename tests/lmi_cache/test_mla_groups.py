"""MLA models' KV cache groups: read from vLLM's spec, keyed, hit, saved and loaded (test process, no vLLM).

The worker's tensors are shaped exactly as vLLM 0.32 views an ``MLAAttentionSpec`` layer's pages
(``[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]`` on its CPU backend,
``[num_blocks, block_size, latent]`` on others); a hit must restore every latent layer byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import pytest
import torch
from test_kv_groups import Config, FullAttentionSpec, Group
from test_scheduler_groups import PROMPT, new_req
from placement_helpers import directory, stored
from test_scheduler_side import key_space, output, request
from test_worker_side import FakeEngine, keys

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.keys.kv_groups import (
    MLA,
    KvCacheGroup,
    UnsupportedKvGroups,
    is_single_full_group,
    kv_groups_of,
    longest_hit_tokens,
)
from lmi_cache.transfer.layouts import ExpectedGeometry
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide
from lmi_cache.vllm_connector.worker_side import WorkerSide

LATENT = 512 + 64  # DeepSeek V2/V3: kv_lora_rank + qk_rope_head_dim
BLOCK, NUM_BLOCKS = 16, 12  # vLLM's CPU MLA kernel runs blocks of 16 tokens
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
MLA_GEO = ExpectedGeometry(block_size_tokens=BLOCK, num_kv_heads=1, head_size=LATENT, is_mla=True)


class SparseCacheRole(Enum):  # vLLM's enum: MLAAttentionSpec.cache_role
    SPARSE = "sparse"
    INDEXER = "indexer"


@dataclass(frozen=True)
class MLAAttentionSpec:  # a stand-in named like vLLM's; kv_groups_of reads names and attributes only
    block_size: int = BLOCK
    head_size: int = LATENT
    cache_role: SparseCacheRole = SparseCacheRole.SPARSE


def test_an_mla_group_reads_as_its_own_kind_and_hits_like_full_attention() -> None:
    (group,) = kv_groups_of(Config([Group(list(LAYERS), MLAAttentionSpec())]))
    assert (group.kind, group.layer_names, group.latent) == (MLA, LAYERS, True)
    assert group.key_tag == f"0:mla:{','.join(LAYERS)}"
    assert group.key_tag != KvCacheGroup(0, LAYERS).key_tag
    assert is_single_full_group((group,))  # one group: keys and synchronous loads as for one full group
    held = {0, 1, 3}
    # Every chunk before the hit is needed: chunk 2 missing caps the hit at two chunks.
    assert longest_hit_tokens((group,), 4, 32, BLOCK, 200, lambda g, c: c in held) == 64


def test_indexer_keys_are_not_read_as_a_latent_group() -> None:
    indexer = MLAAttentionSpec(head_size=132, cache_role=SparseCacheRole.INDEXER)
    with pytest.raises(UnsupportedKvGroups, match="group 1 \\(MLAAttentionSpec"):
        kv_groups_of(Config([Group([LAYERS[0]], FullAttentionSpec()), Group([LAYERS[1]], indexer)]))


@pytest.mark.parametrize(("shape", "dtype"), [((NUM_BLOCKS, 1, BLOCK, LATENT), torch.float32),
                                              ((NUM_BLOCKS, BLOCK, LATENT), torch.bfloat16)])
def test_a_hit_restores_every_latent_layer_byte_for_byte(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=MLA_GEO, chunk_size_tokens=2 * BLOCK, engine_factory=lambda: engine,
                        groups=(KvCacheGroup(0, LAYERS, latent=True),))
    gen = torch.Generator().manual_seed(7)
    layers = [torch.randn(shape, generator=gen).to(dtype) for _ in LAYERS]
    worker.register_kv_caches(dict(zip(LAYERS, layers)))
    assert worker.layout is not None and worker.layout.tag.startswith("mla.")
    chunk_bytes = len(LAYERS) * 2 * BLOCK * LATENT * layers[0].element_size()
    meta = worker.build_worker_meta()
    assert meta is not None and meta.chunk_bytes == {0: {0: chunk_bytes}}
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), 0, 0),
                                            ChunkTransfer("r", (k[1],), (3, 4), 0, 0)]))
    saved = [layer[1:5].clone() for layer in layers]
    for layer in layers:  # another request's KV now sits in the blocks the hit will land in
        layer[6:10] = torch.randn(layer[6:10].shape, generator=gen).to(dtype)
    load_two_chunks_and_compare(worker, k, layers, saved, chunk_bytes)


def load_two_chunks_and_compare(worker: WorkerSide, k: list[ChunkKey], layers: list[torch.Tensor],
                                saved: list[torch.Tensor], chunk_bytes: int) -> None:
    """Load chunks ``k`` into blocks 6..9 of every layer: they must equal ``saved`` byte for byte."""
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (6, 7), 0, 0),
                                            ChunkTransfer("q", (k[1],), (8, 9), 0, 0)]))
    for layer, before in zip(layers, saved):
        assert torch.equal(layer[6:10].view(torch.uint8), before.view(torch.uint8))
    assert worker.stats.num_chunks_loaded == 2 and worker.take_failed_block_ids() == set()
    assert worker.stats.load_bytes == 2 * chunk_bytes


def test_a_chunk_of_another_latent_width_is_a_load_fault_not_a_copy() -> None:
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=MLA_GEO, chunk_size_tokens=2 * BLOCK, engine_factory=lambda: engine,
                        groups=(KvCacheGroup(0, LAYERS, latent=True),))
    layers = [torch.zeros(NUM_BLOCKS, 1, BLOCK, LATENT) for _ in LAYERS]
    worker.register_kv_caches(dict(zip(LAYERS, layers)))
    k = keys(1)
    engine.data[k[0].digest] = torch.ones(len(LAYERS), 2, 1, BLOCK, LATENT - 64)
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (3, 4), 0, 0)]))
    assert worker.take_failed_block_ids() == {3, 4}
    assert all(not layer.any() for layer in layers)


MLA_TAG = "mla.s0123.float32"


def mla_side(world_size: int) -> SchedulerSide:
    geometry = SchedulerGeometry(BLOCK, 32, world_size, groups=(KvCacheGroup(0, LAYERS, latent=True),))
    side = SchedulerSide(geometry, key_space(world_size), directory(32))
    side.update_from_workers(LmiWorkerMeta(layout_tags=dict.fromkeys(range(world_size), MLA_TAG)))
    return side


def test_scheduler_keys_mla_chunks_by_the_latent_layout_per_rank_and_loads_in_the_step() -> None:
    side = mla_side(2)
    req = request("w", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, 0)
    meta = side.build_connector_meta(output([new_req("w", [list(range(20, 29))], 0)], {"w": len(PROMPT)}))
    assert [t.block_ids for t in meta.saves] == [(20, 21), (22, 23), (24, 25), (26, 27)]
    # Each TP rank stores its own copy of the replicated latent, under its own key.
    assert [list(t.keys) for t in meta.saves] == [list(pair) for pair in zip(
        key_space(2)(MLA_TAG).keys(PROMPT, 0), key_space(2)(MLA_TAG).keys(PROMPT, 1))]
    assert meta.saves[0].keys[0] != key_space(2)("cpu.s0123.float32").keys(PROMPT, 0)[0]
    side.update_from_workers(stored({r: [t.keys[r].digest for t in meta.saves] for r in range(2)}))
    side.request_finished("w")
    again = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(again, 0) == (128, False)  # one group: loaded in the step
    side.update_state_after_alloc(again, 128, block_ids=(list(range(40, 49)),))
    loads = side.build_connector_meta(output([new_req("r", [list(range(40, 49))], 0)], {"r": 12})).loads
    assert [(t.block_ids, t.group) for t in loads] == [((40, 41), 0), ((42, 43), 0), ((44, 45), 0), ((46, 47), 0)]
    assert all(t.keys == s.keys for t, s in zip(loads, meta.saves))  # each rank loads its own copy
