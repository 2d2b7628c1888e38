"""The compute dtype and the KV element type vLLM 0.32 picks for a model (container-start process; torch-free).

Each rule mirrors the vLLM code it names (``--dtype auto`` from the config,
``--kv-cache-dtype auto`` from a quantized checkpoint's KV scheme), so the bytes
per token autoconfig plans with are the bytes vLLM allocates on a CUDA host.
"""
from __future__ import annotations

from typing import Any, Mapping

from autoconfig.model.config_errors import ModelConfigError
from lmi_cache.kv_layout import KV_DTYPE_BYTES

# vllm/config/model.py _STR_DTYPE_TO_TORCH_DTYPE: the --dtype spellings vLLM takes.
_DTYPE_ALIASES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
                  "bfloat16": "bfloat16"}
# vllm/config/model.py _FLOAT16_NOT_SUPPORTED_MODELS (checked on the top-level model_type).
_NO_FLOAT16_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})
# vllm/config/cache.py CacheDType values whose element size KvLayout knows; the
# rest (nvfp4, turboquant_*, *_per_token_head...) pack scales per block.
_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
_VLLM_ONLY_KV_DTYPES = ("nvfp4", "nvfp4_ds_mla", "nvfp4_4over6", "turboquant_", "ultraquant_", "_per_token_head")


def resolve_model_dtype(config: Mapping[str, Any], text: Mapping[str, Any], dtype: str, model_type: str,
                        source: str, bf16_supported: bool = True) -> tuple[str, str]:
    """vLLM's compute dtype, as vllm/config/model.py _get_and_verify_dtype picks it on CUDA."""
    top_type = str(config.get("model_type") or model_type)
    # CudaPlatform.supported_dtypes: [bf16, fp16, fp32] on compute capability >= 8.0, else [fp16, fp32].
    supported = (["bfloat16"] if bf16_supported else []) + ["float16", "float32"]
    if top_type in _NO_FLOAT16_MODEL_TYPES:
        supported.remove("float16")
    preferred = supported[0]
    requested = str(dtype).lower()
    if requested != "auto":
        if requested not in _DTYPE_ALIASES:
            raise ModelConfigError(
                f"dtype '{dtype}' is not one vLLM accepts; use auto, float16, bfloat16 or float32 "
                "(option.dtype / --dtype)"
            )
        chosen = _DTYPE_ALIASES[requested]
        if chosen == "float16" and top_type in _NO_FLOAT16_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: model_type '{top_type}' does not support dtype float16 in vLLM "
                "(numerical instability); use bfloat16 or float32"
            )
        return chosen, f"model dtype {chosen}: set explicitly (--dtype {dtype})"
    config_dtype, where = _config_dtype(config, text)
    if config_dtype is None:
        # vLLM would read the safetensors header dtypes here; without weights we
        # take its final fallback (float32), which "auto" then downcasts.
        return preferred, (f"model dtype {preferred}: {source} names no dtype (vLLM then reads the weights' "
                           f"dtype, else assumes float32 and downcasts to {preferred})")
    if config_dtype == "float32":
        return preferred, f"model dtype {preferred}: '{where}' float32 is downcast by vLLM's dtype=auto"
    if config_dtype in supported:
        return config_dtype, f"model dtype {config_dtype} from '{where}' (vLLM dtype=auto)"
    return preferred, (f"model dtype {preferred}: '{where}' {config_dtype} is not usable here "
                       f"(vLLM dtype=auto falls back to {preferred})")


def _config_dtype(config: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[str | None, str]:
    # ModelArchConfigConvertorBase.get_torch_dtype: root, then text config, then vision config.
    # transformers < 4.56 wrote "torch_dtype", newer ones "dtype".
    sections: list[tuple[Mapping[str, Any], str]] = [(config, "")]
    if text is not config:
        sections.append((text, "text_config."))
    vision = config.get("vision_config")
    if isinstance(vision, Mapping):
        sections.append((vision, "vision_config."))
    for section, prefix in sections:
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if isinstance(value, str):
                return _DTYPE_ALIASES.get(value.lower().removeprefix("torch."), value.lower()), prefix + key
    return None, ""


def resolve_kv_dtype(config: Mapping[str, Any], text: Mapping[str, Any], kv_cache_dtype: str,
                     model_dtype: str, source: str) -> tuple[str, str]:
    """The KV element type vLLM allocates: --kv-cache-dtype, else the checkpoint's KV scheme, else the model dtype."""
    requested = str(kv_cache_dtype).lower()
    if requested not in _KV_CACHE_DTYPES:
        if any(part in requested for part in _VLLM_ONLY_KV_DTYPES):
            raise ModelConfigError(
                f"kv_cache_dtype '{kv_cache_dtype}' packs per-block scales that lmi-cache cannot size; "
                "use auto, bfloat16, float16, fp8, fp8_e4m3 or fp8_e5m2"
            )
        raise ModelConfigError(
            f"unknown kv_cache_dtype '{kv_cache_dtype}'; use one of {', '.join(_KV_CACHE_DTYPES)} "
            "(option.kv_cache_dtype / --kv-cache-dtype)"
        )
    if requested != "auto":
        return requested, f"KV dtype {requested} ({KV_DTYPE_BYTES[requested]} B): set explicitly"
    from_checkpoint, why = _checkpoint_kv_dtype(config, text, source)
    if from_checkpoint is not None:
        return from_checkpoint, f"KV dtype {from_checkpoint} (1 B): {why}"
    # vllm/utils/torch_utils.py kv_cache_dtype_str_to_dtype: "auto" -> model_config.dtype.
    return model_dtype, f"KV dtype {model_dtype} ({KV_DTYPE_BYTES[model_dtype]} B): kv_cache_dtype auto = model dtype"


def _checkpoint_kv_dtype(config: Mapping[str, Any], text: Mapping[str, Any],
                         source: str) -> tuple[str | None, str]:
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, Mapping):
        quant = text.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None, ""
    method = str(quant.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    inner = quant.get("quantization")
    inner = inner if isinstance(inner, Mapping) else quant
    producer = quant.get("producer")
    if isinstance(producer, Mapping) and producer.get("name") == "modelopt":
        method = "modelopt"  # model_arch_config_convertor._normalize_quantization_config
    if method.startswith("modelopt"):
        # vllm/utils/torch_utils.py get_kv_cache_quant_algo_string / resolve_kv_cache_dtype_string.
        algo = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme")
                or inner.get("kv_cache_quant_algo") or quant.get("kv_cache_quant_algo"))
        if isinstance(algo, Mapping):
            if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
                algo = "fp8"
            elif algo.get("num_bits") == 4 and algo.get("type") == "float":
                algo = "nvfp4"
            else:
                return None, ""
        if isinstance(algo, str) and algo.lower() == "fp8":
            return "fp8_e4m3", "the ModelOpt checkpoint's kv_cache_quant_algo FP8 (vLLM resolve_kv_cache_dtype_string)"
        if isinstance(algo, str) and algo.lower() == "nvfp4":
            raise ModelConfigError(
                f"{source}: 'quantization_config' asks for an NVFP4 KV cache, which lmi-cache cannot size; "
                "pass kv_cache_dtype fp8 or bfloat16"
            )
        return None, ""
    if method == "compressed-tensors" and quant.get("kv_cache_scheme") is not None:
        # vllm/model_executor/layers/attention/attention.py Attention.__init__:
        # a kv_cache_scheme with cache dtype "auto" becomes "fp8".
        return "fp8", "'quantization_config.kv_cache_scheme' of a compressed-tensors checkpoint (vLLM Attention)"
    return None, ""
