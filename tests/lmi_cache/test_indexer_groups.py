"""DeepSeek-V3.2's KV cache group: MLA latents and indexer keys in one group, saved and loaded (test process, no vLLM).

The worker's tensors are shaped exactly as vLLM 0.32 views them: each latent layer
``[num_blocks, 1, block_size, 576]`` (bf16 or float32) and each indexer key cache
``[num_blocks, 1, block_size, 132]`` uint8 (``DeepseekV32IndexerCache``: ``MLAAttentionSpec`` with
``num_kv_heads`` 1, ``head_size`` 132, uint8). vLLM's CPU backend has no sparse attention, so these CPU
tensors are the only place a V3.2 save and load is exercised.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from test_kv_groups import Config, FullAttentionSpec, Group
from test_mla_groups import (
    BLOCK,
    LATENT,
    MLA_GEO,
    MLA_TAG,
    NUM_BLOCKS,
    MLAAttentionSpec,
    SparseCacheRole,
    load_two_chunks_and_compare,
)
from test_scheduler_groups import PROMPT
from test_scheduler_side import key_space
from test_worker_side import FakeEngine, keys

from lmi_cache.errors import ConfigError
from lmi_cache.keys.kv_groups import MLA, KvCacheGroup, UnsupportedKvGroups, is_single_full_group, kv_groups_of
from lmi_cache.transfer.layouts import ExpectedGeometry, describe_kv_caches
from lmi_cache.transfer.mixed_copy import MixedPagedCopier
from lmi_cache.vllm_connector.metadata import ChunkTransfer, LmiConnectorMetadata
from lmi_cache.vllm_connector.startup import refuse_indexer_caches
from lmi_cache.vllm_connector.worker_side import WorkerSide

INDEX = 128 + 4  # index_head_dim values (fp8) + one float32 scale per 128 values
LATENTS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
INDEXERS = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(3))
NAMES = tuple(name for pair in zip(LATENTS, INDEXERS) for name in pair)  # vLLM's order: layer by layer
INDEXER_SPEC = MLAAttentionSpec(head_size=INDEX, cache_role=SparseCacheRole.INDEXER)


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:  # named like vLLM's group spec; kv_groups_of reads its members by name
    kv_cache_specs: dict[str, object] = field(default_factory=dict)


def v32_config(indexer: object = INDEXER_SPEC) -> Config:
    specs = {name: MLAAttentionSpec() if name in LATENTS else indexer for name in NAMES}
    return Config([Group(list(NAMES), UniformTypeKVCacheSpecs(specs))])


def v32_group() -> KvCacheGroup:
    (group,) = kv_groups_of(v32_config())
    return group


def test_a_latent_and_indexer_group_reads_as_one_mla_group_naming_its_indexer_keys() -> None:
    group = v32_group()
    assert (group.kind, group.layer_names, group.indexer_layers, group.indexer_head_size) == (MLA, NAMES, INDEXERS, INDEX)
    assert is_single_full_group((group,))  # hits like full attention, loads in the step
    assert group.key_tag == f"0:mla+indexer{INDEX}:{','.join(NAMES)}"
    (narrower,) = kv_groups_of(v32_config(MLAAttentionSpec(head_size=64, cache_role=SparseCacheRole.INDEXER)))
    assert narrower.key_tag != group.key_tag != KvCacheGroup(0, NAMES, latent=True).key_tag


@pytest.mark.parametrize("members", [
    {INDEXERS[0]: INDEXER_SPEC},  # indexer keys alone
    {LATENTS[0]: FullAttentionSpec(), INDEXERS[0]: INDEXER_SPEC},  # beside layers that are not MLA latents
])
def test_indexer_keys_in_any_other_grouping_are_refused_in_one_line(members: dict[str, object]) -> None:
    config = Config([Group(list(members), UniformTypeKVCacheSpecs(members))])
    with pytest.raises(UnsupportedKvGroups, match="group 0 \\(UniformTypeKVCacheSpecs"):
        kv_groups_of(config)
    with pytest.raises(ConfigError, match="stores indexer keys only in one group with the MLA latents") as err:
        refuse_indexer_caches(config)
    assert "\n" not in str(err.value)
    refuse_indexer_caches(v32_config())  # the V3.2 group itself passes


def v32_worker(latent_dtype: torch.dtype, seed: int = 7) -> tuple[WorkerSide, FakeEngine, list[torch.Tensor]]:
    engine = FakeEngine()
    worker = WorkerSide(rank_index=0, geometry=MLA_GEO, chunk_size_tokens=2 * BLOCK, engine_factory=lambda: engine,
                        groups=(v32_group(),))
    gen = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(NUM_BLOCKS, 1, BLOCK, LATENT, generator=gen).to(latent_dtype) if name in LATENTS
              else torch.randint(0, 256, (NUM_BLOCKS, 1, BLOCK, INDEX), generator=gen, dtype=torch.uint8)
              for name in NAMES}
    worker.register_kv_caches(caches)
    return worker, engine, [caches[name] for name in NAMES]


@pytest.mark.parametrize("latent_dtype", [torch.float32, torch.bfloat16])
def test_a_hit_restores_every_latent_and_indexer_layer_byte_for_byte(latent_dtype: torch.dtype) -> None:
    worker, engine, layers = v32_worker(latent_dtype)
    latent_bytes = 2 * BLOCK * LATENT * torch.empty((), dtype=latent_dtype).element_size()
    chunk_bytes = len(LATENTS) * (latent_bytes + 2 * BLOCK * INDEX)  # the indexer's bytes count too
    meta = worker.build_worker_meta()
    assert meta is not None and meta.chunk_bytes == {0: {0: chunk_bytes}}
    dtype_name = str(latent_dtype).removeprefix("torch.")
    assert worker.layout_tag == f"mla.s0123.{dtype_name}.1x{BLOCK}x{LATENT}+indexer.mla.s0123.uint8.1x{BLOCK}x{INDEX}"
    assert meta.layout_tags == {0: worker.layout_tag}
    k = keys(2)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), 0, 0),
                                            ChunkTransfer("r", (k[1],), (3, 4), 0, 0)]))
    assert [tuple(engine.data[key.digest].shape) for key in k] == [(chunk_bytes,)] * 2
    saved = [layer[1:5].clone() for layer in layers]
    for layer in layers:  # zeroed blocks for the hit to land in
        layer[6:10] = 0
    load_two_chunks_and_compare(worker, k, layers, saved, chunk_bytes)


def test_a_partial_chunk_load_writes_only_its_blocks_of_both_layouts() -> None:
    worker, _, layers = v32_worker(torch.float32)
    k = keys(1)
    worker.save(LmiConnectorMetadata(saves=[ChunkTransfer("r", (k[0],), (1, 2), 0, 0)]))
    second = [layer[2].clone() for layer in layers]
    for layer in layers:
        layer[5:7] = 0
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (6,), 1, 0)]))
    for layer, before in zip(layers, second):
        assert torch.equal(layer[6].view(torch.uint8), before.view(torch.uint8)) and not layer[5].any()


@pytest.mark.parametrize("payload", [
    torch.ones(len(LATENTS) * 2 * BLOCK * (LATENT * 4 + INDEX - 4), dtype=torch.uint8),  # narrower indexer keys
    torch.ones(len(LATENTS), 2, 1, BLOCK, LATENT),  # a plain MLA chunk of the same latent
])
def test_a_payload_of_another_geometry_is_a_load_fault_that_writes_nothing(payload: torch.Tensor) -> None:
    worker, engine, layers = v32_worker(torch.float32)
    for layer in layers:
        layer.zero_()
    k = keys(1)
    engine.data[k[0].digest] = payload
    worker.load(LmiConnectorMetadata(loads=[ChunkTransfer("q", (k[0],), (3, 4), 0, 0)]))
    assert worker.take_failed_block_ids() == {3, 4} and worker.stats.num_load_faults == 1
    assert all(not layer.any() for layer in layers)


def test_keys_change_with_either_layout() -> None:
    float_tag = v32_worker(torch.float32)[0].layout_tag
    bf16_tag = v32_worker(torch.bfloat16)[0].layout_tag
    space = key_space(1)
    digests = {space(tag).keys(PROMPT, 0)[0].digest for tag in (float_tag, bf16_tag, MLA_TAG)}
    assert len(digests) == 3  # neither a plain MLA chunk nor another latent dtype is read as this group's
    assert float_tag.startswith(MLA_TAG + ".") and "uint8" in float_tag.split("+")[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; scripts/gpu_check.sh runs this on a GPU")
def test_cuda_mixed_copier_moves_both_layouts_through_side_streams() -> None:
    gen = torch.Generator().manual_seed(3)
    src_cpu = [torch.randn(NUM_BLOCKS, 1, BLOCK, LATENT, generator=gen).to(torch.bfloat16) for _ in LATENTS] + \
              [torch.randint(0, 256, (NUM_BLOCKS, 1, BLOCK, INDEX), generator=gen, dtype=torch.uint8) for _ in INDEXERS]
    src = [t.cuda() for t in src_cpu]
    n = len(LATENTS)

    def mixed(layers: list[torch.Tensor]) -> MixedPagedCopier:
        latent = describe_kv_caches(dict(zip(LATENTS, layers[:n])), MLA_GEO)
        indexer = describe_kv_caches(dict(zip(INDEXERS, layers[n:])),
                                     ExpectedGeometry(BLOCK, 1, INDEX, is_mla=True))
        return MixedPagedCopier([(layers[:n], latent), (layers[n:], indexer)], 2)

    copier = mixed(src)  # real torch.cuda streams and events
    outs = [torch.empty(copier.chunk_shape, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    copier.gather_many([[1, 2], [7, 3]], outs)
    reference = [torch.empty(copier.chunk_shape, dtype=torch.uint8) for _ in range(2)]
    mixed(src_cpu).gather_many([[1, 2], [7, 3]], reference)
    assert all(torch.equal(out, ref) for out, ref in zip(outs, reference))
    dst = [torch.zeros_like(t) for t in src]
    event = mixed(dst).scatter_many(outs, [[4, 5], [6]], [0, 1])
    assert event is not None
    event.synchronize()  # what the worker waits for before it releases the host buffers
    torch.cuda.current_stream().synchronize()
    for got, want in zip(dst, src):
        assert torch.equal(got[4:6].view(torch.uint8), want[1:3].view(torch.uint8))
        assert torch.equal(got[6].view(torch.uint8), want[3].view(torch.uint8)) and not got[7].any()
