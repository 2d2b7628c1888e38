"""A model's parameter count and bytes per parameter, estimated from its config.json alone.

Used by ``autoconfig.model.source`` (container-start process and the CLI) when
a model directory has neither a safetensors index nor weight files. Every field
is read through ``_count``: a bounded non-negative integer or a one-line
``ModelConfigError``, so a garbage or huge value can neither crash nor hang it.
"""
from __future__ import annotations

from typing import Any, Mapping

from autoconfig.model.kv import ModelConfigError, text_section
from lmi_cache.config.values import show
from lmi_cache.plain_files import whole_number

__all__ = ["bytes_per_param", "estimate_num_params"]


def bytes_per_param(config: Mapping[str, Any]) -> float:
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        inner: Mapping[str, Any] = quant.get("quantization") or quant
        inner = inner if isinstance(inner, Mapping) else quant
        algo = str(inner.get("quant_algo", "")).upper()
        bits = quant.get("bits") or quant.get("w_bit")
        groups = quant.get("config_groups")
        if isinstance(groups, Mapping):
            group: Any = next(iter(groups.values()), None)
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping):
                bits = bits or weights.get("num_bits")
        if method in ("fp8", "fbgemm_fp8") or algo.startswith("FP8") or bits == 8:
            return 1.0
        if algo == "NVFP4" or bits == 4 or method in ("awq", "mxfp4"):
            return 0.5
    text, _ = text_section(config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
    return 4.0 if dtype in ("float32", "float") else 2.0


def estimate_num_params(config: Mapping[str, Any]) -> int:
    """Language-model parameters from the config: embeddings, attention, MLP/MoE, norms, lm_head.

    Biases and any vision tower are left out (under 2% for the models we size). Every
    field is read through ``_count`` (a bounded non-negative integer, else one-line error).
    """
    t, prefix = text_section(config)

    def num(*names: str, default: int = 0, section: Mapping[str, Any] = t) -> int:
        return _count(section, names, default, prefix if section is t else "")

    hidden = num("hidden_size", "n_embd")
    layers = min(num("num_hidden_layers", "n_layer"), _MAX_LAYERS)
    heads = num("num_attention_heads", "n_head", default=1) or 1
    vocab = num("vocab_size") or num("vocab_size", section=config)
    model_type = str(t.get("model_type") or config.get("model_type") or "")
    if t.get("kv_lora_rank"):
        attn = _mla_params(num, hidden, heads)
    else:
        kv_heads = 1 if t.get("multi_query") and not t.get("new_decoder_architecture") else (
            num("num_key_value_heads", "n_head_kv", "num_kv_heads") or heads)
        head_dim = num("head_dim") or hidden // heads
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    inter = num("intermediate_size")
    dense_mlp = 3 * hidden * inter if inter else 2 * hidden * 4 * hidden  # gated vs plain 4x MLP
    num_experts = num("num_experts", "n_routed_experts", "num_local_experts")
    num_moe = 0
    moe_mlp = 0
    if num_experts:
        expert_inter = num("moe_intermediate_size") or inter or 4 * hidden
        shared = num("n_shared_experts") * expert_inter + num("shared_expert_intermediate_size")
        moe_mlp = 3 * hidden * expert_inter * num_experts + 3 * hidden * shared + hidden * num_experts
        num_moe = _moe_layer_count(t, layers, num("first_k_dense_replace"), num("decoder_sparse_step") or 1)
    per_layer_norms = 2 * hidden
    blocks = layers * (attn + per_layer_norms) + (layers - num_moe) * dense_mlp + num_moe * moe_mlp
    tied = t.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tied is None:  # transformers' per-model defaults
        tied = model_type.startswith("gemma") or model_type == "falcon"
    embeddings = vocab * hidden * (1 if tied else 2)
    return blocks + embeddings + hidden


_MAX_LAYERS = 1 << 16
_MAX_COUNT = 1 << 40  # any single dimension or count beyond this is not a real model


def _count(section: Mapping[str, Any], names: tuple[str, ...], default: int, prefix: str) -> int:
    """The first of ``names`` present (null/absent/0 fall through): a non-negative integer up to 2^40."""
    for name in names:
        value = section.get(name)
        if value is None or value == 0:
            continue
        number = whole_number(value)
        if number is None or not 0 <= number <= _MAX_COUNT:
            raise ModelConfigError(f"'{prefix}{name}' must be a non-negative integer up to {_MAX_COUNT:,} to "
                                   f"estimate the weights, got {show(value)}; fix the config.json")
        return number
    return default


def _moe_layer_count(t: Mapping[str, Any], layers: int, first_dense: int, step: int) -> int:
    """Layers i (0-based) with (i + 1) % step == 0, not among the first ``first_dense``, not in mlp_only_layers."""
    sparse = layers // step - min(first_dense, layers) // step
    only = t.get("mlp_only_layers")
    dense_ids = {i for i in only if isinstance(i, int) and not isinstance(i, bool)} if isinstance(only, list) else set()
    sparse -= sum(1 for i in dense_ids if first_dense <= i < layers and (i + 1) % step == 0)
    return max(0, sparse)


def _mla_params(num: Any, hidden: int, heads: int) -> int:
    rope, nope = num("qk_rope_head_dim"), num("qk_nope_head_dim")
    v_dim, kv_rank, q_rank = num("v_head_dim") or nope, num("kv_lora_rank"), num("q_lora_rank")
    q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    return q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
