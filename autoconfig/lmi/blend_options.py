"""Blending settings at container start: LMI options, the user's LMCache YAML, ``LMCACHE_*`` env -> BlendSettings.

Run by ``configure`` / ``serve`` (through ``autoconfig.lmi.properties``) before vLLM
starts; torch-free. The server reads blending from the LMCache YAML with
``LMCACHE_<KEY>`` on top (``lmi_cache.blend.connector.load_blend_settings``);
this module computes the same answer beforehand, so the plan, the summary and
the start-up checks say blending is on exactly when ``LmiCacheConnector`` will blend:

- auto-configuration: ``option.lmcache_enable_blending`` and the
  ``option.lmcache_blend_*`` knobs (``OPTION_*`` alike), written into the
  rendered YAML;
- the user's own YAML (``option.lmcache_config_file``): its ``enable_blending``
  and ``blend_*`` keys (the LMI options are refused there: the file is the
  configuration and is used unchanged);
- either way, ``LMCACHE_ENABLE_BLENDING`` / ``LMCACHE_BLEND_*`` win, as in LMCache.

With ``option.lmcache_engine=lmcache`` (upstream LMCache) the LMI option is
refused: lmi-cache wires and checks only its own blender. ``enable_blending``
in the user's YAML or ``LMCACHE_*`` env is LMCache's own setting, read by
upstream LMCache itself; it is passed through untouched and the plan says so.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmi_cache.blend.settings import BLEND_KEYS, BlendConfigError, BlendSettings, blend_keys_in, blend_keys_in_env
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.lmi.properties import RawOption

# LMI option -> LMCache key (option.lmcache_<key>, as every other lmcache_* option).
BLEND_OPTIONS: dict[str, str] = {f"lmcache_{key}": key for key in BLEND_KEYS}


class BlendOptionError(UserError):
    """A blending option that cannot be used as given (names the option and what to do)."""


def resolve_blend(options: Mapping[str, RawOption], env: Mapping[str, str], config_file: Path | None,
                  config_where: str, engine: str) -> tuple[BlendSettings, str]:
    """(settings as the server will read them, where ``enable_blending`` was set or "")."""
    given = [options[name] for name in BLEND_OPTIONS if name in options]
    if given and config_file is not None:
        raise BlendOptionError(
            f"{given[0].where}: the blending options configure auto-configuration's YAML, but {config_where} "
            f"gives your own; put {BLEND_OPTIONS[given[0].name]} in {config_file.name} (or set "
            f"LMCACHE_{BLEND_OPTIONS[given[0].name].upper()}) instead")
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    shown = ""  # how messages show the enable_blending setting that counts, e.g. "OPTION_X=true"
    if config_file is not None:
        for key, value in _yaml_blend_keys(config_file).items():
            values[key], where[key] = value, str(config_file)
        shown = f"{config_file}: enable_blending: {values.get('enable_blending')}"
    for opt in given:
        key = BLEND_OPTIONS[opt.name]
        values[key], where[key] = opt.value.strip(), opt.where
        if key == "enable_blending":
            shown = f"{opt.where}={opt.value.strip()}"
    for key, value in blend_keys_in_env(env).items():
        name = f"LMCACHE_{key.upper()}"
        values[key], where[key] = value, f"environment variable {name}"
        if key == "enable_blending":
            shown = f"environment variable {name}={env[name]}"
    if not values:
        return BlendSettings(), ""
    sources = sorted(set(where.values()))
    try:
        settings = BlendSettings.from_mapping(values, " + ".join(sources),
                                              where_of=lambda key: _named(where.get(key, sources[0]), key))
    except BlendConfigError as err:
        raise BlendOptionError(str(err)) from None
    if settings.enabled and engine == "lmcache" and where.get("enable_blending") in {o.where for o in given}:
        raise BlendOptionError(
            f"{shown} with option.lmcache_engine=lmcache: lmi-cache wires and checks only its own "
            "blender (upstream LMCache's needs its layerwise mode and model support of its own, and is deprecated "
            "there); remove option.lmcache_engine to blend with lmi-cache, or set enable_blending in your "
            "LMCache YAML for upstream LMCache to read itself")
    return settings, shown if settings.enabled else ""


def _named(where: str, key: str) -> str:
    """How a message names one key's value: options and variables name the key already, a file does not."""
    return where if where.startswith(("environment variable", "option.")) or ": option." in where \
        else f"{where}: key '{key}'"


def _yaml_blend_keys(path: Path) -> dict[str, Any]:
    """The blending keys of the user's YAML; an unreadable file is reported by the config checks, not here."""
    from lmi_cache.config.cache_config import read_yaml_mapping

    try:
        data = read_yaml_mapping(str(path))
    except (UserError, OSError):
        return {}
    return blend_keys_in(data)
