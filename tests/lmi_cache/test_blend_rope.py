"""RoPE: our frequencies equal transformers' for each covered type; re-rotated layer-0 K equals K computed in place."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from lmi_cache.blend.rope import RopeSpec, apply_rope, rerotate
from lmi_cache.blend.settings import BlendConfigError
from lmi_cache.blend.support import check_blendable
from blend_models import VOCAB, tiny_model

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def _rope_kwargs(rope: dict[str, Any] | None) -> dict[str, Any]:
    return {"rope_parameters": rope} if rope else {}


def _layer0_keys(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Layer-0 K (after RoPE) that transformers stores in its cache: [T, kv_heads, head_dim]."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
    layer: Any = cache.layers[0]
    return layer.keys[0].transpose(0, 1)


@pytest.mark.parametrize("rope", [None, LINEAR, LLAMA3], ids=["default", "linear", "llama3"])
def test_inv_freq_matches_transformers(rope: dict[str, Any] | None) -> None:
    model = tiny_model("llama", num_hidden_layers=1, **_rope_kwargs(rope))
    spec = RopeSpec.from_hf_config(model.config.to_dict())
    torch.testing.assert_close(spec.inv_freq(), model.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_old_style_rope_scaling_in_config_json() -> None:
    config = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.theta, spec.rope_type, spec.factor) == (128, 500000.0, "llama3", 8.0)


@pytest.mark.parametrize(
    ("model_type", "rope"),
    [("llama", None), ("llama", LLAMA3), ("llama", LINEAR), ("qwen2", None), ("qwen3", None)],
    ids=["llama", "llama3-scaling", "linear-scaling", "qwen2", "qwen3"],
)
def test_rerotated_layer0_k_equals_k_at_new_positions(model_type: str, rope: dict[str, Any] | None) -> None:
    model = tiny_model(model_type, num_hidden_layers=1, **_rope_kwargs(rope))
    spec = check_blendable(model.config.to_dict())
    ids = torch.randint(0, VOCAB, (2100,), generator=torch.Generator().manual_seed(1))
    in_place = _layer0_keys(model, ids)
    for start, length in ((0, 50), (7, 64), (1900, 200)):
        alone = _layer0_keys(model, ids[start : start + length])  # the segment computed at positions 0..n-1
        moved = rerotate(alone, torch.arange(length), torch.arange(start, start + length), spec)
        torch.testing.assert_close(moved, in_place[start : start + length])  # float32 tolerances
        if start:
            assert not torch.allclose(alone, in_place[start : start + length], atol=1e-3)


def test_apply_then_rerotate_back_is_identity() -> None:
    spec = RopeSpec(head_dim=32)
    x = torch.randn(10, 2, 32)
    pos = torch.arange(100, 110)
    torch.testing.assert_close(rerotate(apply_rope(x, pos, spec), pos, torch.zeros(10, dtype=torch.long), spec), x)


def test_bf16_cache_rerotates_in_float32() -> None:
    spec = RopeSpec(head_dim=32)
    k = apply_rope(torch.randn(8, 2, 32), torch.arange(8), spec)
    moved = rerotate(k.to(torch.bfloat16), torch.arange(8), torch.arange(500, 508), spec)
    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved.float(), rerotate(k, torch.arange(8), torch.arange(500, 508), spec),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
        ({"model_type": "mistral", "sliding_window": 4096, "hidden_size": 64, "num_attention_heads": 4},
         "sliding-window"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0.5},
         "partial_rotary_factor"),
    ],
)
def test_unsupported_models_are_refused_with_one_line(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(BlendConfigError) as err:
        check_blendable(config, "m")
    assert needle in str(err.value) and "enable_blending" in str(err.value) and "\n" not in str(err.value)


def test_supported_configs() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4}
    assert check_blendable({**base, "model_type": "mistral", "sliding_window": None}).head_dim == 16
    assert check_blendable({**base, "model_type": "qwen2", "sliding_window": 32768,
                            "use_sliding_window": False}).theta == 10000.0
