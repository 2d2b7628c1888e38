"""Which documented way in turns the KV cache on (container start, through ``autoconfig.lmi.properties``).

Run by every command's settings resolution, before anything is planned. The
ways in, first match wins:

1. ``option.lmcache_auto_config=true``: a planned YAML;
2. ``option.lmcache_config_file``: the user's YAML;
3. LMI's LMCache recipe (``option.kv_transfer_config`` naming LMCache's
   connector): ``LMCACHE_CONFIG_FILE`` when set, else a planned YAML;
4. ``LMCACHE_CONFIG_FILE`` alone: that YAML, as LMCache reads it;
5. ``LMCACHE_<KEY>`` variables alone: LMCache's settings from the environment.

Otherwise the cache is off, and an ``lmcache_*`` option that only a cache reads
is an error naming the option and what to add (``refuse_cache_options``):
nothing is silently ignored.
Pure apart from reading the environment mapping it is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from autoconfig.lmi.recipe import CONFIG_ENV, LmcacheRecipe
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.lmi.properties import RawOption

ENV_WHERE = f"environment variable {CONFIG_ENV}"
TURN_ON = ("add option.lmcache_auto_config=true (or option.lmcache_config_file, or LMCACHE_CONFIG_FILE) "
           "to turn the cache on")


class CacheWayError(UserError):
    """Settings that ask for the cache in two ways, or configure a cache nothing turns on."""


@dataclass(frozen=True)
class CacheSource:
    auto: bool  # a planned YAML
    config_file: Path | None  # the user's YAML
    config_where: str  # how messages name where config_file came from ("" when none)
    env_only: bool = False  # LMCACHE_<KEY> variables alone configure the cache

    @property
    def on(self) -> bool:
        return self.auto or self.config_file is not None or self.env_only


def cache_source(options: Mapping[str, "RawOption"], env: Mapping[str, str], model_dir: Path | None, auto: bool,
                 config_file: Path | None, recipe: LmcacheRecipe | None, engine: str,
                 notes: list[str]) -> CacheSource:
    """The way in these settings take; notes say which one, and what another setting gave way to."""
    from lmi_cache.config.cache_config import unquote_env
    from lmi_cache.config.env import env_override_names

    where = options["lmcache_config_file"].where if "lmcache_config_file" in options else ""
    env_file = _env_config_file(unquote_env(env.get(CONFIG_ENV, "")).strip(), model_dir)
    if auto and config_file is not None:
        raise CacheWayError(f"{options['lmcache_auto_config'].where}=true and {where} are both set: choose one "
                            "(auto-configuration writes its own LMCache config)")
    if auto and env_file is not None:
        raise CacheWayError(f"{options['lmcache_auto_config'].where}=true and {ENV_WHERE} are both set: choose one "
                            f"(auto-configuration writes its own LMCache config and points {CONFIG_ENV} at it)")
    if config_file is not None and env_file is not None and env_file != config_file:
        notes.append(f"{where} overrides {ENV_WHERE} (the option names the YAML the server reads)")
    if recipe is not None:
        if not auto and config_file is None:
            if env_file is not None:
                config_file, where = env_file, ENV_WHERE
            else:
                auto = True
        notes.append(recipe.describe(engine, auto, config_file))
        return CacheSource(auto, config_file, where)
    if auto or config_file is not None:
        return CacheSource(auto, config_file, where)
    if env_file is not None:
        notes.append(f"cache on: {ENV_WHERE}={env_file} (LMCache's way in; lmi-cache's connector reads it)")
        return CacheSource(False, env_file, ENV_WHERE)
    named = env_override_names(env)
    if named:
        notes.append(f"cache on: configured by {', '.join(named)} alone (LMCache's way in; LMCache's defaults "
                     "for the rest)")
        return CacheSource(False, None, "", env_only=True)
    return CacheSource(False, None, "")


def refuse_cache_options(options: Mapping[str, "RawOption"]) -> None:
    """With the cache off, an lmcache_* option would be dropped: say which, and what turns the cache on.

    Called where the cache is set up (configure, so serve and plan too), not while parsing.
    """
    for name in sorted(options):
        saying_no = options[name].value.strip().lower() == "false"  # lmcache_enable_blending=false asks for nothing
        if name.startswith("lmcache_") and name != "lmcache_auto_config" and not saying_no:
            raise CacheWayError(f"{options[name].where}: configures the KV cache, which nothing turns on; {TURN_ON}")


def _env_config_file(raw: str, model_dir: Path | None) -> Path | None:
    if not raw:
        return None
    path = Path(raw)
    if path.is_absolute():
        return path
    if model_dir is None:
        raise CacheWayError(f"{ENV_WHERE}={raw[:200]!r}: relative, but no model directory is known; "
                            "use an absolute path")
    return model_dir / path
