"""BlendWorker over a tiny HF Llama and CPU paged tensors: stores, blends, faults (no vLLM engine)."""
from __future__ import annotations

import pytest
import torch
from blend_models import DictEngine, paged_blend_worker

from lmi_cache.blend.blender import prefill
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.jobs import BlendJob, BlendPiece, SegmentStore
from lmi_cache.vllm_connector.plugin import loaded_model, register, remember_model
from lmi_cache.blend.worker_jobs import BlendWorker
from lmi_cache.keys.hashing import ChunkKey

N = 16


def _worker(ratio: float) -> tuple[BlendWorker, HFLayerwiseModel, list[torch.Tensor]]:
    return paged_blend_worker(ratio, N)


def _key(n: int, tag: int) -> ChunkKey:
    return ChunkKey(bytes([tag]) * 16, 0, n, tag)


def test_ratio_one_blend_equals_a_prefill_and_a_lost_segment_is_recomputed() -> None:
    worker, model, _ = _worker(1.0)
    engine = DictEngine()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (20,), generator=gen)
    seg_a, seg_b = torch.randint(0, 256, (30,), generator=gen), torch.randint(0, 256, (25,), generator=gen)
    worker.run_stores([SegmentStore("r", tuple(seg_a.tolist()), (_key(30, 1),), ("cpu",)),
                       SegmentStore("r", tuple(seg_b.tolist()), (_key(25, 2),), ("cpu",))], engine)
    assert worker.stats.num_segments_stored == 2
    block_ids = tuple(range(3, 3 + 6))
    with torch.inference_mode():
        prefix_kv, _ = prefill(model, prefix)
        want, _ = prefill(model, torch.cat((seg_b, seg_a)), prefix_kv)
    worker.paged.write(block_ids, 0, prefix_kv.k, prefix_kv.v)
    del engine.objects[bytes([1]) * 16]  # segment a evicted behind the scheduler's back
    job = BlendJob("r", 20, tuple(torch.cat((seg_b, seg_a)).tolist()),
                   (BlendPiece(20, 45, (_key(25, 2),), "cpu"), BlendPiece(45, 75, (_key(30, 1),), "cpu")), block_ids)
    assert worker.run_blends([job], engine) == set()
    assert worker.stats.num_segments_loaded == 1 and worker.stats.num_segment_misses == 1
    got_k, got_v = worker.paged.read(block_ids, 20, 75)
    torch.testing.assert_close(got_k, want.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, want.v, atol=1e-5, rtol=1e-5)


def test_a_failed_blend_reports_its_blocks_for_recompute() -> None:
    worker, _, _ = _worker(0.15)
    job = BlendJob("r", 16, tuple(range(40)), (BlendPiece(16, 56, (_key(40, 3),), "cpu"),), (1, 2))  # blocks too few
    failed = worker.run_blends([job], DictEngine())
    assert failed == {2} and worker.stats.num_blend_faults == 1


@pytest.mark.vllm
def test_plugin_remembers_the_model_weakly_and_wraps_once() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    register()
    wrapped = BaseModelLoader.load_model
    register()
    assert BaseModelLoader.load_model is wrapped
    module = torch.nn.Linear(2, 2)
    remember_model(module)
    assert loaded_model() is module
    del module
    assert loaded_model() is None


def test_without_the_plugin_the_model_is_found_by_its_attention_layer() -> None:
    from lmi_cache.vllm_connector.blend_model import find_model

    remember_model(torch.nn.Linear(1, 1))  # the plugin's record dies with its model: no record
    attn = torch.nn.Identity()
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.attn = attn
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([layer])
    top = torch.nn.Module()
    top.model = inner
    assert find_model(attn) is top
    assert find_model(torch.nn.Identity()) is None
