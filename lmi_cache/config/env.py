"""The LMCACHE_* environment side of the configuration: which variables are keys, which override a file.

Used by ``lmi_cache.config.cache_config`` (every process that reads engine settings) and by
``autoconfig`` at container start, to list the variables that override a YAML.
Torch-free.
"""
from __future__ import annotations

import difflib
import os
from typing import Mapping

from lmi_cache.config.keys import (
    DEPRECATED_ALIASES,
    ENV_NON_KEY_NAMES,
    ENV_NON_KEY_PREFIXES,
    EXTRA_CONFIG_KEYS,
    LEGACY_KEYS,
    LMCACHE_KEYS,
)

__all__ = ["env_names", "env_override_line", "env_override_names", "env_where", "misspelt_env_warnings"]


def env_names() -> dict[str, str]:
    """LMCACHE_<KEY> variable -> key, for every key, alias and legacy key."""
    return {f"LMCACHE_{key.upper()}": key for key in list(LMCACHE_KEYS) + list(DEPRECATED_ALIASES) + list(LEGACY_KEYS)}


def env_override_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The LMCACHE_<KEY> variables set in ``env`` that override an LMCache YAML (or a plan written as one).

    LMCache's rule, which lmi_cache follows: the environment wins over the file. Names only:
    values can hold credentials (remote_url, extra_config).
    """
    env = os.environ if env is None else env
    return sorted(name for name in env_names() if name in env)


def env_override_line(names: list[str]) -> str:
    """The one wording every command uses for LMCACHE_<KEY> variables overriding a YAML (planned or the user's)."""
    verb = "overrides" if len(names) == 1 else "override"
    return f"{', '.join(names)} {verb} the LMCache YAML (the environment wins over the file, as in LMCache)"


def env_where(key: str) -> str:
    head, _, inner = key.partition(".")  # "extra_config.use_odirect" -> env LMCACHE_EXTRA_CONFIG: key 'use_odirect'
    return f"env LMCACHE_{head.upper()}" + (f": key {inner!r}" if inner else "")


def misspelt_env_warnings(env: Mapping[str, str]) -> list[str]:
    known = env_names()
    out = []
    for name in sorted(n for n in env if n.startswith("LMCACHE_") and n not in known):
        rest = name[len("LMCACHE_"):]
        if rest in ENV_NON_KEY_NAMES or rest.startswith(ENV_NON_KEY_PREFIXES):
            continue
        if rest.lower() in EXTRA_CONFIG_KEYS:  # LMCache reads extra_config from one variable, as a mapping
            out.append(f"env {name}: not an LMCache variable, ignored; {rest.lower()} is an extra_config key: set "
                       f"LMCACHE_EXTRA_CONFIG='{{\"{rest.lower()}\": ...}}'")
            continue
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.85)
        if close:
            out.append(f"env {name}: not an LMCache setting, ignored; did you mean {close[0]}?")
    return out
