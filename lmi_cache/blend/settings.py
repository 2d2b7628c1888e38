"""Blending settings (CacheBlend-style non-prefix reuse), parsed from LMCache's keys.

Torch-free; runs wherever the engine configuration is read (scheduler and
worker processes). ``BlendSettings.from_mapping`` takes the plain key/value
mapping of an LMCache YAML file or of ``LMCACHE_*`` environment strings and
returns typed, validated settings; bad values raise one ``BlendConfigError``
line naming the key and what to do.

Keys and meanings (LMCache's, with defaults where LMCache leaves them unset):

- ``enable_blending`` (bool, False): reuse cached segment KV at non-prefix positions.
- ``blend_special_str`` (str, ``" # # "``): the separator text that ends a segment.
- ``blend_check_layers`` (list[int], ``[1]``): layers at which tokens are selected
  for recompute; every layer before the first one is recomputed for all tokens.
- ``blend_recompute_ratios`` (list[float], ``[0.15]``): fraction of the blended
  tokens recomputed after each check layer (one value per check layer, or one
  value for all; non-increasing, each in [0, 1]).
- ``blend_min_tokens`` (int, 256): a request is blended only when at least this
  many of its tokens come from cached segments; shorter ones are prefilled.

``blend_thresholds`` (LMCache's threshold-based selection) is not implemented:
setting it is an error rather than a silently different selection.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmi_cache.config.values import parse_bool, parse_int, unquote_env
from lmi_cache.errors import ConfigError

BLEND_KEYS = (
    "enable_blending",
    "blend_special_str",
    "blend_check_layers",
    "blend_recompute_ratios",
    "blend_min_tokens",
)
# Every key the settings read: BLEND_KEYS, and LMCache's blend_thresholds (read only to be refused).
READ_KEYS = (*BLEND_KEYS, "blend_thresholds")
DEFAULT_SPECIAL_STR = " # # "
DEFAULT_CHECK_LAYERS: tuple[int, ...] = (1,)
DEFAULT_RECOMPUTE_RATIOS: tuple[float, ...] = (0.15,)
DEFAULT_MIN_TOKENS = 256


def blend_keys_in(data: Mapping[str, Any]) -> dict[str, Any]:
    """The blending keys of a parsed LMCache YAML."""
    return {key: data[key] for key in READ_KEYS if key in data}


def blend_keys_in_env(env: Mapping[str, str]) -> dict[str, str]:
    """The blending keys set as ``LMCACHE_<KEY>`` variables (they win over the YAML, as in LMCache)."""
    return {key: unquote_env(env[f"LMCACHE_{key.upper()}"]) for key in READ_KEYS if f"LMCACHE_{key.upper()}" in env}


class BlendConfigError(ConfigError):
    """A blending key has a bad value, or the model cannot be blended with these settings."""


@dataclass(frozen=True)
class BlendSettings:
    """Typed blending settings; ``ratios`` has one entry per check layer."""

    enabled: bool = False
    special_str: str = DEFAULT_SPECIAL_STR
    check_layers: tuple[int, ...] = DEFAULT_CHECK_LAYERS
    recompute_ratios: tuple[float, ...] = DEFAULT_RECOMPUTE_RATIOS
    min_tokens: int = DEFAULT_MIN_TOKENS

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config",
                     where_of: Callable[[str], str] | None = None) -> BlendSettings:
        """Settings from LMCache keys in ``values`` (other keys are ignored).

        ``source`` names where the values came from ("lmcache.yaml", "env"), for messages;
        ``where_of(key)``, when given, names where one key's value came from instead (values
        gathered from several places, as autoconfig does). Strings are accepted for every
        key, as environment variables give them.
        """
        def at(key: str) -> str:
            return where_of(key) if where_of is not None else _where(source, key)

        if values.get("blend_thresholds") is not None:
            raise BlendConfigError(
                f"{source}: key 'blend_thresholds' (threshold-based selection) is not supported; "
                "remove it and use blend_recompute_ratios"
            )
        enabled = parse_bool(values.get("enable_blending", False), at("enable_blending"))
        special = values.get("blend_special_str", DEFAULT_SPECIAL_STR)
        if not isinstance(special, str) or special == "":
            raise BlendConfigError(
                f"{at('blend_special_str')}: expected a non-empty string, got {special!r}"
            )
        layers_raw = values.get("blend_check_layers")
        check_layers = (
            DEFAULT_CHECK_LAYERS
            if layers_raw is None
            else tuple(_parse_list(layers_raw, at("blend_check_layers"), _to_layer))
        )
        ratios_raw = values.get("blend_recompute_ratios")
        ratios = (
            DEFAULT_RECOMPUTE_RATIOS
            if ratios_raw is None
            else tuple(_parse_list(ratios_raw, at("blend_recompute_ratios"), _to_ratio))
        )
        if len(ratios) == 1 and len(check_layers) > 1:
            ratios = ratios * len(check_layers)
        min_tokens = parse_int(
            values.get("blend_min_tokens", DEFAULT_MIN_TOKENS), at("blend_min_tokens")
        )
        try:
            return cls(enabled, special, check_layers, ratios, min_tokens)
        except BlendConfigError as err:
            raise BlendConfigError(f"{source}: {err}") from None

    def to_lmcache_dict(self) -> dict[str, Any]:
        """These settings as LMCache YAML keys (what ``from_mapping`` reads back to equal settings)."""
        return {
            "enable_blending": self.enabled,
            "blend_special_str": self.special_str,
            "blend_check_layers": list(self.check_layers),
            "blend_recompute_ratios": list(self.recompute_ratios),
            "blend_min_tokens": self.min_tokens,
        }

    def check_model(self, num_layers: int, model: str = "the model") -> None:
        """Refuse check layers the model does not have (call once the model is known)."""
        bad = [layer for layer in self.check_layers if layer >= num_layers]
        if bad:
            raise BlendConfigError(
                f"blend_check_layers: layer {bad[0]} does not exist in {model} ({num_layers} layers); "
                f"use layers 0..{num_layers - 1}, e.g. [1]"
            )

    def recompute_counts(self, num_blended_tokens: int) -> tuple[int, ...]:
        """Tokens kept for recompute after each check layer (LMCache rounds down)."""
        return tuple(math.floor(r * num_blended_tokens + 1e-9) for r in self.recompute_ratios)


def _validate(s: BlendSettings) -> None:
    if not s.check_layers:
        raise BlendConfigError("blend_check_layers: give at least one layer, e.g. [1]")
    if any(b <= a for a, b in zip(s.check_layers, s.check_layers[1:])):
        raise BlendConfigError(
            f"blend_check_layers: {list(s.check_layers)} must be strictly increasing, e.g. [1] or [1, 4]"
        )
    if len(s.recompute_ratios) != len(s.check_layers):
        raise BlendConfigError(
            f"blend_recompute_ratios: {len(s.recompute_ratios)} values for {len(s.check_layers)} check layers; "
            "give one ratio per check layer (or a single ratio for all)"
        )
    if any(b > a for a, b in zip(s.recompute_ratios, s.recompute_ratios[1:])):
        raise BlendConfigError(
            f"blend_recompute_ratios: {list(s.recompute_ratios)} must not increase from one check layer "
            "to the next (each selects among the tokens the previous one kept)"
        )
    if s.min_tokens < 0:
        raise BlendConfigError(f"blend_min_tokens: {s.min_tokens} is negative; use 0 or more")


def _where(source: str, key: str) -> str:
    return f"{source}: key '{key}'"


def _parse_list(value: Any, where: str, item: Any) -> list[Any]:
    if isinstance(value, str):
        text = value.strip().strip("[]")
        parts: list[Any] = [p.strip() for p in text.split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value]
    if not parts:
        raise BlendConfigError(f"{where}: empty list; give at least one value")
    return [item(p, where) for p in parts]


def _to_layer(value: Any, where: str) -> int:
    try:
        return parse_int(value, where, minimum=0, maximum=4096)
    except ConfigError as err:
        raise BlendConfigError(f"{err} (layer indices start at 0)") from None


def _to_ratio(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise BlendConfigError(f"{where}: expected a fraction in [0, 1], got {value!r}")
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise BlendConfigError(f"{where}: expected a fraction in [0, 1] such as 0.15, got {value!r}") from None
    if not math.isfinite(ratio) or not 0.0 <= ratio <= 1.0:
        raise BlendConfigError(f"{where}: {value!r} is outside [0, 1]; give a fraction such as 0.15")
    return ratio


def load_blend_settings(env: Mapping[str, str] | None = None) -> BlendSettings:
    """Blending keys from the LMCache YAML (``LMCACHE_CONFIG_FILE``) overridden by ``LMCACHE_<KEY>`` env."""
    import os

    from lmi_cache.config.cache_config import CONFIG_FILE_ENV, read_yaml_mapping

    env = os.environ if env is None else env
    path = unquote_env(env.get(CONFIG_FILE_ENV, ""))
    values: dict[str, Any] = blend_keys_in(read_yaml_mapping(path)) if path else {}
    values.update(blend_keys_in_env(env))
    return BlendSettings.from_mapping(values, path or "environment")
