"""Starts vLLM will refuse, found before vLLM is imported (``serve``, ``serve --dry-run`` and ``plan``).

Runs in the CLI / container-start process on the model's config.json and the
host snapshot, whatever the cache mode: a ``max_model_len`` above what vLLM
derives from the model (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set), a
tensor/pipeline-parallel degree that does not split the heads or layers, and a
GPU KV cache smaller than one ``max_model_len`` sequence (the planner's check,
whose message gives the largest ``max_model_len`` that fits). Each is one
``PlanError`` line naming the option and the number that would work.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.model.kv import text_section
from autoconfig.plan.types import PlanError
from autoconfig.plan.settings import ServingSettings, TierOverrides

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# config.json keys vLLM takes the model's length from (the smallest one present wins), in vLLM 0.32's order.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already the scaled length (vLLM does not multiply them).
_PRESCALED_ROPE = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


def derived_max_model_len(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """(the longest max_model_len vLLM accepts without VLLM_ALLOW_LONG_MAX_MODEL_LEN, the key it comes from).

    None when config.json names no length (vLLM then takes any max_model_len).
    """
    text, _ = text_section(config)
    found = [(text[k], k) for k in LENGTH_KEYS if _is_count(text.get(k))]
    if not found:
        return None
    length, key = min(found)
    if _is_count(text.get("model_max_length")):
        length, key = text["model_max_length"], "model_max_length"  # Command-R's key wins outright, as in vLLM
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, Mapping) and "gemma3" not in str(config.get("model_type", "")):
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, (int, float)) and factor > 0:
            return int(length * factor), f"{key} x rope_scaling factor {factor:g}"
    return int(length), key


def check_max_model_len(config: Mapping[str, Any], settings: ServingSettings, env: Mapping[str, str],
                        where: str = "max_model_len") -> None:
    """vLLM refuses a max_model_len above the model's own unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set."""
    if settings.max_model_len is None or _truthy(env.get(ALLOW_LONG_ENV, "")):
        return
    derived = derived_max_model_len(config)
    if derived is None or settings.max_model_len <= derived[0]:
        return
    length, key = derived
    raise PlanError(f"{where}={settings.max_model_len}: above the model's {length:,} ({key} in config.json), "
                    f"so vLLM would refuse to start; set it to {length} or less (or set {ALLOW_LONG_ENV}=1 "
                    "if the model really handles longer sequences)")


def check_startable(info: Any, settings: ServingSettings, host: HostSnapshot, env: Mapping[str, str],
                    where: Mapping[str, str]) -> None:
    """Every refusal above; ``where`` names the options (option name -> how messages show it).

    The planner is run without tier overrides: only its model and GPU checks matter here
    (the tiers are checked by configure, or by validate for a user's YAML).
    """
    from autoconfig.plan.planner import plan_tiers

    check_max_model_len(info.config, settings, env, where.get("max_model_len", "max_model_len"))
    try:
        plan_tiers(host, info, replace(settings, overrides=TierOverrides()))
    except PlanError as err:
        message = str(err)
        for name, shown in where.items():
            if message.startswith(f"{name}="):
                message = shown + message[len(name):]
                break
        raise PlanError(message) from None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true")  # vLLM's reading of VLLM_ALLOW_LONG_MAX_MODEL_LEN
