"""MLA models' bytes per token: DeepSeek-V3.2's indexer cache beside the latent (test process, no vLLM).

Regenerate the golden file after an intended change with
``LMI_CACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/autoconfig/test_plan_mla.py`` and review the diff.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import MODELS, _golden, _in_repo, _run  # noqa: F401 (_in_repo: autouse, runs from the repo root)

from autoconfig.model.kv import kv_layout_from_config
from lmi_cache.errors import UserError

LATENT_BF16 = (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, 2 B each
INDEXER = 128 + 4  # index_head_dim fp8 values + one float32 scale per 128


def _v32() -> dict[str, Any]:
    return json.loads((Path(MODELS) / "deepseek-v3.2" / "config.json").read_text())


def test_deepseek_v32_counts_the_indexer_keys_of_every_layer() -> None:
    info = kv_layout_from_config(_v32())
    layout = info.layout
    assert layout.kv_bytes_per_token == 78_324 == 61 * (LATENT_BF16 + INDEXER)
    assert layout.attention_bytes_per_token == 61 * LATENT_BF16
    # Latent and indexer keys are both replicated on every TP rank (num_kv_heads=1, max_tp_shards=1).
    assert layout.kv_bytes_per_token_per_rank(tp=8) == 78_324
    assert layout.kv_bytes_per_token_per_rank(tp=8, pp=2) == 31 * (LATENT_BF16 + INDEXER)
    notes = " | ".join(info.notes)
    assert "DeepseekV32IndexerCache" in notes and "132 B per token on 61 of 61 layers" in notes


def test_deepseek_v3_without_index_topk_has_no_indexer() -> None:
    config = json.loads((Path(MODELS) / "deepseek-v3" / "config.json").read_text())
    layout = kv_layout_from_config(config).layout
    assert layout.side_caches == () and layout.kv_bytes_per_token == 61 * LATENT_BF16


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
def test_fp8_latent_of_a_sparse_model_is_the_packed_row_and_the_indexer_stays_uint8(kv_cache_dtype: str) -> None:
    # vLLM's FLASHMLA_SPARSE backend stores any fp8 KV dtype as fp8_ds_mla: 656 B per token per layer.
    info = kv_layout_from_config(_v32(), kv_cache_dtype=kv_cache_dtype)
    assert info.layout.kv_bytes_per_token == 61 * (656 + INDEXER)
    assert any("fp8_ds_mla" in note and "656 B" in note for note in info.notes)


def test_fp8_latent_of_a_dense_mla_model_is_one_byte_per_value() -> None:
    config = json.loads((Path(MODELS) / "deepseek-v3" / "config.json").read_text())
    assert kv_layout_from_config(config, kv_cache_dtype="fp8").layout.kv_bytes_per_token == 61 * 576
    assert kv_layout_from_config(config, kv_cache_dtype="fp8_ds_mla").layout.kv_bytes_per_token == 61 * 656


@pytest.mark.parametrize(("keys", "layers"), [
    # vLLM DeepseekV2MLAAttention: skip = max(layer - offset + 1, 0) % freq != 0 (offset 2 by default).
    ({"index_topk_freq": 2}, sum(1 for i in range(61) if max(i - 1, 0) % 2 == 0)),
    ({"index_topk_freq": 3, "index_skip_topk_offset": 0}, sum(1 for i in range(61) if (i + 1) % 3 == 0)),
    # index_topk_pattern wins: "S" marks a layer without an indexer; layers beyond the pattern keep one.
    ({"index_topk_pattern": "FS" * 10, "index_topk_freq": 4}, 61 - 10),
    ({"index_head_dim": 256}, 61),
])
def test_indexer_layers_and_size_follow_vllms_rules(keys: dict[str, Any], layers: int) -> None:
    layout = kv_layout_from_config({**_v32(), **keys}).layout
    (indexer,) = layout.side_caches
    head = keys.get("index_head_dim", 128)
    assert (indexer.num_layers, indexer.bytes_per_token_per_layer) == (layers, head + head // 128 * 4)
    assert layout.kv_bytes_per_token == 61 * LATENT_BF16 + layers * indexer.bytes_per_token_per_layer


@pytest.mark.parametrize("keys", [{"index_topk_freq": 0}, {"index_topk_pattern": 5}, {"index_head_dim": None}])
def test_bad_indexer_keys_are_one_line_errors(keys: dict[str, Any]) -> None:
    config = {**_v32(), **keys}
    if keys.get("index_head_dim", 0) is None:
        del config["index_head_dim"]
    with pytest.raises(UserError, match="config.json: .*'index_"):
        kv_layout_from_config(config)


def test_deepseek_v32_plan_golden_at_tp8() -> None:
    result = _run(["plan", "--model", f"{MODELS}/deepseek-v3.2", "--tp", "8", "--instance-type", "ml.p5en.48xlarge",
                   "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["model"]["kv_bytes_per_token"] == plan["model"]["kv_bytes_per_token_per_rank"] == 78_324
    first = plan["explanation"][0]
    assert "61 layers x latent 576" in first and "61 layers x 132 B (indexer keys)" in first
    assert any(w.startswith("sparse MLA model: lmi-cache's connector stores the latent and its indexer keys")
               for w in plan["warnings"])
    _golden("plan_deepseek_v32_tp8_p5en.json", result.stdout)
