"""A model's config.json -> its KV-cache geometry (KvLayout), as vLLM 0.32 sees it.

Run by autoconfig in the container-start process (``plan``, ``configure``,
``serve``) before vLLM starts, so it reads the JSON itself: no torch, no
transformers. Each rule below mirrors the vLLM code it names, so that the bytes
per token we plan with are the bytes vLLM will allocate on a CUDA host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from autoconfig.model.config_errors import ModelConfigError
from autoconfig.model.dtypes import resolve_kv_dtype, resolve_model_dtype
from autoconfig.model.mla import mla_geometry, packed_latent
from autoconfig.model.ssm import HybridModelError, StateLayout, state_layout_from_config
from lmi_cache.config.values import show
from lmi_cache.plain_files import whole_number
from lmi_cache.kv_layout import KvLayout, SideCache

__all__ = ["HybridModelError", "KvLayoutInfo", "ModelConfigError", "hybrid_group_layers", "kv_layout_from_config",
           "text_section"]


@dataclass(frozen=True)
class KvLayoutInfo:
    layout: KvLayout
    model_dtype: str  # vLLM's resolved compute dtype: float16 / bfloat16 / float32
    max_position_embeddings: int | None  # None: the file does not say
    sliding_window: int | None  # None: no sliding-window layers
    notes: list[str] = field(default_factory=list)  # one-line explanations, for `plan --explain`
    num_attention_heads: int | None = None  # query heads (vLLM needs tensor_parallel_size to divide them)
    num_sliding_layers: int = 0  # layers that attend to the last sliding_window tokens only
    state: StateLayout | None = None  # hybrid models: the Mamba / linear-attention layers' per-request state


# Nested text sections of multimodal configs. transformers' get_text_config()
# looks at "text_config" (also "decoder"/"generator"); InternVL uses
# "llm_config" and DeepSeek-VL2 "language_config".
_TEXT_SECTIONS = ("text_config", "llm_config", "language_config")

# vLLM transformers_utils/model_arch_config_convertor.py, is_deepseek_mla():
# model types whose attention caches one compressed latent per layer.
_MLA_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2", "glm_moe_dsa",
    "glm4_moe_lite", "longcat_flash", "pangu_ultra_moe", "dots3_note", "axk1",
})

# Model types whose decoder mixes attention with state-space / linear-attention
# layers. Their per-request state lives in vLLM's Mamba KV cache groups
# (autoconfig.model.ssm sizes the kinds it knows; the others are refused).
_HYBRID_MODEL_TYPES = frozenset({
    "jamba", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba", "zamba2",
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "minimax_text_01", "minimax_m1",
    "lfm2", "lfm2_moe", "plamo2", "mamba", "mamba2", "falcon_mamba", "hunyuan_v1_hybrid",
})
_HYBRID_LAYER_WORDS = ("mamba", "linear", "ssm", "conv", "recurrent", "delta", "rwkv")
_HYBRID_KEYS = ("attn_layer_period", "attn_layer_offset", "mamba_d_state", "mamba_expand",
                "full_attention_interval", "linear_num_value_heads", "hybrid_override_pattern",
                "ssm_cfg", "mamba_n_heads")


def text_section(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The mapping that holds the language model's keys, and its key prefix for messages."""
    for key in _TEXT_SECTIONS:
        sub = config.get(key)
        if isinstance(sub, Mapping):
            return sub, f"{key}."
    return config, ""


def kv_layout_from_config(
    config: Mapping[str, Any],
    *,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    source: str = "config.json",
    model_name: str = "",
    bf16_supported: bool = True,
) -> KvLayoutInfo:
    """Derive the KV layout vLLM 0.32 allocates for this config.

    ``kv_cache_dtype`` / ``dtype`` are vLLM's ``--kv-cache-dtype`` / ``--dtype``.
    ``bf16_supported`` is False on pre-Ampere GPUs (compute capability < 8.0),
    where vLLM's "auto" falls back to float16.
    Raises ModelConfigError / HybridModelError (one-line UserErrors) on bad input.
    """
    if not isinstance(config, Mapping):
        raise ModelConfigError(
            f"{source}: expected a JSON object (a Hugging Face model's config.json), "
            f"got {type(config).__name__}; point --model at the model's directory or its config.json"
        )
    text, prefix = text_section(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    hybrid_why = _hybrid_marker(config, text, prefix, model_type)
    notes: list[str] = []
    if prefix:
        notes.append(f"language-model keys read from '{prefix[:-1]}' (multimodal config)")

    num_layers = _int_key(text, ("num_hidden_layers", "n_layer", "num_layers"), prefix, source)
    num_heads = _int_key(text, ("num_attention_heads", "n_head", "num_heads"), prefix, source)
    model_dtype, dtype_note = resolve_model_dtype(config, text, dtype, model_type, source, bf16_supported)
    kv_dtype, kv_note = resolve_kv_dtype(config, text, kv_cache_dtype, model_dtype, source)
    notes += [dtype_note, kv_note]
    state = None
    if hybrid_why:
        if model_type not in _HYBRID_MODEL_TYPES:
            model_type = str(config.get("model_type") or model_type)
        try:
            state = state_layout_from_config(text, prefix, model_type, num_layers, model_dtype, source)
        except HybridModelError as err:
            raise HybridModelError(f"{err} ({hybrid_why})") from None
        notes.append(
            f"hybrid ({hybrid_why}): {state.num_attention_layers} of {num_layers} layers are attention (KV per "
            f"token), {state.num_state_layers} keep a per-request {state.kind} state; {state.describe()}, "
            f"{state.request_state_bytes():,} B per request for all state layers (vLLM's mamba_cache_dtype auto: "
            "the model dtype)"
        )
        num_layers = state.num_attention_layers

    is_mla = model_type in _MLA_MODEL_TYPES and text.get("kv_lora_rank") is not None
    side_caches: tuple[SideCache, ...] = ()
    if is_mla:
        mla = mla_geometry(text, prefix, source, model_type, num_layers, _int_key)
        head_dim, num_kv_heads, side_caches = mla.latent_dim, 1, mla.side_caches
        notes += mla.notes
        packed = packed_latent(kv_dtype, sparse=bool(side_caches))
        if packed is not None:
            head_dim, kv_dtype = packed[0], "fp8_ds_mla"  # head_dim counts 1-byte cells of the packed row
            notes.append(packed[1])
    else:
        num_kv_heads, kv_note2 = _kv_heads(text, model_type, num_heads, prefix, source)
        head_dim, head_note = _head_dim(text, num_heads, prefix, source)
        notes += [kv_note2, head_note]
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"{source}: '{prefix}num_attention_heads' {num_heads} is not a multiple of the KV head "
                f"count {num_kv_heads}; check '{prefix}num_key_value_heads'"
            )

    max_pos = _opt_int(text, "max_position_embeddings", prefix, source)
    if max_pos is None and prefix:
        max_pos = _opt_int(config, "max_position_embeddings", "", source)
    if max_pos is None:
        notes.append("max_position_embeddings not in the config: vLLM uses the model class default")
    sliding_window, num_sliding = (None, 0) if state else _sliding_window(text, prefix, source, notes, num_layers)

    layout = KvLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      kv_dtype=kv_dtype, is_mla=is_mla, model_name=model_name, side_caches=side_caches)
    sides = "".join(f" + {side.name} {side.bytes_per_token:,}" for side in side_caches)
    notes.append(f"{layout.kv_bytes_per_token} bytes of KV per token for the whole model ({num_layers} "
                 f"{'attention ' if state else ''}layers{': latent ' + format(layout.attention_bytes_per_token, ',') + sides if sides else ''})")
    return KvLayoutInfo(layout=layout, model_dtype=model_dtype, max_position_embeddings=max_pos,
                        sliding_window=sliding_window, notes=notes, num_attention_heads=num_heads,
                        num_sliding_layers=num_sliding, state=state)


def _hybrid_marker(config: Mapping[str, Any], text: Mapping[str, Any], prefix: str, model_type: str) -> str:
    """Why the config reads as a hybrid attention / state-space model; "" when it does not."""
    why = ""
    if model_type in _HYBRID_MODEL_TYPES or str(config.get("model_type", "")) in _HYBRID_MODEL_TYPES:
        why = f"model_type '{model_type or config.get('model_type')}' mixes attention with state-space/linear-attention layers"
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = text.get(key)
        if not why and isinstance(kinds, list):
            odd = sorted({str(k) for k in kinds if any(w in str(k).lower() for w in _HYBRID_LAYER_WORDS)})
            if odd:
                why = f"'{prefix}{key}' lists non-attention layers {odd}"
    for key in _HYBRID_KEYS:
        if not why and text.get(key) is not None:
            why = f"'{prefix}{key}' marks a hybrid attention/state-space model"
    return why


# Upper bounds far above any real model, checked before any arithmetic: a config.json
# with 1e15 layers or 1e308 heads is refused in one line instead of hanging or overflowing.
MAX_LAYERS = 1 << 16
MAX_DIMENSION = 1 << 24  # heads, head_dim, hidden size, latent ranks, window
MAX_POSITIONS = 1 << 40
_BOUNDS = {"num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "num_layers": MAX_LAYERS,
           "max_position_embeddings": MAX_POSITIONS, "sliding_window": MAX_POSITIONS}


def _int_key(section: Mapping[str, Any], names: tuple[str, ...], prefix: str, source: str) -> int:
    for name in names:
        if section.get(name) is not None:
            return _positive(section[name], prefix + name, source)
    raise ModelConfigError(
        f"{source}: missing key '{prefix}{names[0]}'; is this a decoder LLM's config.json? "
        "pass the model's own config.json (or add the key)"
    )


def _opt_int(section: Mapping[str, Any], name: str, prefix: str, source: str) -> int | None:
    value = section.get(name)
    return None if value is None else _positive(value, prefix + name, source)


def _positive(value: Any, key: str, source: str) -> int:
    # JSON numbers like 4096.0 are accepted; True (a bool is an int), NaN, inf and huge values are not.
    limit = _BOUNDS.get(key.rpartition(".")[2], MAX_DIMENSION)
    number = whole_number(value)
    if number is None or not 0 < number <= limit:
        raise ModelConfigError(f"{source}: '{key}' must be a positive integer up to {limit:,}, got {show(value)}; "
                               "fix the config.json")
    return number


def _kv_heads(text: Mapping[str, Any], model_type: str, num_heads: int, prefix: str,
              source: str) -> tuple[int, str]:
    # vLLM FalconModelArchConfigConvertor.get_total_num_kv_heads: multi_query means
    # one KV head unless new_decoder_architecture; other MQA configs say the same.
    if text.get("multi_query") and not text.get("new_decoder_architecture"):
        return 1, f"num_kv_heads 1: '{prefix}multi_query' is true (multi-query attention)"
    # ModelArchConfigConvertorBase.get_total_num_kv_heads: first key present wins.
    for name in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                 "num_attention_groups"):
        if text.get(name) is not None:
            kv = _positive(text[name], prefix + name, source)
            kind = "MHA" if kv == num_heads else ("MQA" if kv == 1 else "GQA")
            return kv, f"num_kv_heads {kv} from '{prefix}{name}' ({kind}, {num_heads} query heads)"
    return num_heads, f"num_kv_heads {num_heads} = num_attention_heads (no KV-head key: MHA)"


def _head_dim(text: Mapping[str, Any], num_heads: int, prefix: str, source: str) -> tuple[int, str]:
    # ModelArchConfigConvertorBase.get_head_size: an explicit head_dim > 0 wins
    # (Gemma 2: 256, not 3584/16), then hidden_size_per_head, then hidden/heads.
    explicit = text.get("head_dim")
    if explicit is not None and not (isinstance(explicit, (int, float)) and not isinstance(explicit, bool)
                                     and explicit == 0):
        head_dim = _positive(explicit, prefix + "head_dim", source)
        return head_dim, f"head_dim {head_dim} given explicitly in '{prefix}head_dim'"
    if text.get("hidden_size_per_head") is not None:
        head_dim = _positive(text["hidden_size_per_head"], prefix + "hidden_size_per_head", source)
        return head_dim, f"head_dim {head_dim} from '{prefix}hidden_size_per_head'"
    hidden = _int_key(text, ("hidden_size", "n_embd", "d_model"), prefix, source)
    if hidden % num_heads:
        raise ModelConfigError(
            f"{source}: '{prefix}hidden_size' {hidden} is not divisible by '{prefix}num_attention_heads' "
            f"{num_heads}; add the model's '{prefix}head_dim' to the config"
        )
    return hidden // num_heads, f"head_dim {hidden // num_heads} = hidden_size {hidden} / num_attention_heads {num_heads}"


def _sliding_window(text: Mapping[str, Any], prefix: str, source: str, notes: list[str],
                    num_layers: int) -> tuple[int | None, int]:
    """The window and how many layers use it, as vLLM's model classes read the config."""
    # Qwen2-style configs carry a sliding_window that is off unless use_sliding_window.
    if text.get("use_sliding_window") is False:
        return None, 0
    window = _opt_int(text, "sliding_window", prefix, source)
    if window is None:
        return None, 0
    layer_types = text.get("layer_types")
    pattern = text.get("sliding_window_pattern")
    if isinstance(layer_types, list):
        num_sliding = sum(1 for t in layer_types if t == "sliding_attention")
    elif isinstance(pattern, int) and pattern > 0:
        # Gemma 3: every pattern-th layer is full attention, the others windowed.
        num_sliding = num_layers - num_layers // pattern
    elif text.get("model_type") == "gemma2":
        num_sliding = (num_layers + 1) // 2  # even layers windowed (vLLM gemma2.py before layer_types)
    else:
        num_sliding = num_layers  # Mistral style: one window for every layer
    if num_sliding == 0:
        return None, 0  # a window no layer uses (layer_types lists full attention only)
    notes.append(
        f"sliding window {window} tokens on {num_sliding} of {num_layers} layers: vLLM's hybrid KV cache "
        "manager stays on with lmi-cache, so on the GPU those layers keep about one window per request; the "
        "tiers store every layer of every chunk (bytes per token below), and a hit loads only the window's "
        "chunks of the windowed layers"
    )
    return window, num_sliding


def hybrid_group_layers(num_layers: int, num_sliding_layers: int) -> int:
    """Layers per KV cache group under vLLM's hybrid KV cache manager (all its groups share one block pool).

    Mirrors vllm/v1/core/kv_cache_utils.py ``_get_kv_cache_groups_uniform_page_size``: the group size is
    the smaller of the full-attention and sliding-window layer counts, or the larger when it is under
    1.5 times the smaller; one attention kind is one group of every layer.
    """
    num_full = num_layers - num_sliding_layers
    if num_full <= 0 or num_sliding_layers <= 0:
        return num_layers
    small, large = min(num_full, num_sliding_layers), max(num_full, num_sliding_layers)
    return large if large < small * 1.5 else small
