"""Which models can be blended: a check of the model's ``config.json`` made once at start.

Runs where the model config is known (the vLLM worker at start, the
reference blender). Blending rewrites per-layer attention KV, so it covers
decoder-only models with full causal attention and plain RoPE of the Llama
family: Llama 2/3/3.x, Qwen2/2.5, Qwen3 (per-head q/k norms) and Mistral
without a sliding window. Anything else is refused with one line naming the
model type and what to do.
"""
from __future__ import annotations

from typing import Any, Mapping

from lmi_cache.blend.rope import RopeSpec
from lmi_cache.blend.settings import BlendConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_blendable(config: Mapping[str, Any], model: str = "the model") -> RopeSpec:
    """The model's RoPE if ``config`` (a parsed config.json) can be blended; else BlendConfigError."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise BlendConfigError(
            f"enable_blending: {model} has model_type {model_type!r}; blending covers "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} only; turn enable_blending off for this model"
        )
    sliding = config.get("sliding_window")
    uses_sliding = config.get("use_sliding_window", model_type == "mistral") and sliding is not None
    layer_types = config.get("layer_types") or []
    if uses_sliding or any(t != "full_attention" for t in layer_types):
        raise BlendConfigError(
            f"enable_blending: {model} uses sliding-window attention, which blending does not cover; "
            "turn enable_blending off for this model"
        )
    return RopeSpec.from_hf_config(config)
