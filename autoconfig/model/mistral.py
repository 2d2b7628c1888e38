"""Mistral-format models: ``params.json`` -> the config.json keys vLLM 0.32 derives from it (container-start process).

Mistral ships some models (Mistral Large 3, Ministral, Magistral, Devstral)
with ``params.json`` and ``consolidated*.safetensors`` and no ``config.json``.
vLLM reads such a directory with ``--config-format mistral``
(``vllm/transformers_utils/config.py`` ``MistralConfigParser``), which maps the
file with ``vllm/transformers_utils/configs/mistral.py`` ``adapt_config_dict``.
This module mirrors that mapping for the keys the planner reads (geometry,
sliding windows, MLA, MoE, quantization, dtype, length), so ``plan`` sizes the
model vLLM will build. Pure: a mapping in, a new mapping out; no I/O.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmi_cache.errors import UserError

PARAMS_FILE = "params.json"
# vLLM MistralConfigParser.parse: without max_position_embeddings in params.json (and no config.json
# beside it to take it from: _maybe_retrieve_max_pos_from_hf), vLLM assumes 128,000.
DEFAULT_MAX_POSITIONS = 128_000
# The vLLM arguments that read a Mistral-format directory; LMI passes option.<name> through as they are.
MISTRAL_FORMAT_ARGS = (("config_format", "--config-format"), ("tokenizer_mode", "--tokenizer-mode"),
                       ("load_format", "--load-format"))


class MistralParamsError(UserError):
    """A params.json that vLLM's Mistral mapping would refuse."""


def has_model_config(path: Path) -> bool:
    """A model directory vLLM can read: config.json, or Mistral's params.json."""
    return (path / "config.json").is_file() or (path / PARAMS_FILE).is_file()


def is_params_only_dir(path: Path) -> bool:
    """A directory with params.json and no config.json: vLLM's config_format auto may not find it a format."""
    return path.is_dir() and (path / PARAMS_FILE).is_file() and not (path / "config.json").is_file()


def mistral_format_args(model_dir: Path, chosen: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """vLLM flags for a params.json-only directory that the user's options did not set, and a summary line.

    vLLM 0.32's ``config_format`` auto picks the Mistral format only when ``consolidated*.safetensors`` sit
    beside params.json (``get_config``), so a directory without them would fail to start; naming the format
    keeps config, tokenizer and weights read the Mistral way. ``chosen``: the vLLM arguments the settings set.
    """
    if not is_params_only_dir(model_dir):
        return [], None
    args: list[str] = []
    for name, flag in MISTRAL_FORMAT_ARGS:
        if name not in chosen:
            args += [flag, "mistral"]
    if not args:
        return [], None
    shown = " ".join(args)
    return args, (f"model: {model_dir} holds params.json and no config.json (Mistral format): vLLM gets {shown} "
                  "(set option.config_format / option.tokenizer_mode / option.load_format to choose otherwise)")


def adapt_params(params: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The config vLLM's ``adapt_config_dict`` builds from ``params``, as a plain dict (no transformers)."""
    config = copy.deepcopy(dict(params))
    config.setdefault("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    missing = [key for key in ("n_layers", "n_heads", "dim") if key not in config]
    if missing:
        raise MistralParamsError(f"{source}: no '{missing[0]}'; is this a Mistral model's params.json? point --model "
                                 "at the model's directory (config.json or Mistral's params.json)")
    config = _remap_general(config)
    config = _remap_sliding_window(config, source)
    if config.get("quantization"):
        config = _remap_quantization(config, source)
    if config.get("qk_nope_head_dim"):
        config = _remap_mla(config)
    moe = config.get("moe")
    if config.get("model_type") == "mamba":
        config["architectures"] = ["Mamba2ForCausalLM"]
    elif isinstance(moe, Mapping) and moe and (moe.get("num_shared_experts") or 0) > 0:
        # Mistral Large 3: DeepSeek-V3's MLA and MoE under another name.
        config = _remap_moe(config)
        config["model_type"] = "deepseek_v3"
        config["architectures"] = ["MistralLarge3ForCausalLM"]
    elif moe:
        config["architectures"] = ["MixtralForCausalLM"]
    else:
        config["architectures"] = ["MistralForCausalLM"]
    vision = (config.get("multimodal") or {}).get("vision_encoder_args") or config.get("vision_encoder")
    if vision:
        # _remap_mistral_vision_args: the language model moves under text_config (Pixtral).
        text = {k: v for k, v in config.items() if k not in ("multimodal", "vision_encoder", "quantization_config")}
        config = {"model_type": "pixtral", "architectures": ["PixtralForConditionalGeneration"],
                  "text_config": text, "vision_config": dict(vision) if isinstance(vision, Mapping) else {},
                  **({"quantization_config": config["quantization_config"]} if "quantization_config" in config else {}),
                  **({"dtype": text["dtype"]} if text.get("dtype") else {})}
    return config


def _remap_general(config: dict[str, Any]) -> dict[str, Any]:
    """_remap_general_mistral_args: Mistral key names -> Hugging Face ones, and their defaults."""
    renames = {"dim": "hidden_size", "norm_eps": "rms_norm_eps", "n_kv_heads": "num_key_value_heads",
               "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size"}
    for old, new in renames.items():
        if old in config:
            config[new] = config.pop(old)
    config["model_type"] = config.pop("model_type", "transformer")
    config["hidden_act"] = config.pop("activation", "silu")
    config["tie_word_embeddings"] = config.pop("tied_embeddings", False)
    config["max_seq_len"] = config.pop("max_seq_len", config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    return config


def _remap_sliding_window(config: dict[str, Any], source: str) -> dict[str, Any]:
    """_remap_mistral_sliding_window: a list of windows per layer (None = full) -> layer_types + one window."""
    window = config.get("sliding_window")
    if not window:
        return config
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise MistralParamsError(f"{source}: 'n_layers' must be a positive integer to place 'sliding_window'; "
                                 "fix params.json")
    if isinstance(window, list):
        if not all(w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window):
            raise MistralParamsError(f"{source}: 'sliding_window' lists must hold integers and nulls (null: a "
                                     "full-attention layer); fix params.json")
        windows = {w for w in window if w is not None}
        if len(windows) > 1:
            raise MistralParamsError(f"{source}: 'sliding_window' lists several windows {sorted(windows, key=str)}; "
                                     "vLLM accepts one window size (and null for full-attention layers)")
        pattern = window * (layers // len(window))
        config["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in pattern]
        config["sliding_window"] = next(iter(windows), None)
    elif isinstance(window, int) and not isinstance(window, bool) and config.get("layer_types") is None:
        config["layer_types"] = ["sliding_attention"] * layers
    else:
        raise MistralParamsError(f"{source}: 'sliding_window' must be an integer or a list of integers and nulls, "
                                 f"got {type(window).__name__}; fix params.json")
    return config


def _remap_quantization(config: dict[str, Any], source: str) -> dict[str, Any]:
    """_remap_mistral_quantization_args: FP8 weights, or a compressed-tensors config passed through."""
    quant = config.pop("quantization")
    if not isinstance(quant, Mapping):
        raise MistralParamsError(f"{source}: 'quantization' must be an object; fix params.json")
    if quant.get("qformat_weight") == "fp8_e4m3":
        dynamic = quant.get("qscheme_act") == "NO_SCALES"
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic" if dynamic else "static"}
    elif str(quant.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors":
        config["quantization_config"] = {**quant, "quant_method": "compressed-tensors"}
    else:
        raise MistralParamsError(f"{source}: unknown 'quantization' {dict(quant)}; vLLM reads qformat_weight "
                                 "fp8_e4m3 or a compressed-tensors config")
    return config


def _remap_mla(config: dict[str, Any]) -> dict[str, Any]:
    """_remap_mistral_mla_args: an MLA model without MoE gets one shared expert (so it maps to Large 3)."""
    if not config.get("moe"):
        config["moe"] = {"num_experts": 1, "first_k_dense_replace": config.get("num_hidden_layers"),
                         "route_every_n": 1, "num_shared_experts": 1,
                         "expert_hidden_dim": config.get("intermediate_size"), "num_experts_per_tok": 1}
    return config


def _remap_moe(config: dict[str, Any]) -> dict[str, Any]:
    """_remap_moe_args: Mistral's MoE keys -> DeepSeek-V3's."""
    renames = {"route_every_n": "moe_layer_freq", "first_k_dense_replace": "first_k_dense_replace",
               "num_experts_per_tok": "num_experts_per_tok", "num_experts": "n_routed_experts",
               "expert_hidden_dim": "moe_intermediate_size", "routed_scale": "routed_scaling_factor",
               "num_shared_experts": "n_shared_experts", "num_expert_groups": "n_group",
               "num_expert_groups_per_tok": "topk_group"}
    moe = dict(config.get("moe") or {})
    for old, new in renames.items():
        if old in moe:
            config[new] = moe.pop(old)
    config["moe"] = moe
    config.update(topk_method=None, norm_topk_prob=True, scoring_func="softmax")
    return config
