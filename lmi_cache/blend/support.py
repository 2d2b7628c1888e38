"""Which models can be blended: a check of the model's ``config.json`` made once at start.

Runs where the model config is known: ``lmi-cache plan`` / ``configure`` /
``serve`` (container start, before vLLM: ``blend_refusal`` is torch-free for
them), the vLLM worker at start and the reference blender (``check_blendable``,
which also returns the model's RoPE). Blending rewrites per-layer attention
KV, so it covers decoder-only models with full causal attention and plain
RoPE of the Llama family: Llama 2/3/3.x, Qwen2/2.5, Qwen3 (per-head q/k norms)
and Mistral without a sliding window. Anything else is refused with one line
naming the model type and what to do.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lmi_cache.blend.settings import BlendConfigError

if TYPE_CHECKING:
    from lmi_cache.blend.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The RoPE types lmi_cache.blend.rope re-rotates exactly (kept equal to its SUPPORTED_ROPE_TYPES by a test;
# repeated here so that the container-start check never imports torch).
BLENDABLE_ROPE_TYPES = ("default", "linear", "llama3")
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default (kept equal by a test)


def blend_refusal(config: Mapping[str, Any], model: str = "the model") -> str | None:
    """Why ``config`` (a parsed config.json) cannot be blended, as one clause; None when it can."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"{model} has model_type {model_type!r}; blending covers "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} only")
    # A Mistral config.json without the key gets transformers' default window (4096), which the worker sees.
    sliding = config.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW if model_type == "mistral" else None)
    uses_sliding = config.get("use_sliding_window", model_type == "mistral") and sliding is not None
    layer_types = config.get("layer_types") or []
    if uses_sliding or any(t != "full_attention" for t in layer_types):
        return f"{model} (model_type {model_type!r}) uses sliding-window attention, which blending does not cover"
    params: dict[str, Any] = {}
    for name in ("rope_parameters", "rope_scaling"):  # rope.RopeSpec.from_hf_config reads them in this order
        if isinstance(config.get(name), Mapping):
            params.update(config[name])
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in BLENDABLE_ROPE_TYPES:
        return (f"{model} (model_type {model_type!r}) uses rope type {rope_type!r}; blending re-rotates "
                f"{', '.join(BLENDABLE_ROPE_TYPES)} only")
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        return f"{model} (model_type {model_type!r}) rotates part of each head (partial_rotary_factor {partial})"
    return None


def check_blendable(config: Mapping[str, Any], model: str = "the model") -> RopeSpec:
    """The model's RoPE if ``config`` (a parsed config.json) can be blended; else BlendConfigError."""
    reason = blend_refusal(config, model)
    if reason is not None:
        raise BlendConfigError(f"enable_blending: {reason}; turn enable_blending off for this model")
    from lmi_cache.blend.rope import RopeSpec

    return RopeSpec.from_hf_config(config)
